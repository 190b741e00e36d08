"""Rings ordered around a pair that no rail connects.

When every rail between two ranks is gone while both are alive (a partition of
that pair alone), the call in flight finishes through the store
(:mod:`resilient.collectives.relay`): slow, but nothing is lost. From the next call on, the
schedules avoid the pair instead: each rank lists in its signature row the peers
it reaches on no rail, every rank reads the same rows, and every rank orders its
rings with :func:`resilient.collectives.ring_plan.avoiding_ring` so that the pair are never
neighbours (a mesh needs every pair, so the schedules are rings then). Once a
link of the pair is repaired and in service at both ends, the rows stop naming it
and the natural order (and the mesh) comes back.

A re-ordered ring reduces in another order, so its results are identical on every
rank and equal to the fault-free ones within float rounding, not bit for bit.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable

from resilient import events
from resilient.collectives.engine import RingEngine
from resilient.collectives.ring_plan import avoiding_ring
from resilient.collectives.signature import Exchange
from resilient.links.table import LinkTable

__all__ = ["cut_off_peers", "follow_cuts"]

logger = logging.getLogger(__name__)


def cut_off_peers(
    tables: Iterable[LinkTable], usable: Callable[[int, int, LinkTable], bool]
) -> list[int]:
    """Peers that some table reaches on no rail now: each rail's link to them is
    broken or its NIC is down at either end (``usable`` is the health board's
    ``usable(peer, rail, table)``).

    Every table counts: a control link the rings kept off the pair carries nothing,
    and takes the store (and makes the pair cut again) the moment the order goes
    back to natural while it is still broken. Only peers with a broken link are
    looked at: this runs before every exchange, and a healthy table has none.
    """
    out: set[int] = set()
    for table in tables:
        rails = range(len(table.rails))
        for peer in {p for (p, _), link in table.links().items() if link.broken}:
            if not any(usable(peer, r, table) for r in rails):
                out.add(peer)
    return sorted(out)


def follow_cuts(engine: RingEngine, exchange: Exchange, *, announce: bool = False) -> None:
    """Set ``engine``'s ring order from the pairs ``exchange`` shows cut off (every
    rank calls this with the same exchange, before the call's data moves).

    ``announce``: log the change and write a ``link.rerouted`` event (once per
    group, not per engine).
    """
    cut = exchange.cut_pairs()
    order = avoiding_ring(engine.world, cut)
    if order == engine.order:
        return
    before, engine.order = engine.order, order
    if not announce:
        return
    pairs = ", ".join(f"{a}-{b}" for a, b in sorted(cut))
    if order is not None:
        action = f"rings in the order {'-'.join(map(str, order))} from call {exchange.seq}"
        reason = f"no rail connects {pairs}"
    elif cut:
        action = f"no ring avoids them: their messages keep going through the store ({pairs})"
        reason = f"no rail connects {pairs}"
    else:
        action = f"natural ring order (and mesh) again from call {exchange.seq}"
        reason = f"the pairs avoided by {'-'.join(map(str, before or ()))} are connected again"
    logger.warning("rank %d (call %d): %s; %s", engine.rank, exchange.seq, reason, action)
    events.emit(
        "link.rerouted",
        links=[(a, b, -1) for a, b in sorted(cut)],
        reason=reason,
        action=action,
    )
