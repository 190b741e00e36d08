"""Moving a donor's state to a replacement over a data link, and building an epoch's
links ahead of first use (:class:`StateTransfer`, over the group's epoch control).
:class:`recovery.session.Session` drives both through the process group.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence

import torch

from resilient.collectives.engine import RingEngine
from resilient.errors import LinkError, RecoveryError
from resilient.group.epoch_control import EpochControl
from resilient.links import repair, transfer
from resilient.links.build_turns import Wanted
from resilient.links.table import Link, LinkTable

__all__ = ["StateTransfer"]

logger = logging.getLogger(__name__)


class StateTransfer:
    """State transfers and link builds ahead for the epoch ``epochs`` runs."""

    def __init__(self, epochs: EpochControl) -> None:
        self._epochs = epochs

    def prebuild_links(self, transfers: Sequence[int] = ()) -> threading.Thread | None:
        """Build this epoch's missing links in the background: the control mesh,
        then the data links the engine reaches (every peer for a mesh, else the ring
        neighbours), on every rail, in the order every rank builds in. First, in
        this thread, the links to the ranks in ``transfers`` (this rank's state
        transfers: both ends name each other) that :meth:`send_state` will use: a
        background build waits for the joiner's, and builds take turns
        (resilient.links.gloo_sockets), so the transfer must not queue behind it.

        Built on first use instead, a replacement's links (five rendezvous through
        the store) sat between its restore and its replayed step; here they overlap
        the transfer and its forward pass. Failures are left to first use.

        Raises:
            RecoveryError: no rail reaches a rank in ``transfers``.
        """
        ep = self._epochs
        for peer in transfers:
            self._transfer_link(ep.position(peer, "prebuild_links"), None)
        engine = ep.engine
        if not isinstance(engine, RingEngine) or len(ep.members) < 2:
            return None
        pos, world = ep.pos, len(ep.members)
        everyone = [p for p in range(world) if p != pos]
        data = everyone if engine.mesh else sorted({engine.left, engine.right} - {pos})
        plan = [(ep.checks.engine.links, everyone)] if ep.checks is not None else []
        plan.append((ep.links, data))
        rails = range(len(ep.rails))
        # Said here, before the replayed step's calls ask for links: their builds
        # then wait for their turn behind these, in the one global order, instead
        # of running ahead of them (a two-rail ring asks for its neighbours only;
        # see resilient.links.build_turns).
        wanted = [
            (table, table.want((p, r) for p in peers for r in rails)) for table, peers in plan
        ]
        thread = threading.Thread(
            target=self._build, args=(wanted,), name=f"prebuild-{ep.rank}", daemon=True
        )
        thread.start()
        repair.strand(thread)  # the group's shutdown waits for it
        return thread

    def _build(self, plan: list[tuple[LinkTable, Wanted]]) -> None:
        """Build ``plan``'s links (table, wanted) while their epoch lasts (a later
        epoch numbers its members anew and builds its own links: ``ensure`` raises)."""
        ep = self._epochs
        try:
            for table, wanted in plan:
                table.ensure(wanted=wanted)
        except (LinkError, RuntimeError) as exc:  # first use tries again
            logger.info(
                "rank %d (epoch %d): building links ahead failed: %s", ep.rank, ep.epoch, exc
            )  # fmt: skip
        finally:
            for table, wanted in plan:
                table.unwant(wanted)

    def send_state(
        self,
        peer: int,
        header: bytes | bytearray | memoryview,
        tensors: Sequence[torch.Tensor],
        rail: int | None = None,
    ) -> None:
        """Send a state (``header`` and ``tensors``, see :mod:`resilient.links.transfer`)
        to ``peer`` over the data link on ``rail`` (default: the first rail whose
        link could be built; built if needed).

        Raises:
            ValueError: a tensor is not a contiguous CPU tensor.
            RecoveryError: the link failed, no rail reaches the peer, or the peer did
                not take the bytes in time.
        """
        link = self._transfer_link(self._epochs.position(peer, "send_state"), rail)
        transfer.send_state(link, header, tensors)

    def recv_state(self, peer: int, allocate: transfer.Allocate, rail: int | None = None) -> int:
        """Receive what ``peer`` sends with :meth:`send_state` (same ``rail``):
        ``allocate`` gets the header and returns the tensors to receive into.
        Returns the bytes received.

        Raises:
            RecoveryError: the link failed, no rail reaches the peer, or the bytes do
                not match their SHA-256.
        """
        link = self._transfer_link(self._epochs.position(peer, "recv_state"), rail)
        return transfer.recv_state(link, allocate)

    def _transfer_link(self, pos: int, rail: int | None) -> Link:
        """The link to ``pos`` on ``rail``, or on the first rail where it was built.

        Both ends agree on which links were built (LinkTable.ensure), so both pick
        the same rail.

        Raises:
            RecoveryError: no rail reaches ``pos``.
        """
        ep = self._epochs
        rails = range(len(ep.rails)) if rail is None else [rail]
        try:
            for r in rails:
                link = ep.links.get(pos, r)
                if not link.broken:
                    return link
        except LinkError as exc:
            raise RecoveryError(f"rank {ep.rank}: no link for the state: {exc}") from exc
        raise RecoveryError(
            f"rank {ep.rank} (epoch {ep.epoch}): no rail reaches rank "
            f"{ep.members[pos]} for the state (tried {list(rails)})"
        )
