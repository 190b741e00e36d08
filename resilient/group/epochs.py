"""The rank-level recovery side of :class:`~resilient.process_group.ResilientProcessGroup`.

Kept apart from the collectives: how a group declares a peer lost and gives up
the epoch's calls (:mod:`resilient.detect.lost_peer`, :mod:`resilient.detect.peer_watch`), stops
for a recovery (:meth:`EpochControl.quiesce`), continues at the next epoch with
the links both ends kept (:meth:`EpochControl.enter_epoch`, which builds the
epoch's board, signature channel and learners: ``_setup_epoch``), and moves a
donor's state over a data link. :class:`recovery.session.Session` drives it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch
from torch._C._distributed_c10d import Store
from torch.futures import Future

from resilient import events
from resilient.check.exchange import SignatureChannel
from resilient.collectives.engine import RingEngine
from resilient.collectives.solo import SoloEngine
from resilient.config import DataPlaneConfig
from resilient.detect.health_board import HealthBoard
from resilient.detect.lost_peer import dead_peer, left_in_order
from resilient.detect.rail_weights import WeightLearner
from resilient.detect.retransmits import RailLoss
from resilient.detect.slow_rank import SendRates, SlowRankVote
from resilient.detect.stragglers import StragglerWatch, Verdicts
from resilient.errors import LinkError, MembershipError, PeerLost, RecoveryError
from resilient.group import rescue
from resilient.links import repair, transfer
from resilient.links.table import Counters, Link, LinkTable

if TYPE_CHECKING:
    from collections.abc import Callable

    from resilient.detect.nic import NicMonitor
    from resilient.group.handoff import Handoff

__all__ = ["ABANDON_GRACE_S", "EpochControl"]

logger = logging.getLogger(__name__)

# How long ops of an abandoned epoch may still finish before their links are cut.
ABANDON_GRACE_S = 0.3
LOSS_GRACE_S = 1.0


class EpochControl:
    """Mixed into the process group; the attributes below are the group's."""

    links: LinkTable
    rails: tuple[str, ...]
    engine: RingEngine | SoloEngine
    board: HealthBoard
    nics: NicMonitor
    incarnation: int
    _epoch: int
    _members: tuple[int, ...]  # the ranks taking part in this epoch (all, or fewer)
    _pos: int  # this rank's position among them: its number inside the epoch
    _store: Store
    _joining: bool
    _lost: PeerLost | None
    _lost_lock: threading.Lock
    _channel: SignatureChannel | None
    _cuda: RingEngine | None
    _static_weights: tuple[float, ...]
    _calls_in: int
    _calls_out: int
    _queue: Handoff[tuple[Callable[[], Any], Future[Any]] | None]
    config: DataPlaneConfig
    _learner: WeightLearner | None
    _loss: RailLoss
    _stragglers: StragglerWatch
    verdicts: Verdicts
    _slow_vote: SlowRankVote | None
    _send_rates: SendRates | None

    if TYPE_CHECKING:  # the group's own methods (never shadowed at run time)

        def rank(self) -> int: ...
        def size(self) -> int: ...
        def _new_engine(self, links: LinkTable, world: int) -> RingEngine: ...
        def _proposed_rates(self) -> tuple[float, ...]: ...
        def _lagging(self) -> tuple[int, int, int]: ...
        def _staged_rows(self) -> list[tuple[int, int, int, int]]: ...
        def _cut_off(self) -> list[int]: ...
        def _retransmissions(self) -> dict[int, tuple[int, int]]: ...

    def _setup_epoch(self, epoch: int, ctl_links: LinkTable | None) -> None:
        """Build what lives for one epoch over ``self.links`` (and ``ctl_links``, the
        control links kept from the last epoch, if any)."""
        # Everything of an epoch numbers its members 0..M-1 (M < world after a shrink).
        rank, world_size = self._pos, len(self._members)
        engine = self.engine
        assert isinstance(engine, RingEngine)
        self._epoch = epoch
        # Learned rail weights ride on the signature exchange (every rank sees every
        # rank's rates there); explicit RESILIENT_RAIL_WEIGHTS turn learning off.
        learn = (
            self.config.learn_rail_weights
            and self.config.rail_weights is None
            and len(self.rails) > 1
        )
        self._learner = WeightLearner(engine.weights, rank, epoch) if learn else None
        # A lossy rail is proposed slower than it measures (see resilient.detect.retransmits).
        self._loss = RailLoss(self._retransmissions)
        self._stragglers = StragglerWatch(rank, epoch, self.verdicts)
        events.set_members(self._members if world_size < self.size() else None)
        self.verdicts.reset(self._members)
        # The straggler-aware all_reduce is a mesh schedule, and its evidence comes
        # from mesh reductions.
        self._slow_vote = (
            SlowRankVote(
                rank,
                world_size,
                epoch,
                sink=self.verdicts,
                explained=lambda r: self._stragglers.state(r) != "ok",
            )
            if self.config.straggler_schedule
            and self.config.check_mismatch
            and engine.mesh
            and world_size >= 3
            else None
        )
        self._send_rates = SendRates() if self._slow_vote is not None else None
        engine.lag_meter = self._send_rates
        # Failovers are acknowledged only with two rails or more; the relay needs that.
        relay = self.config.relay_via_store and len(self.rails) > 1
        engine.relay = relay
        # Who sees which NIC or link dead: cuts our end of links peers report dead,
        # so the collectives fail over at once instead of at their deadline.
        self.board = HealthBoard(
            rank=rank, world=world_size, store=self._store, epoch=epoch,
            repair_timeout_s=self.config.repair_timeout_s if self.config.repair_links else None,
        )  # fmt: skip
        # A NIC that went down in an earlier epoch is still down: this epoch's board
        # must say so, and no link is built on it (see LinkTable.ensure).
        self.board.seed_nic_down(r for r, up in enumerate(self.nics.up) if not up)
        self.nics.epoch = epoch
        self.links.refuse = self._refuse_link
        self.board.attach(self.links)
        self.board.on_lost = self._peer_reported_lost
        engine.board = self.board
        if self.config.check_mismatch and world_size > 1:
            self._channel = SignatureChannel(
                rank=rank,
                world=world_size,
                rail_addresses=self.rails,
                store=self._store,
                config=self.config,
                epoch=epoch,
                rates=self._proposed_rates if self._learner is not None else None,
                lagging=self._lagging if self._slow_vote is not None else None,
                staged=self._staged_rows,
                cut=self._cut_off,
                rescue=self._rescue_exchange,
                on_install=self.board.publish,
                links=ctl_links,
            )
            # Rebuilt links go into service on a call both ends agree on (the
            # exchange shows them staged at both ends; see resilient.links.repair).
            self.links.stage_installs = True
            self._channel.engine.links.stage_installs = True
            self._channel.engine.links.refuse = self._refuse_link
            self.board.attach(self._channel.engine.links)
            self._channel.engine.board = self.board
            self._channel.engine.relay = relay
        self.board.start()

    def _refuse_link(self, peer: int, rail: int) -> str | None:
        """Why not to build a link to ``peer`` (a position) on ``rail`` now, or None."""
        if not self.nics.up[rail]:
            return f"the NIC of rail {rail} is down at rank {self.rank()}"
        if not self.nics.steady(rail):
            return f"the NIC of rail {rail} went down at rank {self.rank()} moments ago"
        if not self.board.nic_up_both(peer, rail):
            return f"rank {self._members[peer]} reported its NIC of rail {rail} down"
        return None

    @property
    def epoch(self) -> int:
        return self._epoch

    @property
    def members(self) -> tuple[int, ...]:
        """The ranks taking part in this epoch: all of them, or fewer after a shrink."""
        return self._members

    def _position(self, rank: int, what: str) -> int:
        """``rank``'s number inside this epoch.

        Raises:
            MembershipError: ``rank`` left the group (it shrank without it).
        """
        if rank not in self._members:
            raise MembershipError(
                f"rank {self.rank()} (epoch {self._epoch}): {what} names rank {rank}, which "
                f"left the group (members now {list(self._members)})"
            )
        return self._members.index(rank)

    def _need_every_rank(self, op: str) -> None:
        """Raises MembershipError for an op whose shapes need all ``size()`` ranks."""
        if len(self._members) != self.size():
            raise MembershipError(
                f"rank {self.rank()} (epoch {self._epoch}): {op} needs all {self.size()} "
                f"ranks; the group runs with {len(self._members)} after a shrink "
                "(all_reduce, broadcast and barrier work over the members)"
            )

    @property
    def store(self) -> Store:
        """The store links rendezvous through (etcd or the init store)."""
        return self._store

    @property
    def joining(self) -> bool:
        """True for a replacement that was not admitted yet (its calls run alone)."""
        return self._joining

    @property
    def lost(self) -> PeerLost | None:
        """The peer loss this group saw in this epoch, or None."""
        return self._lost

    def _check_lost(self) -> PeerLost | None:
        """After a failed call: is a peer gone (detect.lost_peer)? Sets :attr:`lost`."""
        if self._lost is not None:
            return self._lost
        peer = dead_peer(self._tables(), len(self.rails), self.board)
        if peer is None:
            return None
        channel = self._channel
        if left_in_order(self.board, peer, channel.submitted if channel else None):
            if peer not in self.board.departed:
                self.board.departed.add(peer)
                logger.info(
                    "rank %d (epoch %d): rank %d shut its group down after all of this "
                    "rank's calls: its connections closed in order", self.rank(),
                    self._epoch, self._members[peer],
                )  # fmt: skip
            return None
        return self._declare_lost(peer, f"its connections closed on all {len(self.rails)} rail(s)")

    def _await_lost(self) -> PeerLost | None:
        """After a failed call: the lost peer, if one is known within LOSS_GRACE_S.

        A survivor's own link error often comes a few milliseconds before the loss
        is established (the dead peer's other rails close, or another rank's report
        reaches the health board); raising the bare LinkError then would end a job
        that can recover (seen in CI: a survivor failed 20 ms after the kill, 40 ms
        before a peer declared the loss). A link error with no loss behind it is
        raised LOSS_GRACE_S later.
        """
        deadline = time.monotonic() + LOSS_GRACE_S
        while (lost := self._check_lost()) is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return lost

    def _peer_reported_lost(self, peer: int, reporter: int) -> None:
        """Health board callback: ``reporter`` saw ``peer`` gone (both positions)."""
        self._declare_lost(peer, f"rank {self._members[reporter]} saw it gone")

    def _declare_lost(self, peer: int, why: str) -> PeerLost:
        """Give up this epoch's calls because ``peer`` is gone; tell the others.

        ``peer`` is a position in this epoch; :class:`PeerLost` names its rank.
        Every later call fails at once; exchanges not started are failed and
        nothing fails over. An op still pending after ``ABANDON_GRACE_S`` has its
        link cut: its peer gave the call up too, so it would only end at its
        deadline. Ops between survivors that were both in the same call finish
        within that time, and their links stay for the next epoch.
        """
        with self._lost_lock:
            if self._lost is not None:
                return self._lost
            real = self._members[peer]
            lost = PeerLost(
                f"rank {self.rank()} (epoch {self._epoch}): rank {real} is gone: {why}",
                peer=real,
                epoch=self._epoch,
            )
            self._lost = lost
        events.emit(
            "rank.lost", epoch=self._epoch, links=[(self._pos, peer, -1)], reason=why,
            action="fail this step's calls at once; recover through the store",
        )  # fmt: skip
        logger.warning("rank %d (epoch %d): rank %d lost: %s", self.rank(), self._epoch, real, why)
        reason = f"rank {real} was lost: this epoch's calls are given up"
        if self._channel is not None:
            self._channel.fail_pending(PeerLost(str(lost), peer=real, epoch=self._epoch))
        self.board.mark_lost(peer)
        for table in self._tables():
            table.abandoned = reason
            table.freeze()
        if self._channel is not None:
            seq, last = self._channel.last
            threading.Thread(
                target=rescue.publish, args=(self._store, self._epoch, self._pos, seq, last),
                name=f"rescue-publish-{self._pos}", daemon=True,
            ).start()  # fmt: skip
        timer = threading.Timer(ABANDON_GRACE_S, self._cut_busy, args=(lost, reason))
        timer.daemon = True
        timer.start()
        return lost

    def _rescue_exchange(self, seq: int) -> torch.Tensor | None:
        """The table of exchange ``seq`` if another survivor completed it after this
        rank's copy failed for a lost peer (resilient.group.rescue); None otherwise."""
        lost = self._await_lost()
        if lost is None or lost.epoch != self._epoch:
            return None
        gone = self._members.index(lost.peer) if lost.peer in self._members else -1
        others = [p for p in range(len(self._members)) if p not in (self._pos, gone)]
        return rescue.fetch(self._store, self._epoch, others, seq)

    def _probe_peer(self, rank: int) -> None:
        """The launcher announced ``rank``'s replacement: if its links here show
        closed, it is lost now (see resilient.detect.announcements)."""
        if rank == self.rank() or rank not in self._members or self._lost is not None:
            return
        peer = self._members.index(rank)
        links = [link for t in self._tables() for (p, _), link in t.links().items() if p == peer]
        for link in links:
            link.check_closed()
        # gloo closes a socket whose peer closed it even with no op posted, so an
        # idle link shows "gone", not "closed by the peer": with the launcher's
        # word that the process exited, that is enough (an announcement for a rank
        # already replaced finds the new incarnation's links open; links we cut
        # ourselves prove nothing).
        gone = [(k.broken and k.peer_closed) or (k.socket_gone and not k.cut_reason) for k in links]
        if links and all(gone):
            self._declare_lost(peer, "the launcher saw its process exit; its links here closed")

    def _busy(self) -> bool:
        return self._calls_in != self._calls_out

    def _tables(self) -> list[LinkTable]:
        return [self.links] + ([self._channel.engine.links] if self._channel else [])

    def _cut_busy(self, lost: PeerLost, reason: str) -> None:
        if self._lost is lost:  # not recovered yet
            cut = sum(table.cut_busy(reason) for table in self._tables())
            if cut:
                logger.info(
                    "rank %d (epoch %d): cut %d link(s) still busy %.1f s after rank %d was lost",
                    self.rank(), self._epoch, cut, ABANDON_GRACE_S, lost.peer,
                )  # fmt: skip

    def quiesce(self, timeout_s: float) -> dict[str, list[Counters] | None]:
        """Let queued calls fail, stop the epoch's threads, and return the op counters
        of the links still standing (``data``; ``ctl`` is None when the control
        thread did not stop in time, so none of its links can be trusted).

        Raises:
            RecoveryError: the communication thread is still busy after ``timeout_s``.
        """
        idle = threading.Event()
        marker: Future[Any] = Future()
        self._queue.put((idle.set, marker))
        if not idle.wait(timeout_s):
            raise RecoveryError(
                f"rank {self.rank()} (epoch {self._epoch}): calls of the failed step still "
                f"running after {timeout_s:.1f} s"
            )
        self.board.stop(wait_repair=False)
        ctl = None
        if self._channel is not None and self._channel.stop(timeout_s):
            ctl = self._named(self._channel.engine.links.counters())
        return {"data": self._named(self.links.counters()), "ctl": ctl}

    def _named(self, counters: list[Counters]) -> list[Counters]:
        """Link counters with each peer's position replaced by its rank."""
        return [(self._members[c[0]], *c[1:]) for c in counters]

    def enter_epoch(
        self,
        epoch: int,
        *,
        keep_data: list[tuple[int, int]],
        keep_ctl: list[tuple[int, int]] | None,
        members: tuple[int, ...] | None = None,
    ) -> int:
        """Continue at ``epoch`` with ``members`` (default: the same ranks), keeping
        only the listed (peer rank, rail) links (same objects); every other link
        is closed and built again on first use. Call after :meth:`quiesce` (a
        joiner: at admission). Returns links dropped.

        Raises:
            RecoveryError: this rank is not among ``members``.
        """
        new = tuple(sorted(members)) if members is not None else self._members
        if self.rank() not in new:
            raise RecoveryError(f"rank {self.rank()}: epoch {epoch} goes on without it ({new})")
        cur = {r: i for i, r in enumerate(self._members)}
        nxt = {r: i for i, r in enumerate(new)}
        renumber = {cur[r]: nxt[r] for r in new if r in cur}
        pos = nxt[self.rank()]

        def local(keep: list[tuple[int, int]]) -> list[tuple[int, int]]:
            return [(cur[p], rail) for p, rail in keep if p in cur and p in nxt]

        old = self._channel
        ctl_links = old.engine.links if old is not None and keep_ctl is not None else None
        if old is not None and ctl_links is None:
            old.abandon()
        dropped = self.links.renew(epoch, local(keep_data), rank=pos, renumber=renumber)
        if ctl_links is not None:
            dropped += ctl_links.renew(epoch, local(keep_ctl or []), rank=pos, renumber=renumber)
        changed = new != self._members
        self._members, self._pos = new, pos
        if isinstance(self.engine, SoloEngine) or changed:
            # Not waiting: a rail thread may still sit in an op of the failed call.
            self.engine.close(wait=False)
            self.engine = self._new_engine(self.links, len(new))
            self._static_weights = self.engine.weights
        self.engine.weights = self._static_weights
        self.engine.new_epoch()
        if self._cuda is not None:
            self._cuda.close()
            self._cuda.links.close()
            self._cuda = None
        self._joining = False
        self._lost = None
        self.nics.start()  # a replacement's first epoch; no-op when already watching
        self._setup_epoch(epoch, ctl_links)
        return dropped

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
        for peer in transfers:
            self._transfer_link(self._position(peer, "prebuild_links"), None)
        engine = self.engine
        if not isinstance(engine, RingEngine) or len(self._members) < 2:
            return None
        pos, world = self._pos, len(self._members)
        everyone = [p for p in range(world) if p != pos]
        data = everyone if engine.mesh else sorted({engine.left, engine.right} - {pos})
        plan = [(self._channel.engine.links, everyone)] if self._channel is not None else []
        plan.append((self.links, data))
        rails, epoch = range(len(self.rails)), self._epoch

        def build() -> None:
            for table, peers in plan:
                try:
                    for pair in table.in_order((p, r) for p in peers for r in rails):
                        # One at a time: a later epoch (another loss) numbers its
                        # members anew and builds its own links.
                        if self._epoch != epoch or table.closed or table.abandoned:
                            return
                        table.ensure([pair])
                except (LinkError, RuntimeError) as exc:  # first use tries again
                    logger.info(
                        "rank %d (epoch %d): building %s links ahead failed: %s",
                        self.rank(), self._epoch, table.name, exc,
                    )  # fmt: skip
                    return

        thread = threading.Thread(target=build, name=f"prebuild-{self.rank()}", daemon=True)
        thread.start()
        repair.strand(thread)  # the group's shutdown waits for it
        return thread

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
        link = self._transfer_link(self._position(peer, "send_state"), rail)
        transfer.send_state(link, header, tensors)

    def recv_state(self, peer: int, allocate: transfer.Allocate, rail: int | None = None) -> int:
        """Receive what ``peer`` sends with :meth:`send_state` (same ``rail``):
        ``allocate`` gets the header and returns the tensors to receive into.
        Returns the bytes received.

        Raises:
            RecoveryError: the link failed, no rail reaches the peer, or the bytes do
                not match their SHA-256.
        """
        link = self._transfer_link(self._position(peer, "recv_state"), rail)
        return transfer.recv_state(link, allocate)

    def _transfer_link(self, pos: int, rail: int | None) -> Link:
        """The link to ``pos`` on ``rail``, or on the first rail where it was built.

        Both ends agree on which links were built (LinkTable.ensure), so both pick
        the same rail.
        """
        rails = range(len(self.rails)) if rail is None else [rail]
        try:
            for r in rails:
                link = self.links.get(pos, r)
                if not link.broken:
                    return link
        except LinkError as exc:
            raise RecoveryError(f"rank {self.rank()}: no link for the state: {exc}") from exc
        raise RecoveryError(
            f"rank {self.rank()} (epoch {self._epoch}): no rail reaches rank "
            f"{self._members[pos]} for the state (tried {list(rails)})"
        )

    # -- engines ------------------------------------------------------------------------
