"""How a process group declares a peer lost and gives up the epoch's calls.

A peer is lost when its links closed on every rail (:mod:`resilient.detect.lost_peer`,
watched by :mod:`resilient.detect.peer_watch`), when another rank reports it gone
through the health board, or when the launcher announced its replacement and its
links here show closed (:mod:`resilient.detect.announcements`). :class:`PeerLoss`
holds that verdict for the current epoch (the epoch control resets it when the
group moves on) and reads the epoch through :class:`EpochView`.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Protocol

from resilient import events
from resilient.detect.lost_peer import dead_peer, departed_peer, left_in_order
from resilient.errors import PeerLost
from resilient.group import rescue

if TYPE_CHECKING:
    import torch
    from torch._C._distributed_c10d import Store

    from resilient.check.exchange import CallChecks
    from resilient.detect.health_board import HealthBoard
    from resilient.links.table import LinkTable

__all__ = ["ABANDON_GRACE_S", "LOSS_GRACE_S", "EpochView", "PeerLoss"]

logger = logging.getLogger(__name__)

# How long ops of an abandoned epoch may still finish before their links are cut.
ABANDON_GRACE_S = 0.3
LOSS_GRACE_S = 1.0


class EpochView(Protocol):
    """What :class:`PeerLoss` reads of the current epoch (the epoch control)."""

    epoch: int
    members: tuple[int, ...]  # the ranks taking part in this epoch
    pos: int  # this rank's number among them
    board: HealthBoard
    checks: CallChecks | None

    def tables(self) -> list[LinkTable]: ...


class PeerLoss:
    """The peer loss of the current epoch: found, declared, published.

    ``rank`` is this rank in the whole group, ``rails`` the number of rails, and
    ``store`` where a survivor publishes its last exchange (resilient.group.rescue).
    """

    def __init__(self, epoch: EpochView, *, rank: int, rails: int, store: Store) -> None:
        self._epoch = epoch
        self._rank, self._rails, self._store = rank, rails, store
        # Set when a peer is gone: every later call fails at once with it, until
        # recovery.Session moves the group to the next epoch (which clears it).
        self.lost: PeerLost | None = None
        self._lock = threading.Lock()
        # Told of each loss this group declares (the world group tells its subgroups).
        self.on_declared: Callable[[PeerLost], None] | None = None

    def check_lost(self) -> PeerLost | None:
        """After a failed call: is a peer gone (detect.lost_peer)? Sets :attr:`lost`."""
        if self.lost is not None:
            return self.lost
        ep = self._epoch
        peer = dead_peer(ep.tables(), self._rails, ep.board)
        why = f"its connections closed on all {self._rails} rail(s)"
        if peer is None:
            peer = departed_peer(ep.tables())
            why = "it shut its group down before the links this rank needed were built"
        if peer is None:
            return None
        checks = ep.checks
        if left_in_order(ep.board, peer, checks.submitted if checks else None):
            if peer not in ep.board.departed:
                ep.board.departed.add(peer)
                logger.info(
                    "rank %d (epoch %d): rank %d shut its group down after all of this "
                    "rank's calls", self._rank, ep.epoch, ep.members[peer],
                )  # fmt: skip
            return None
        return self.declare(peer, why)

    def await_lost(self) -> PeerLost | None:
        """After a failed call: the lost peer, if one is known within LOSS_GRACE_S.

        A survivor's own link error often comes a few milliseconds before the loss
        is established (the dead peer's other rails close, or another rank's report
        reaches the health board); raising the bare LinkError then would end a job
        that can recover (seen in CI: a survivor failed 20 ms after the kill, 40 ms
        before a peer declared the loss). A link error with no loss behind it is
        raised LOSS_GRACE_S later.
        """
        deadline = time.monotonic() + LOSS_GRACE_S
        while (lost := self.check_lost()) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return lost

    def reported(self, peer: int, reporter: int) -> None:
        """Health board callback: ``reporter`` saw ``peer`` gone (both positions)."""
        self.declare(peer, f"rank {self._epoch.members[reporter]} saw it gone")

    def declare(self, peer: int, why: str) -> PeerLost:
        """Give up this epoch's calls because ``peer`` is gone; tell the others.

        ``peer`` is a position in this epoch; :class:`PeerLost` names its rank.
        Every later call fails at once; exchanges not started are failed and
        nothing fails over. An op still pending after ``ABANDON_GRACE_S`` has its
        link cut: its peer gave the call up too, so it would only end at its
        deadline. Ops between survivors that were both in the same call finish
        within that time, and their links stay for the next epoch.
        """
        ep = self._epoch
        with self._lock:
            if self.lost is not None:
                return self.lost
            real = ep.members[peer]
            lost = PeerLost(
                f"rank {self._rank} (epoch {ep.epoch}): rank {real} is gone: {why}",
                peer=real,
                epoch=ep.epoch,
            )
            self.lost = lost
        events.emit(
            "rank.lost", epoch=ep.epoch, links=[(ep.pos, peer, -1)], reason=why,
            action="fail this step's calls at once; recover through the store",
        )  # fmt: skip
        logger.warning("rank %d (epoch %d): rank %d lost: %s", self._rank, ep.epoch, real, why)
        self._give_up(lost, peer, f"rank {real} was lost: this epoch's calls are given up")
        if self.on_declared is not None:
            self.on_declared(lost)
        return lost

    def abandon(self, why: str) -> PeerLost:
        """Give up this epoch's calls though none of this group's peers is gone: the
        world group lost a rank and recovery replays the step on every group (a
        subgroup of survivors only would otherwise run a call some members gave up).
        Returns the error its calls now fail with (``peer`` -1)."""
        ep = self._epoch
        with self._lock:
            if self.lost is not None:
                return self.lost
            lost = PeerLost(f"rank {self._rank} (epoch {ep.epoch}): {why}", epoch=ep.epoch)
            self.lost = lost
        logger.info("rank %d (epoch %d): calls given up: %s", self._rank, ep.epoch, why)
        self._give_up(lost, -1, why)
        return lost

    def _give_up(self, lost: PeerLost, peer: int, reason: str) -> None:
        """Fail the pending exchanges, freeze the links, publish this rank's last
        exchange, and cut what is still busy after ABANDON_GRACE_S."""
        ep = self._epoch
        if ep.checks is not None:
            ep.checks.fail_pending(PeerLost(str(lost), peer=lost.peer, epoch=ep.epoch))
        if peer >= 0:
            ep.board.mark_lost(peer)
        for table in ep.tables():
            table.abandoned = reason
            table.freeze()
        if ep.checks is not None:
            seq, last = ep.checks.last
            threading.Thread(
                target=rescue.publish, args=(self._store, ep.epoch, ep.pos, seq, last),
                name=f"rescue-publish-{ep.pos}", daemon=True,
            ).start()  # fmt: skip
        timer = threading.Timer(ABANDON_GRACE_S, self._cut_busy, args=(lost, reason))
        timer.daemon = True
        timer.start()

    def rescue_exchange(self, seq: int) -> torch.Tensor | None:
        """The table of exchange ``seq`` if another survivor completed it after this
        rank's copy failed for a lost peer (resilient.group.rescue); None otherwise."""
        lost = self.await_lost()
        ep = self._epoch
        if lost is None or lost.epoch != ep.epoch:
            return None
        gone = ep.members.index(lost.peer) if lost.peer in ep.members else -1
        others = [p for p in range(len(ep.members)) if p not in (ep.pos, gone)]
        return rescue.fetch(self._store, ep.epoch, others, seq)

    def probe(self, rank: int) -> None:
        """The launcher announced ``rank``'s replacement: if its links here show
        closed, it is lost now (see resilient.detect.announcements)."""
        ep = self._epoch
        if rank == self._rank or rank not in ep.members or self.lost is not None:
            return
        peer = ep.members.index(rank)
        links = [link for t in ep.tables() for (p, _), link in t.links().items() if p == peer]
        for link in links:
            link.check_closed()
        # gloo closes a socket whose peer closed it even with no op posted, so an
        # idle link shows "gone", not "closed by the peer": with the launcher's
        # word that the process exited, that is enough (an announcement for a rank
        # already replaced finds the new incarnation's links open; links we cut
        # ourselves prove nothing).
        gone = [(k.broken and k.peer_closed) or (k.socket_gone and not k.cut_reason) for k in links]
        if links and all(gone):
            self.declare(peer, "the launcher saw its process exit; its links here closed")

    def _cut_busy(self, lost: PeerLost, reason: str) -> None:
        if self.lost is lost:  # not recovered yet
            cut = sum(table.cut_busy(reason) for table in self._epoch.tables())
            if cut:
                logger.info(
                    "rank %d (epoch %d): cut %d link(s) still busy %.1f s after rank %d was lost",
                    self._rank, self._epoch.epoch, cut, ABANDON_GRACE_S, lost.peer,
                )  # fmt: skip
