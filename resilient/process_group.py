"""``ResilientProcessGroup``: a real ``torch.distributed.ProcessGroup`` over links.

Collectives run on one communication thread per group, in the order they were
issued, and return a :class:`ResilientWork` whose future completes when the call
does, so DDP overlaps them with backward as with gloo. Each is a mesh or ring
schedule over links (:mod:`resilient.collectives.engine`, :mod:`resilient.links`).

Before the data moves, ranks exchange a small signature of the call (op, reduce
op, dtype, shapes, sequence number). If ranks disagree, every rank raises
:class:`~resilient.errors.CollectiveMismatch` naming the ranks and what differed,
and the group stays usable, because no data phase was started. While the group
is quiet most calls skip that exchange and are checked by a digest in their data
messages instead, falling back to it when a rank refuses one
(:mod:`resilient.collectives.digest_check`); nothing is folded before every peer's
digest was seen.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Store

from resilient.collectives.engine import RingEngine
from resilient.collectives.solo import SoloEngine
from resilient.config import DataPlaneConfig
from resilient.detect.announcements import watch_announcements
from resilient.detect.gpu import GpuHealth
from resilient.detect.health_board import HealthBoard
from resilient.detect.nic import NicMonitor
from resilient.detect.peer_watch import PeerWatch
from resilient.detect.stragglers import Verdicts
from resilient.errors import PeerLost
from resilient.group import live_groups, shared_links
from resilient.group.alltoall import AllToAllCalls
from resilient.group.calls import CallRunner
from resilient.group.epoch_control import EpochControl
from resilient.group.gathers import GatherCalls
from resilient.group.live_groups import fail_subgroups, tell_world
from resilient.group.p2p import PointToPoint
from resilient.group.reductions import ReduceCalls
from resilient.group.rooted import RootedCalls
from resilient.group.state_transfer import StateTransfer
from resilient.group.work import ResilientWork
from resilient.links import lending, repair, transfer
from resilient.links.lending import Lender
from resilient.links.table import Counters, Link, LinkTable

__all__ = ["ResilientProcessGroup", "ResilientWork", "live_subgroups"]


logger = logging.getLogger(__name__)


def live_subgroups() -> list[ResilientProcessGroup]:
    """This process's subgroups (new_group, DeviceMesh dimensions) not shut down."""
    return [pg for pg in live_groups.live_subgroups() if isinstance(pg, ResilientProcessGroup)]


class ResilientProcessGroup(dist.ProcessGroup):
    """A process group whose calls are schedules over per-rail links.

    Every collective, p2p and all-to-all call torch.distributed makes (README's
    table), for every dtype gloo takes; anything else raises ``NotImplementedError``
    naming the op. Errors of a call surface from ``Work.wait()``. What lives for one
    epoch is :attr:`epochs`' (:class:`~resilient.group.epoch_control.EpochControl`);
    each family of calls is built by its class in :mod:`resilient.group`.
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        rails: Sequence[str],
        store: Store,
        config: DataPlaneConfig | None = None,
        epoch: int = 0,
        incarnation: int = 0,
        joining: bool = False,
        job_ranks: Sequence[int] | None = None,
        timeout: timedelta | None = None,
    ) -> None:
        super().__init__(rank, world_size)  # type: ignore[call-arg]
        # The job rank of each group rank: a subgroup's, or the world's own numbers.
        self.job_ranks = tuple(job_ranks) if job_ranks is not None else tuple(range(world_size))
        self._subgroup = job_ranks is not None
        # Set by recovery.Session on the world group: its subgroups follow each of
        # its recoveries (recovery.subgroups).
        self.subgroups_follow = False
        if len(self.job_ranks) != world_size:
            raise ValueError(f"{len(self.job_ranks)} job ranks for a group of {world_size}")
        self.config = config or DataPlaneConfig()
        self.rails = tuple(rails)
        self.incarnation = incarnation
        self.links = LinkTable(
            rank=rank, rails=self.rails, store=store, config=self.config, epoch=epoch,
            transport=self.config.data_transport,
        )  # fmt: skip
        # Confirmed stragglers for the policy (recovery.Session reads them).
        self.verdicts = Verdicts()
        # NIC state of each rail (~10 ms): nic.down/nic.up events, hooks for recovery.
        self.nics = NicMonitor(rank, self.rails)
        self.epochs = EpochControl(
            rank=rank, world=world_size, rails=self.rails, links=self.links, store=store,
            config=self.config, nics=self.nics, verdicts=self.verdicts, epoch=epoch,
            joining=joining,
        )  # fmt: skip
        self._share_links()  # before the first epoch's tables
        self._transfers = StateTransfer(self.epochs)
        self._start_health(rank, joining)
        self._calls = CallRunner(rank, self.epochs)
        self._calls.timeout = timeout
        self.reductions = ReduceCalls(
            rank=rank, epochs=self.epochs, calls=self._calls, elide=self.config.elide_every > 0
        )
        self._peer_watch = PeerWatch(
            rank, self.epochs.tables, self._calls.busy, self.epochs.peer_loss.check_lost
        )
        self._peer_watch.start()
        # This rank's member lease in etcd, when the backend joined one (closed at
        # shutdown: a departure, not an expiry).
        self.membership: Any = None
        self._join_members: Callable[[], Any] | None = None
        if not joining:
            self.epochs.setup(epoch, None)
        self.gathers = GatherCalls(
            rank=rank, size=world_size, need_every_rank=self.epochs.need_every_rank,
            engine_for=self.epochs.engine_for, submit=self._calls.submit,
        )  # fmt: skip
        self.rooted = RootedCalls(
            rank=rank, size=world_size, epochs=self.epochs, submit=self._calls.submit
        )  # fmt: skip
        self.alltoalls = AllToAllCalls(
            rank=rank, size=world_size, epochs=self.epochs, submit=self._calls.submit
        )  # fmt: skip
        self.p2p = PointToPoint(rank=rank, size=world_size, epochs=self.epochs)
        # The world group's losses are every subgroup's; a subgroup's are the world's.
        loss = self.epochs.peer_loss
        loss.on_declared = fail_subgroups if job_ranks is None else tell_world(self.job_ranks)
        live_groups.add(self)

    def _share_links(self) -> None:
        """The world group lends its connections to its subgroups, which borrow them
        (resilient.group.shared_links): no second connection where one exists."""
        self._lender: Lender | None = None
        if not self._subgroup:
            self._lender = shared_links.lender(self.epochs, lambda: getattr(self, "p2p", None))
            lending.offer(self._lender)
            return

        def borrowing(kind: str) -> Callable[[int, int], Link | None]:
            return shared_links.borrower(self.epochs, self.job_ranks, kind)

        self.epochs.borrowing = borrowing
        self.links.borrow = borrowing(shared_links.DATA)

    def _start_health(self, rank: int, joining: bool) -> None:
        """Start watching the NICs (not yet for a replacement) and the GPU."""
        self.nics.on_change(lambda rail, up: self.epochs.board.nic_changed(rail, up))
        if not joining:
            # A replacement watches from its admission (enter_epoch): a warm spare
            # may stand by for hours beside the incarnation it would replace, and
            # must not log that one's NIC events as its own.
            self.nics.start()
        # GPU health (Xid errors, throttling, NVLink) of torch's current device, set by
        # resilient.init() before the group is made; the world group's watch serves the
        # process's subgroups too. Without NVML beside CUDA: one warning and event.
        self.gpu = (
            None if self._subgroup else GpuHealth.watch_current(rank=rank, epoch=self.epochs.epoch)
        )
        if self.gpu is not None:
            self.gpu.start()

    # -- plumbing ----------------------------------------------------------------------
    def getBackendName(self) -> str:
        return "resilient"

    @property
    def name(self) -> str:  # type: ignore[override]
        return "resilient"

    # torch keeps a group's name in the C++ backends registered under it; this group
    # is its own backend (a Python one cannot be registered there), so it keeps the
    # name itself. DeviceMesh, FSDP2 and functional collectives look groups up by it.
    def _set_group_name(self, name: str) -> None:
        self._group_name = name

    @property
    def group_name(self) -> str:  # type: ignore[override]
        name: str | None = getattr(self, "_group_name", None)
        if name is None:
            raise RuntimeError("resilient process group: torch has not named this group yet")
        return name

    def _set_group_desc(self, desc: str) -> None:
        self._group_desc = desc

    @property
    def group_desc(self) -> str:  # type: ignore[override]
        return str(getattr(self, "_group_desc", "undefined"))

    def _get_backend_name(self) -> str:
        return "resilient"

    def _get_backend(self, device: Any) -> ResilientProcessGroup:  # type: ignore[override]
        # The group serves every device type it takes (cpu, cuda) itself.
        return self

    def supports_tensor_alloc(self, device: Any) -> bool:
        """No backend-owned memory (FSDP2 then allocates with torch.empty)."""
        return False

    @property
    def supports_splitting(self) -> bool:
        return False

    @property
    def engine(self) -> RingEngine | SoloEngine:
        """This epoch's engine for CPU tensors."""
        return self.epochs.engine

    @property
    def board(self) -> HealthBoard:
        """This epoch's health board."""
        return self.epochs.board

    @property
    def epoch(self) -> int:
        return self.epochs.epoch

    @property
    def members(self) -> tuple[int, ...]:
        """The ranks taking part in this epoch: all of them, or fewer after a shrink."""
        return self.epochs.members

    @property
    def store(self) -> Store:
        """The store links rendezvous through (etcd or the init store)."""
        return self.epochs.store

    @property
    def joining(self) -> bool:
        """True for a replacement that was not admitted yet (its calls run alone)."""
        return self.epochs.joining

    @property
    def lost(self) -> PeerLost | None:
        """The peer loss this group saw in this epoch, or None."""
        return self.epochs.lost

    @property
    def closed(self) -> bool:
        """Whether :meth:`shutdown` ran."""
        return self._calls.closed

    @property
    def is_subgroup(self) -> bool:
        """Made by new_group / a DeviceMesh dimension, not init_process_group."""
        return self._subgroup

    def declare_lost(self, rank: int, why: str) -> None:
        """Give this epoch's calls up because group rank ``rank`` is gone (see
        :meth:`~resilient.group.peer_loss.PeerLoss.declare`); no-op once a loss is
        known or when ``rank`` already left the group."""
        epochs = self.epochs
        if epochs.lost is None and rank in epochs.members and rank != self.rank():
            epochs.peer_loss.declare(epochs.members.index(rank), why)

    # -- membership and recovery (recovery.session.Session drives these) -----------------
    def join_members_later(self, join: Callable[[], Any]) -> None:
        """Defer taking the member key to :meth:`join_members` (a replacement)."""
        self._join_members = join

    def join_members(self) -> None:
        """Take this rank's member key now, if that was deferred; once.

        Raises:
            MembershipError: etcd refused, or a newer incarnation holds the rank.
        """
        join, self._join_members = self._join_members, None
        if join is not None:
            self.attach_membership(join())

    def attach_membership(self, membership: Any) -> None:
        """Hold ``membership`` (closed at shutdown) and watch the launcher's
        announcements through it (resilient.detect.announcements)."""
        self.membership = membership
        watch_announcements(membership, self.epochs.peer_loss.probe)

    def quiesce(self, timeout_s: float) -> dict[str, list[Counters] | None]:
        """Let queued calls fail, stop the epoch's threads, and return the op counters
        of the links still standing (``data``; ``ctl`` is None when the control
        thread did not stop in time, so none of its links can be trusted).

        Raises:
            RecoveryError: the communication thread is still busy after ``timeout_s``.
        """
        self._calls.wait_idle(timeout_s)
        return self.epochs.quiesce(timeout_s)

    def enter_epoch(
        self,
        epoch: int,
        *,
        keep_data: list[tuple[int, int]],
        keep_ctl: list[tuple[int, int]] | None,
        members: tuple[int, ...] | None = None,
    ) -> int:
        """Continue at ``epoch`` with ``members``, keeping the listed (peer rank, rail)
        links; returns links dropped (see resilient.group.epoch_control.EpochControl).

        Raises:
            RecoveryError: this rank is not among ``members``.
        """
        return self.epochs.enter_epoch(
            epoch, keep_data=keep_data, keep_ctl=keep_ctl, members=members
        )

    def prebuild_links(self, transfers: Sequence[int] = ()) -> threading.Thread | None:
        """Build this epoch's missing links in the background, those to the ranks in
        ``transfers`` first (see resilient.group.state_transfer.StateTransfer).

        Raises:
            RecoveryError: no rail reaches a rank in ``transfers``.
        """
        return self._transfers.prebuild_links(transfers)

    def send_state(
        self,
        peer: int,
        header: bytes | bytearray | memoryview,
        tensors: Sequence[torch.Tensor],
        rail: int | None = None,
    ) -> None:
        """Send a state to ``peer`` (see :mod:`resilient.group.state_transfer`).

        Raises:
            ValueError: a tensor is not a contiguous CPU tensor.
            RecoveryError: the link failed, no rail reaches the peer, or the peer did
                not take the bytes in time.
        """
        self._transfers.send_state(peer, header, tensors, rail)

    def recv_state(self, peer: int, allocate: transfer.Allocate, rail: int | None = None) -> int:
        """Receive what ``peer`` sends with :meth:`send_state`; returns the bytes.

        Raises:
            RecoveryError: the link failed, no rail reaches the peer, or the bytes do
                not match their SHA-256.
        """
        return self._transfers.recv_state(peer, allocate, rail)

    def shutdown(self) -> None:
        """Finish queued collectives, then close every link."""
        if self._calls.closed:
            return
        self._calls.closed = True
        if self._lender is not None:
            lending.withdraw(self._lender)
        self._peer_watch.stop()
        self.nics.stop()
        if self.gpu is not None:
            self.gpu.close()
        epochs = self.epochs
        epochs.board.stop()
        # gloo's constructor has been seen to overrun its bound by ~26 s.
        if (left := repair.join_stranded(self.config.repair_timeout_s * 3 + 30.0)) > 0:
            logger.warning(
                "rank %d (epoch %d): %d link build(s) or repair(s) still running at shutdown",
                epochs.pos, epochs.epoch, left,
            )  # fmt: skip
        # Before any link closes (resilient.detect.lost_peer).
        if self._calls.stop(60) and epochs.checks is not None:
            epochs.board.leave(epochs.checks.succeeded)
        self.p2p.close()
        epochs.close()
        if self.membership is not None:
            self.membership.close()

    # -- collectives -------------------------------------------------------------------
    def allreduce(  # type: ignore[override]
        self, tensors: list[torch.Tensor], opts: Any = None
    ) -> ResilientWork:
        return self.reductions.allreduce(tensors, opts)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> ResilientWork:
        return self.reductions.allreduce(tensors, opts)

    def broadcast(  # type: ignore[override]
        self, tensors: list[torch.Tensor], opts: Any = None
    ) -> ResilientWork:
        return self.reductions.broadcast(tensors, opts)

    def barrier(self, opts: Any = None) -> ResilientWork:
        return self.reductions.barrier()

    # -- gathers and scatters (GatherCalls builds them) ----------------------------------
    def allgather(  # type: ignore[override]
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> ResilientWork:
        return self.gathers.allgather(output_tensors, input_tensors, opts)

    def allgather_coalesced(  # type: ignore[override]
        self,
        output_lists: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> ResilientWork:
        return self.gathers.allgather_coalesced(output_lists, input_tensors, opts)

    def _allgather_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> ResilientWork:
        return self.gathers.all_gather_into_tensor(output, input, opts)

    def reduce_scatter(  # type: ignore[override]
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> ResilientWork:
        return self.gathers.reduce_scatter(output_tensors, input_tensors, opts)

    def _reduce_scatter_base(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> ResilientWork:
        return self.gathers.reduce_scatter_tensor(output, input, opts)

    # torch >= 2.10 routes all_gather_into_tensor / reduce_scatter_tensor here.
    def all_gather_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> ResilientWork:
        return self.gathers.all_gather_into_tensor(output, input, opts)

    def reduce_scatter_single(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> ResilientWork:
        return self.gathers.reduce_scatter_tensor(output, input, opts)

    def all_gather_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> ResilientWork:
        return self.gathers.all_gather_coalesced(outputs, inputs, opts)

    def reduce_scatter_single_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> ResilientWork:
        return self.gathers.reduce_scatter_coalesced(outputs, inputs, opts)

    allgather_into_tensor_coalesced = all_gather_single_coalesced  # type: ignore[assignment]
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced  # type: ignore[assignment]

    # -- rooted calls and all-to-all (resilient.group.rooted, resilient.group.alltoall) -------
    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> ResilientWork:  # type: ignore[override]
        return self.rooted.reduce(tensors, opts)

    def gather(  # type: ignore[override]
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> ResilientWork:
        return self.rooted.gather(output_tensors, input_tensors, opts)

    def scatter(  # type: ignore[override]
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> ResilientWork:
        return self.rooted.scatter(output_tensors, input_tensors, opts)

    def alltoall(  # type: ignore[override]
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> ResilientWork:
        return self.alltoalls.all_to_all(output_tensors, input_tensors, opts)

    def alltoall_base(  # type: ignore[override]
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        output_split_sizes: list[int],
        input_split_sizes: list[int],
        opts: Any = None,
    ) -> ResilientWork:
        return self.alltoalls.all_to_all_single(
            output, input, output_split_sizes, input_split_sizes, opts
        )

    # -- point to point (resilient.group.p2p) --------------------------------------------
    def send(self, tensors: list[torch.Tensor], dstRank: int, tag: int = 0) -> ResilientWork:  # type: ignore[override]
        return self.p2p.send(tensors, dstRank, tag)

    def recv(self, tensors: list[torch.Tensor], srcRank: int, tag: int = 0) -> ResilientWork:  # type: ignore[override]
        return self.p2p.recv(tensors, srcRank, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int = 0) -> ResilientWork:  # type: ignore[override]
        return self.p2p.recv_anysource(tensors, tag)
