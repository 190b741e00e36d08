"""What a process group runs for one epoch, and how it moves on to the next.

:class:`EpochControl` is held by :class:`~resilient.process_group.ResilientProcessGroup`
and owns what lives for one epoch: the members and this rank's number among them,
the engines, the health board, the call checks (:class:`~resilient.check.exchange.
CallChecks`) with their elided calls, the rail-weight learner and the straggler
watches, and the peer loss (:class:`~resilient.group.peer_loss.PeerLoss`). It stops
the epoch for a recovery (:meth:`EpochControl.quiesce`) and continues at the next
one with the links both ends kept (:meth:`EpochControl.enter_epoch`, which builds
the epoch's board, checks and learners: :meth:`EpochControl.setup`).
:class:`recovery.session.Session` drives it through the group.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch._C._distributed_c10d import Store

from resilient import events
from resilient.check.elision import ElidedCalls
from resilient.check.exchange import CallChecks
from resilient.collectives.engine import RingEngine
from resilient.collectives.reorder import cut_off_peers, follow_cuts
from resilient.collectives.signature import Exchange
from resilient.collectives.solo import SoloEngine
from resilient.config import DataPlaneConfig
from resilient.detect.health_board import HealthBoard
from resilient.detect.nic import NicMonitor
from resilient.detect.rail_weights import DOWN, WeightLearner, agreed_backups
from resilient.detect.retransmits import RailLoss
from resilient.detect.slow_rank import SendRates, SlowRankVote
from resilient.detect.stragglers import StragglerWatch, Verdicts
from resilient.errors import MembershipError, PeerLost, RecoveryError
from resilient.group.cuda_staging import HostStaging, StagedEngine
from resilient.group.peer_loss import PeerLoss
from resilient.links.repair import CTL_TABLE, DATA_TABLE, install_agreed, staged_rows
from resilient.links.table import Counters, Link, LinkTable

__all__ = ["EpochControl"]


class EpochControl:
    """One process group's current epoch over its data ``links``.

    ``rank`` and ``world`` are this rank and the size of the whole group (an
    epoch after a shrink has fewer ``members``); ``nics`` and ``verdicts`` outlive
    the epochs. A ``joining`` replacement runs its calls alone (a
    :class:`~resilient.collectives.solo.SoloEngine`) until :meth:`enter_epoch`
    admits it; any other group calls :meth:`setup` for its first epoch.
    """

    def __init__(
        self,
        *,
        rank: int,
        world: int,
        rails: tuple[str, ...],
        links: LinkTable,
        store: Store,
        config: DataPlaneConfig,
        nics: NicMonitor,
        verdicts: Verdicts,
        epoch: int,
        joining: bool,
    ) -> None:
        self.rank, self.world, self.rails = rank, world, rails
        self.links, self.store, self.config = links, store, config
        self.nics, self.verdicts = nics, verdicts
        self.epoch = epoch
        self.members: tuple[int, ...] = tuple(range(world))  # all ranks, or fewer
        self.pos = rank  # this rank's number among the members: inside the epoch
        # A replacement runs its calls alone until it is admitted (resilient.collectives.solo).
        self.joining = joining
        self.engine: RingEngine | SoloEngine = (
            SoloEngine(rank, world) if joining else self.new_engine(links, world)
        )
        self._static_weights = self.engine.weights if isinstance(self.engine, RingEngine) else ()
        self.cuda: RingEngine | None = None  # built on the first CUDA tensor (engine_for)
        # CUDA tensors over the CPU links through pinned host memory (cuda_transport
        # "socket"): ranks may share a GPU.
        self.staging = HostStaging(rank=rank) if config.cuda_transport == "socket" else None
        self.board = HealthBoard(rank=rank, world=world, store=store, epoch=epoch)
        self.checks: CallChecks | None = None
        self.elided: ElidedCalls | None = None
        self.learner: WeightLearner | None = None
        self.slow_vote: SlowRankVote | None = None
        self.send_rates: SendRates | None = None
        self.rail_loss = RailLoss(self._retransmissions)
        self.stragglers = StragglerWatch(rank, epoch, verdicts)
        self.peer_loss = PeerLoss(self, rank=rank, rails=len(rails), store=store)
        # A subgroup's: its tables of each kind ("link", "ctl", "p2p") borrow the
        # world group's connections (resilient.group.shared_links); None: build own.
        self.borrowing: Callable[[str], Callable[[int, int], Link | None] | None] | None = None

    @property
    def lost(self) -> PeerLost | None:
        """The peer loss this group saw in this epoch, or None."""
        return self.peer_loss.lost

    def tables(self) -> list[LinkTable]:
        """The epoch's link tables: the data links, and the control links if any."""
        return [self.links] + ([self.checks.engine.links] if self.checks else [])

    # -- one epoch ----------------------------------------------------------------------
    def setup(self, epoch: int, ctl_links: LinkTable | None) -> None:
        """Build what lives for one epoch over :attr:`links` (and ``ctl_links``, the
        control links kept from the last epoch, if any)."""
        engine = self.engine
        assert isinstance(engine, RingEngine)
        self.epoch = epoch
        self._watchers(engine)
        # Failovers are acknowledged only with two rails or more; the relay needs that.
        relay = self.config.relay_via_store and len(self.rails) > 1
        engine.relay = relay
        self._new_board(engine)
        if self.config.check_mismatch and len(self.members) > 1:
            self._open_checks(engine, ctl_links, relay)
        self.board.start()

    def _watchers(self, engine: RingEngine) -> None:
        """The epoch's learners and meters: rail weights, rail loss, stragglers, slow ranks."""
        # Everything of an epoch numbers its members 0..M-1 (M < world after a shrink).
        rank, world_size, epoch = self.pos, len(self.members), self.epoch
        # Learned rail weights ride on the signature exchange (every rank sees every
        # rank's rates there); explicit RESILIENT_RAIL_WEIGHTS turn learning off.
        learn = (
            self.config.learn_rail_weights
            and self.config.rail_weights is None
            and len(self.rails) > 1
        )
        self.learner = WeightLearner(engine.weights, rank, epoch) if learn else None
        # A lossy rail is proposed slower than it measures (see resilient.detect.retransmits).
        self.rail_loss = RailLoss(self._retransmissions)
        self.stragglers = StragglerWatch(rank, epoch, self.verdicts)
        events.set_members(self.members if world_size < self.world else None)
        self.verdicts.reset(self.members)
        # The straggler-aware all_reduce is a mesh schedule, and its evidence comes
        # from mesh reductions.
        self.slow_vote = (
            SlowRankVote(
                rank,
                world_size,
                epoch,
                sink=self.verdicts,
                explained=lambda r: self.stragglers.state(r) != "ok",
            )
            if self.config.straggler_schedule
            and self.config.check_mismatch
            and engine.mesh
            and world_size >= 3
            else None
        )
        self.send_rates = SendRates() if self.slow_vote is not None else None
        engine.lag_meter = self.send_rates

    def _new_board(self, engine: RingEngine) -> None:
        """Who sees which NIC or link dead: cuts our end of links peers report dead,
        so the collectives fail over at once instead of at their deadline."""
        self.board = HealthBoard(
            rank=self.pos, world=len(self.members), store=self.store, epoch=self.epoch,
            repair_timeout_s=self.config.repair_timeout_s if self.config.repair_links else None,
        )  # fmt: skip
        # A NIC that went down in an earlier epoch is still down: this epoch's board
        # must say so, and no link is built on it (see LinkTable.ensure).
        self.board.seed_nic_down(r for r, up in enumerate(self.nics.up) if not up)
        self.nics.epoch = self.epoch
        self.links.refuse = self._refuse_link
        self.links.gone = self._peer_gone
        self.board.attach(self.links)
        self.board.on_lost = self.peer_loss.reported
        engine.board = self.board

    def _open_checks(self, engine: RingEngine, ctl_links: LinkTable | None, relay: bool) -> None:
        """The epoch's call checks over control links (``ctl_links`` if kept)."""
        checks = CallChecks(
            rank=self.pos,
            world=len(self.members),
            rail_addresses=self.rails,
            store=self.store,
            config=self.config,
            epoch=self.epoch,
            rates=self._proposed_rates if self.learner is not None else None,
            lagging=self._lagging if self.slow_vote is not None else None,
            staged=self._staged_rows,
            cut=self._cut_off,
            rescue=self.peer_loss.rescue_exchange,
            on_install=self.board.publish,
            links=ctl_links,
        )
        self.checks = checks
        # Rebuilt links go into service on a call both ends agree on (the
        # exchange shows them staged at both ends; see resilient.links.repair).
        self.links.stage_installs = True
        checks.engine.links.stage_installs = True
        checks.engine.links.refuse = self._refuse_link
        checks.engine.links.gone = self._peer_gone
        if self.borrowing is not None:
            checks.engine.links.borrow = self.borrowing(checks.engine.links.name)
        self.board.attach(checks.engine.links)
        checks.engine.board = self.board
        checks.engine.relay = relay
        self.elided = ElidedCalls(
            checks, engine=engine, links=self.links, board=self.board,
            stragglers=self.stragglers, rank=self.rank, epoch=self.epoch,
        )  # fmt: skip

    def follow(self, exchange: Exchange) -> RingEngine:
        """Act on a full exchange before its call's data moves (every rank alike):
        the agreed rail weights, the straggler clocks, links to put in service, cut
        pairs, a slow rank. Returns the engine the call runs on."""
        engine = self.engine
        assert isinstance(engine, RingEngine)
        if self.learner is not None:
            # A safe boundary: every rank sets the same weights before any
            # data of this call moves.
            engine.weights = self.learner.weights_for(exchange)
            engine.backups = agreed_backups(exchange.rates, engine.num_rails)
        self.stragglers.observe(exchange)
        # Put data links staged at both ends in service before this call's data.
        if install_agreed(self.links, exchange.staged, self.pos, DATA_TABLE):
            self.board.publish()
        follow_cuts(engine, exchange, announce=True)
        if self.slow_vote is not None:
            engine.slow_rank = self.slow_vote.decide(exchange.seq, exchange.lagging)
        return engine

    def _peer_gone(self, peer: int) -> str | None:
        """Why ``peer`` (a position) will never come to build a link: it shut its
        group down (its board record says so), or None."""
        left = self.board.peer_left_after(peer)
        return None if left is None else f"rank {peer} shut its group down"

    def _refuse_link(self, peer: int, rail: int) -> str | None:
        """Why not to build a link to ``peer`` (a position) on ``rail`` now, or None."""
        if not self.nics.up[rail]:
            return f"the NIC of rail {rail} is down at rank {self.rank}"
        if not self.nics.steady(rail):
            return f"the NIC of rail {rail} went down at rank {self.rank} moments ago"
        if not self.board.nic_up_both(peer, rail):
            return f"rank {self.members[peer]} reported its NIC of rail {rail} down"
        return None

    # -- what each exchange row carries -------------------------------------------------
    def _staged_rows(self) -> list[tuple[int, int, int, int]]:
        tables = {DATA_TABLE: self.links}
        if self.checks is not None:
            tables[CTL_TABLE] = self.checks.engine.links
        return staged_rows(tables)

    def _cut_off(self) -> list[int]:
        """Peers reached on no rail now (data or control links): the exchange's rows
        say so, and every rank's rings avoid those pairs (resilient.collectives.reorder)."""
        return cut_off_peers(self.tables(), self.board.usable)

    def _lagging(self) -> tuple[int, int, int]:
        return self.send_rates.lagging if self.send_rates is not None else (-1, 1000, 0)

    def _proposed_rates(self) -> tuple[float, ...]:
        # A rail with its NIC down or a broken link here proposes DOWN: every rank
        # then gives it no share at all until it is repaired (see resilient.detect.rail_weights).
        engine = self.engine
        assert isinstance(engine, RingEngine)
        return tuple(
            rate * self.rail_loss.factor(rail)
            if self.nics.up[rail] and self.board.rail_ok(rail)
            else DOWN
            for rail, rate in enumerate(engine.rail_rates)
        )

    def _retransmissions(self) -> dict[int, tuple[int, int]]:
        """Per rail: (segments retransmitted, segments sent) over its data links."""
        out: dict[int, tuple[int, int]] = {}
        for (_, rail), link in self.links.links().items():
            counters = link.sent()
            if counters is not None:
                retrans, segs = out.get(rail, (0, 0))
                out[rail] = (retrans + counters[2], segs + counters[3])
        return out

    # -- members --------------------------------------------------------------------------
    def position(self, rank: int, what: str) -> int:
        """``rank``'s number inside this epoch.

        Raises:
            MembershipError: ``rank`` left the group (it shrank without it).
        """
        if rank not in self.members:
            raise MembershipError(
                f"rank {self.rank} (epoch {self.epoch}): {what} names rank {rank}, which "
                f"left the group (members now {list(self.members)})"
            )
        return self.members.index(rank)

    def need_every_rank(self, op: str) -> None:
        """Raises MembershipError for an op whose shapes need all ranks of the group."""
        if len(self.members) != self.world:
            raise MembershipError(
                f"rank {self.rank} (epoch {self.epoch}): {op} needs all {self.world} "
                f"ranks; the group runs with {len(self.members)} after a shrink "
                "(all_reduce, broadcast and barrier work over the members)"
            )

    # -- engines ------------------------------------------------------------------------
    def engine_for(self, t: torch.Tensor) -> RingEngine | SoloEngine | StagedEngine:
        """The CPU engine (socket links by default), the CPU engine through pinned host
        memory (CUDA tensors with cuda_transport "socket"), or the CUDA one (NCCL pair
        links), built lazily."""
        if t.device.type != "cuda" or isinstance(self.engine, SoloEngine):
            return self.engine
        if self.staging is not None:
            return StagedEngine(self.engine, self.staging)
        if self.cuda is None:
            links = LinkTable(
                rank=self.pos,
                rails=self.rails,
                store=self.store,
                config=self.config,
                epoch=self.epoch,
                device_type="cuda",
            )
            self.cuda = self.new_engine(links, len(self.members))
            self.board.attach(links)
            self.cuda.board = self.board
        return self.cuda

    def new_engine(self, links: LinkTable, world: int) -> RingEngine:
        """An engine over ``links`` with this group's schedule settings."""
        config = self.config
        return RingEngine(
            rank=links.rank,
            world=world,
            links=links,
            weights=config.rail_weights,
            sub_chunk_bytes=config.sub_chunk_bytes,
            mesh=config.meshes(world),
            # An explicit "mesh" means mesh for every size.
            mesh_below_bytes=1 << 62 if config.topology == "mesh" else config.mesh_below_bytes,
            single_rail_below_bytes=config.single_rail_below_bytes,
            mesh_split=config.topology == "mesh",
        )

    def close(self) -> None:
        """Close the checks, the engines and every link (the group's shutdown)."""
        if self.checks is not None:
            self.checks.close()
        self.engine.close()
        self.links.close()
        if self.cuda is not None:
            self.cuda.close()
            self.cuda.links.close()
        if self.staging is not None:
            self.staging.close()

    # -- between epochs -------------------------------------------------------------------
    def quiesce(self, timeout_s: float) -> dict[str, list[Counters] | None]:
        """Stop the epoch's threads once its calls are through, and return the op
        counters of the links still standing (``data``; ``ctl`` is None when the
        control thread did not stop in time, so none of its links can be trusted)."""
        self.board.stop(wait_repair=False)
        ctl = None
        if self.checks is not None and self.checks.stop(timeout_s):
            ctl = self._named(self.checks.engine.links.counters())
        return {"data": self._named(self.links.counters()), "ctl": ctl}

    def _named(self, counters: list[Counters]) -> list[Counters]:
        """Link counters with each peer's position replaced by its rank."""
        return [(self.members[c[0]], *c[1:]) for c in counters]

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
        new = tuple(sorted(members)) if members is not None else self.members
        if self.rank not in new:
            raise RecoveryError(f"rank {self.rank}: epoch {epoch} goes on without it ({new})")
        cur = {r: i for i, r in enumerate(self.members)}
        nxt = {r: i for i, r in enumerate(new)}
        renumber = {cur[r]: nxt[r] for r in new if r in cur}
        pos = nxt[self.rank]

        def local(keep: list[tuple[int, int]]) -> list[tuple[int, int]]:
            return [(cur[p], rail) for p, rail in keep if p in cur and p in nxt]

        old = self.checks
        ctl_links = old.engine.links if old is not None and keep_ctl is not None else None
        if old is not None and ctl_links is None:
            old.abandon()
        dropped = self.links.renew(epoch, local(keep_data), rank=pos, renumber=renumber)
        if ctl_links is not None:
            dropped += ctl_links.renew(epoch, local(keep_ctl or []), rank=pos, renumber=renumber)
        changed = new != self.members
        self.members, self.pos = new, pos
        self._renew_engines(changed)
        self.joining = False
        self.peer_loss.lost = None
        self.nics.start()  # a replacement's first epoch; no-op when already watching
        self.setup(epoch, ctl_links)
        return dropped

    def _renew_engines(self, members_changed: bool) -> None:
        """A new CPU engine for new members (or a joiner's first), the static
        weights back, and the CUDA engine closed (built again on first use)."""
        if isinstance(self.engine, SoloEngine) or members_changed:
            # Not waiting: a rail thread may still sit in an op of the failed call.
            self.engine.close(wait=False)
            self.engine = self.new_engine(self.links, len(self.members))
            self._static_weights = self.engine.weights
        self.engine.weights = self._static_weights
        self.engine.new_epoch()
        if self.cuda is not None:
            self.cuda.close()
            self.cuda.links.close()
            self.cuda = None
