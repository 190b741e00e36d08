"""``ResilientProcessGroup``: a real ``torch.distributed.ProcessGroup`` over links.

Collectives run on one communication thread per group, in the order they were
issued (every rank issues them in the same order, as with any process group), and
return a :class:`ResilientWork` whose future completes when the collective does, so
DDP overlaps them with backward exactly as with gloo. Each collective is a ring
schedule over two-rank link groups (:mod:`resilient.collectives.engine`).

Before the data moves, ranks exchange a small signature of the call (op, reduce
op, dtype, shapes, sequence number). If ranks disagree, every rank raises
:class:`~resilient.errors.CollectiveMismatch` naming the ranks and what differed,
and the group stays usable, because no data phase was started. While the group
is quiet most calls skip that exchange and are checked by a digest in their data
messages instead, falling back to it when a rank refuses one
(:mod:`resilient.collectives.digest_check`); nothing is folded before every peer's digest was seen.
"""

from __future__ import annotations

import atexit
import logging
import threading
import weakref
from collections.abc import Callable, Sequence
from typing import Any, NoReturn

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import Store
from torch.futures import Future

from resilient.check.elision import CHECKED, ElidedCalls
from resilient.check.exchange import Payload, SignatureChannel
from resilient.collectives.digest_check import digest_of
from resilient.collectives.engine import Reduce, RingEngine, fold_rows
from resilient.collectives.reorder import cut_off_peers, follow_cuts
from resilient.collectives.signature import INLINE_BYTES, Exchange, Signature
from resilient.collectives.solo import SoloEngine
from resilient.config import DataPlaneConfig
from resilient.detect.announcements import watch_announcements
from resilient.detect.gpu import GpuHealth
from resilient.detect.health_board import HealthBoard
from resilient.detect.nic import NicMonitor
from resilient.detect.peer_watch import PeerWatch
from resilient.detect.rail_weights import DOWN, WeightLearner, agreed_backups
from resilient.detect.retransmits import RailLoss
from resilient.detect.slow_rank import SendRates, SlowRankVote
from resilient.detect.stragglers import StragglerWatch, Verdicts
from resilient.errors import CommunicationError, PeerLost, ResilientError
from resilient.group.args import check_tensors, reduce_op
from resilient.group.epochs import EpochControl
from resilient.group.gathers import GatherOps
from resilient.group.handoff import Handoff
from resilient.group.work import Failed, ResilientWork, _Flat, _packed
from resilient.links import repair
from resilient.links.repair import CTL_TABLE, DATA_TABLE, install_agreed, staged_rows
from resilient.links.table import LinkTable

__all__ = ["ResilientProcessGroup", "ResilientWork"]


logger = logging.getLogger(__name__)


_LIVE: weakref.WeakSet[ResilientProcessGroup] = weakref.WeakSet()
# Distinct allreduce calls kept checked (DDP makes a few buckets; anything more is
# a program whose shapes vary, which gains nothing from the cache).
_KNOWN_CALLS = 64


@atexit.register
def _shutdown_live_groups() -> None:
    # A gloo group still alive while the interpreter tears down can abort the
    # process; close whatever the program did not destroy itself.
    for pg in list(_LIVE):
        try:
            pg.shutdown()
        except Exception:  # exiting anyway; never mask the program's own exit status
            logger.debug("shutdown at exit failed", exc_info=True)


class ResilientProcessGroup(GatherOps, ElidedCalls, dist.ProcessGroup, EpochControl):  # type: ignore[misc]
    """A process group whose collectives are ring schedules over per-rail links.

    Supported: allreduce (sum, avg, product, min, max), allreduce_coalesced,
    broadcast, allgather, all_gather_into_tensor, reduce_scatter,
    reduce_scatter_tensor, barrier; float32/64, float16, bfloat16, int32/64
    tensors, contiguous or not, on CPU (gloo links) or CUDA (NCCL pair links, one
    GPU per rank). Anything else raises ``NotImplementedError``
    naming the op. Errors of a collective surface from ``Work.wait()``.
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
    ) -> None:
        super().__init__(rank, world_size)  # type: ignore[call-arg]
        self.config = config or DataPlaneConfig()
        self.rails = tuple(rails)
        self.incarnation = incarnation
        self.links = LinkTable(
            rank=rank,
            rails=self.rails,
            store=store,
            config=self.config,
            epoch=epoch,
            transport=self.config.data_transport,
        )
        self._store, self._epoch = store, epoch
        self._members, self._pos = tuple(range(world_size)), rank
        self._cuda: RingEngine | None = None
        self._channel: SignatureChannel | None = None
        # Set when a peer is gone (resilient.detect.lost_peer): every later call fails at once
        # with it, until recovery.Session moves the group to the next epoch.
        self._lost: PeerLost | None = None
        self._lost_lock = threading.Lock()
        # A replacement runs its calls alone until it is admitted (resilient.collectives.solo).
        self._joining = joining
        self.engine: RingEngine | SoloEngine = (
            SoloEngine(rank, world_size) if joining else self._new_engine(self.links, world_size)
        )
        self._static_weights = self.engine.weights if isinstance(self.engine, RingEngine) else ()
        self.board = HealthBoard(rank=rank, world=world_size, store=store, epoch=epoch)
        self._learner: WeightLearner | None = None
        self._slow_vote: SlowRankVote | None = None
        self._send_rates: SendRates | None = None
        self._loss = RailLoss(self._retransmissions)
        # Confirmed stragglers for the policy (recovery.Session reads them).
        self.verdicts = Verdicts()
        self._stragglers = StragglerWatch(rank, epoch, self.verdicts)
        # NIC state of each rail (~10 ms): nic.down/nic.up events, hooks for recovery.
        self.nics = NicMonitor(rank, self.rails)
        self.nics.on_change(lambda rail, up: self.board.nic_changed(rail, up))
        if not joining:
            # A replacement watches from its admission (enter_epoch): a warm spare
            # may stand by for hours beside the incarnation it would replace, and
            # must not log that one's NIC events as its own.
            self.nics.start()
        # GPU health (Xid errors, throttling, NVLink) when NVML and a GPU are here.
        self.gpu = (
            GpuHealth.open(torch.cuda.current_device(), rank=rank, epoch=epoch)
            if torch.cuda.is_available()
            else None
        )
        if self.gpu is not None:
            self.gpu.start()
        # Calls submitted and finished: the peer watch looks only while some run.
        self._calls_in, self._calls_out = 0, 0
        # Checked allreduce calls by (dtype, shape, device, reduce op): see _allreduce_call.
        self._known_calls: dict[tuple[Any, ...], tuple[Reduce, Signature, int]] = {}
        # The health board's changes when the group was last found quiet (_quiet).
        self._quiet_mark = 0
        self._peer_watch = PeerWatch(rank, self._tables, self._busy, self._check_lost)
        self._peer_watch.start()
        # This rank's member lease in etcd, when the backend joined one (closed at
        # shutdown: a departure, not an expiry).
        self.membership: Any = None
        self._join_members: Callable[[], Any] | None = None
        if not joining:
            self._setup_epoch(epoch, None)
        self._queue: Handoff[tuple[Callable[[], Any], Future[Any]] | None] = Handoff()
        self._thread = threading.Thread(
            target=self._loop, name=f"resilient-comm-{rank}", daemon=True
        )
        self._closed = False
        self._thread.start()
        _LIVE.add(self)

    # -- plumbing ----------------------------------------------------------------------
    def getBackendName(self) -> str:
        return "resilient"

    @property
    def name(self) -> str:  # type: ignore[override]
        return "resilient"

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, fut = item
            try:
                fut.set_result(fn())
            except BaseException as exc:  # delivered to whoever waits on the work
                if not isinstance(exc, ResilientError):
                    logger.exception("rank %d: collective failed", self.rank())
                fut.set_result(Failed(exc))

    def _submit(
        self,
        op: str,
        sig: Signature,
        fn: Callable[[torch.Tensor | None], Any],
        *,
        payload: Payload | None = None,
        after_previous: bool = False,
        digest: int = 0,
    ) -> ResilientWork:
        """Queue ``fn(table)``: ``table`` holds every rank's inline bytes once the
        signatures matched (an empty tensor for a call without ``payload``; None with
        checks off); a mismatch raises before ``fn``. ``digest``: the call's, when
        it may run elided (resilient.collectives.digest_check: a CPU all_reduce with no payload)."""
        if self._closed:
            raise RuntimeError(f"resilient process group is shut down; cannot run {op}")
        channel = self._channel
        # What this rank's health board had published before the row was built: an
        # elided call after a quiet verdict carries news if it has changed since.
        mark = self.board.changes
        verdict = channel.submit(sig, payload, after_previous=after_previous) if channel else None

        def run() -> Any:
            ok = False
            try:
                if self._lost is not None:
                    raise PeerLost(str(self._lost), peer=self._lost.peer, epoch=self._epoch)
                if channel is not None and verdict is not None and channel.take_elided(verdict):
                    out = self._run_elided(channel, verdict, fn, payload, digest)
                    ok = True
                    return out
                exchange = channel.result(verdict) if channel and verdict else None
                if exchange is None:
                    out = fn(None)
                    ok = True
                    return out
                engine = self.engine
                assert isinstance(engine, RingEngine)
                if self._learner is not None:
                    # A safe boundary: every rank sets the same weights before any
                    # data of this call moves.
                    engine.weights = self._learner.weights_for(exchange)
                    engine.backups = agreed_backups(exchange.rates, engine.num_rails)
                self._stragglers.observe(exchange)
                self._install(exchange)
                follow_cuts(engine, exchange, announce=True)
                if self._slow_vote is not None:
                    engine.slow_rank = self._slow_vote.decide(exchange.seq, exchange.lagging)
                assert channel is not None
                channel.quiet, self._quiet_mark = self._quiet(exchange, engine, sig), mark
                # Only calls that carry payloads read them (a view per call otherwise).
                out = fn(exchange.payloads() if payload is not None else CHECKED)
                ok = True
                return out
            except CommunicationError as exc:
                if isinstance(exc, PeerLost) or (lost := self._await_lost()) is None:
                    raise
                raise lost from exc
            finally:
                if channel is not None and verdict is not None:
                    channel.mark_done(verdict, ok=ok)
                self._calls_out += 1

        fut: Future[Any] = Future()
        self._calls_in += 1
        self._queue.put((run, fut))
        return ResilientWork(fut, op)

    def _inline(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Small enough to travel inside the signature exchange (same verdict on all
        ranks once their signatures matched: it depends only on numel and dtype)."""
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        return self._channel is not None and nbytes <= INLINE_BYTES

    def _staged_rows(self) -> list[tuple[int, int, int, int]]:
        tables = {DATA_TABLE: self.links}
        if self._channel is not None:
            tables[CTL_TABLE] = self._channel.engine.links
        return staged_rows(tables)

    def _cut_off(self) -> list[int]:
        """Peers reached on no rail now (data or control links): the exchange's rows
        say so, and every rank's rings avoid those pairs (resilient.collectives.reorder)."""
        tables = [self.links]
        if self._channel is not None:
            tables.append(self._channel.engine.links)
        return cut_off_peers(tables, self.board.usable)

    def _install(self, exchange: Exchange) -> None:
        """Put data links staged at both ends in service before this call's data."""
        if install_agreed(self.links, exchange.staged, self._pos, DATA_TABLE):
            self.board.publish()

    def _lagging(self) -> tuple[int, int, int]:
        return self._send_rates.lagging if self._send_rates is not None else (-1, 1000, 0)

    def _proposed_rates(self) -> tuple[float, ...]:
        # A rail with its NIC down or a broken link here proposes DOWN: every rank
        # then gives it no share at all until it is repaired (see resilient.detect.rail_weights).
        engine = self.engine
        assert isinstance(engine, RingEngine)
        return tuple(
            rate * self._loss.factor(rail)
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

    @staticmethod
    def _rows(table: torch.Tensor, buf: torch.Tensor) -> torch.Tensor:
        nbytes = buf.numel() * buf.element_size()
        return table[:, :nbytes].contiguous().view(buf.dtype)

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
        watch_announcements(membership, self._probe_peer)

    def shutdown(self) -> None:
        """Finish queued collectives, then close every link."""
        if self._closed:
            return
        self._closed = True
        self._peer_watch.stop()
        self.nics.stop()
        if self.gpu is not None:
            self.gpu.close()
        self.board.stop()
        # gloo's constructor has been seen to overrun its bound by ~26 s.
        if (left := repair.join_stranded(self.config.repair_timeout_s * 3 + 30.0)) > 0:
            logger.warning(
                "rank %d (epoch %d): %d link build(s) or repair(s) still running at shutdown",
                self._pos, self._epoch, left,
            )  # fmt: skip
        self._queue.put(None)
        self._thread.join(timeout=60)
        if not self._thread.is_alive():
            self._queue.close()
            if self._channel is not None:  # before any link closes (resilient.detect.lost_peer)
                self.board.leave(self._channel.succeeded)
        if self._channel is not None:
            self._channel.close()
        self.engine.close()
        self.links.close()
        if self._cuda is not None:
            self._cuda.close()
            self._cuda.links.close()
        if self.membership is not None:
            self.membership.close()

    def _engine_for(self, t: torch.Tensor) -> RingEngine | SoloEngine:
        """The CPU engine (gloo links), or the CUDA one (NCCL pair links), built lazily."""
        if t.device.type != "cuda" or isinstance(self.engine, SoloEngine):
            return self.engine
        if self._cuda is None:
            links = LinkTable(
                rank=self._pos,
                rails=self.rails,
                store=self._store,
                config=self.config,
                epoch=self._epoch,
                device_type="cuda",
            )
            self._cuda = self._new_engine(links, len(self._members))
            self.board.attach(links)
            self._cuda.board = self.board
        return self._cuda

    def _new_engine(self, links: LinkTable, world: int) -> RingEngine:
        """An engine over ``links`` with this group's schedule settings."""
        return RingEngine(
            rank=links.rank,
            world=world,
            links=links,
            weights=self.config.rail_weights,
            sub_chunk_bytes=self.config.sub_chunk_bytes,
            mesh=self.config.meshes(world),
            mesh_below_bytes=self._mesh_below(),
            single_rail_below_bytes=self.config.single_rail_below_bytes,
        )

    def _mesh_below(self) -> int:
        # An explicit "mesh" means mesh for every size.
        return 1 << 62 if self.config.topology == "mesh" else self.config.mesh_below_bytes

    # -- collectives -------------------------------------------------------------------
    def _allreduce_call(
        self, tensors: list[torch.Tensor], opts: Any
    ) -> tuple[Reduce, Signature, int]:
        """The checked reduce op, signature and digest of an allreduce call (the
        digest 0 unless the call may run elided: CPU tensors, calls elided here).

        One tensor is the usual call (a DDP bucket, the same few every step): its
        checks and signature are kept by dtype, shape, device and reduce op. They
        take ~6 us warm, but on a host where the training thread shares its cores
        with the other ranks every microsecond of Python costs several: keeping
        them took ~20 us of its CPU off each DDP bucket (docs/BENCHMARKS.md).

        Raises:
            ValueError, TypeError, NotImplementedError: see check_tensors, reduce_op.
        """
        key = None
        if len(tensors) == 1 and opts is not None:
            t = tensors[0]
            key = (t.dtype, t.shape, t.device, getattr(opts.reduceOp, "op", opts.reduceOp))
            known = self._known_calls.get(key)
            if known is not None:
                return known
        opts = opts or dist.AllreduceOptions()
        check_tensors("allreduce", tensors)
        red = reduce_op("allreduce", opts)
        sig = Signature.of("allreduce", tensors, reduce=red)
        elide = self.config.elide_every > 0 and all(t.device.type == "cpu" for t in tensors)
        known = (red, sig, digest_of(sig) if elide else 0)
        if key is not None:
            if len(self._known_calls) >= _KNOWN_CALLS:
                self._known_calls.clear()
            self._known_calls[key] = known
        return known

    def allreduce(  # type: ignore[override]
        self, tensors: list[torch.Tensor], opts: Any = None
    ) -> ResilientWork:
        red, sig, digest = self._allreduce_call(tensors, opts)
        inline = self._inline(tensors)

        def run(table: torch.Tensor | None) -> list[torch.Tensor]:
            with _Flat(tensors) as flat:
                buf = flat.buffer
                if inline and table is not None:
                    buf.copy_(fold_rows(self._rows(table, buf), red))
                else:
                    self._engine_for(buf).all_reduce(buf, red)
            return tensors

        payload = (lambda: _packed(tensors)) if inline else None
        digest = 0 if inline else digest
        return self._submit("allreduce", sig, run, payload=payload, digest=digest)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts: Any = None) -> ResilientWork:
        return self.allreduce(tensors, opts)

    def broadcast(  # type: ignore[override]
        self, tensors: list[torch.Tensor], opts: Any = None
    ) -> ResilientWork:
        opts = opts or dist.BroadcastOptions()
        check_tensors("broadcast", tensors)
        root = int(opts.rootRank)
        at = self._position(root, "broadcast")  # the root's number in this epoch
        sig = Signature.of("broadcast", tensors, root=root)

        inline = self._inline(tensors)

        def run(table: torch.Tensor | None) -> list[torch.Tensor]:
            with _Flat(tensors) as flat:
                buf = flat.buffer
                if inline and table is not None:
                    buf.copy_(self._rows(table, buf)[at])
                else:
                    self._engine_for(buf).broadcast(buf, at)
            return tensors

        # Only the root's bytes matter, but every rank waits for earlier calls alike.
        payload = (lambda: _packed(tensors) if self.rank() == root else None) if inline else None
        return self._submit("broadcast", sig, run, payload=payload, after_previous=inline)

    def barrier(self, opts: Any = None) -> ResilientWork:
        sig = Signature.of("barrier", [])

        def run(table: torch.Tensor | None) -> list[torch.Tensor]:
            # The exchange ran only once every rank had finished its earlier calls
            # and entered: that already is a barrier. Without checks, run one.
            if table is None:
                self.engine.barrier()
            return []

        return self._submit("barrier", sig, run, after_previous=True)

    # -- unsupported ops: a clear error instead of torch's generic one ------------------
    def _unsupported(self, op: str) -> NoReturn:
        raise NotImplementedError(
            f"resilient process group: '{op}' is not supported (supported: all_reduce, "
            "broadcast, all_gather, all_gather_into_tensor, reduce_scatter, "
            "reduce_scatter_tensor, barrier)"
        )

    def alltoall(self, *args: Any, **kwargs: Any) -> ResilientWork:
        self._unsupported("all_to_all")

    def alltoall_base(self, *args: Any, **kwargs: Any) -> ResilientWork:
        self._unsupported("all_to_all_single")

    def gather(self, *args: Any, **kwargs: Any) -> ResilientWork:
        self._unsupported("gather")

    def scatter(self, *args: Any, **kwargs: Any) -> ResilientWork:
        self._unsupported("scatter")

    def reduce(self, *args: Any, **kwargs: Any) -> ResilientWork:
        self._unsupported("reduce")

    def send(self, *args: Any, **kwargs: Any) -> ResilientWork:
        self._unsupported("send")

    def recv(self, *args: Any, **kwargs: Any) -> ResilientWork:
        self._unsupported("recv")
