"""An elided all_reduce that takes the ring: a gate first, then the ring.

An elided call (:mod:`resilient.collectives.digest_check`) skips its signature
exchange, so every rank must hear every peer's digest before it writes anything:
if any two ranks' calls differ, every rank refuses the call and all fall back
together. The mesh does it with its own first messages (every peer's contribution
comes before any fold). A ring cannot: a rank hears from its left neighbour only,
so the neighbours of a rank whose call differs would refuse while the others
waited in the ring for messages that never come.

So an elided all_reduce the ring takes (one cut across several rails, or one of
``mesh_below_bytes`` and up) exchanges a header-only *gate* frame with every peer
first (:func:`resilient.collectives.alltoall.gate`: one C step on rail 0, with the
acknowledgements a failover needs on several rails), and runs the ring only once
every peer's frame came with the call's digest; the ring's tags start after the
gate's. A peer whose call differs sends another digest or a hello there, so every
rank refuses at the gate with nothing written. The gate costs one round of empty
frames where a checked call exchanges its rows on the control links (DDP on two
rails, whose calls are cut across both: docs/BENCHMARKS.md).
"""

from __future__ import annotations

import torch

from resilient.collectives.alltoall import gate
from resilient.collectives.engine import RingEngine
from resilient.collectives.reduce_ops import Reduce

__all__ = ["all_reduce", "ring_elides"]


def ring_elides(engine: RingEngine, nbytes: int) -> bool:
    """Whether an elided all_reduce of ``nbytes`` runs gated on the ring (the same
    verdict on every rank: it follows from the call's size and what the epoch
    agreed). The mesh's own elided calls are not these."""
    return (
        engine.mesh  # links to every peer allowed (and more than two ranks)
        and engine.slow_rank is None
        and engine.order is None
        and engine.links.sockets
        and not engine.uses_mesh(nbytes)
    )


def all_reduce(engine: RingEngine, flat: torch.Tensor, op: Reduce) -> None:
    """``engine.all_reduce(flat, op)``; an elided call the ring takes gates first.

    Raises:
        NotElided: the call runs elided and cannot be (nothing was posted).
        DigestMismatch: it runs elided and a peer's call differs (nothing was
            written into ``flat``).
        LinkError, PeerLost: as any collective.
    """
    nbytes = flat.numel() * flat.element_size()
    if flat.device.type != "cpu" or not ring_elides(engine, nbytes):
        engine.all_reduce(flat, op)  # the mesh gates an elided call itself
    elif engine.elided is None:
        # Links are built in checked calls only (a rendezvous with a peer that left
        # would wait for its timeout, where an exchange fails at once): the links a
        # later elided call's gate needs are built in this one.
        engine.links.ensure((p, r) for r in range(engine.num_rails) for p in _peers(engine))
        engine.all_reduce(flat, op)
    else:
        gate(engine)
        engine.all_reduce(flat, op, gated=True)


def _peers(engine: RingEngine) -> list[int]:
    return [p for p in range(engine.world) if p != engine.rank]
