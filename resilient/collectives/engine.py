"""Collectives as pipelined ring schedules over links, one ring per rail, rails concurrent.

All functions work in place on a flat, contiguous 1-D buffer and must be called
with the same arguments on every rank. The ring order is identical on every rail
and every element belongs to a global chunk fixed by ``numel`` and the world size
(see :mod:`resilient.collectives.ring_plan`), so results are bitwise identical on every rank and
independent of the rail weights.

Each rail's share runs in a thread of its own: a ring pass or a chain
(:mod:`resilient.collectives.ring_rail`), or a mesh rail
(:mod:`resilient.collectives.mesh`), pipelined in sub-chunks so that sending,
receiving and reducing overlap.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Protocol

import torch

from resilient.collectives.digest_check import NotElided, forget_call
from resilient.collectives.mesh import MeshPlan, MeshRail, mesh_plan
from resilient.collectives.rail_rates import RailRates
from resilient.collectives.reduce_ops import REDUCERS, Reduce, finish_avg, fold_rows
from resilient.collectives.ring_plan import (
    RingPass,
    Span,
    even_bounds,
    rail_pieces,
    sub_count,
    sub_spans,
)
from resilient.collectives.ring_rail import chain, ring_pass
from resilient.collectives.route import Route
from resilient.errors import ConfigError
from resilient.links.socket_frames import CALL_SHIFT, NEWS, DigestMismatch
from resilient.links.table import LinkTable

__all__ = ["LagMeter", "Reduce", "RingEngine", "fold_rows"]

logger = logging.getLogger(__name__)


def _rail_bytes(pieces: Sequence[Sequence[Span]], elem: int) -> list[int]:
    """What each rail carries in a schedule, in bytes of its pieces."""
    return [sum(p.size for p in rail) * elem for rail in pieces]


MAX_SUBS = 8
FINE_SUB_BYTES = 64 << 10
# The straggler-aware schedule's slow rank gets the result back only after its
# last sub-chunk went out, so finer pieces shorten that tail. degraded.py (4 MiB,
# b = 0.5), five alternating runs each: 16 pieces 238-258 ms (median 239), 8 pieces
# 241-265 ms (median 263); 32 pieces 283, 288 ms (per-op cost wins).
FINE_MAX_SUBS = 16
# Mesh plans kept per engine (by size, weights and slow rank); more are rebuilt.
_PLANS_KEPT = 64
# Reductions smaller than this are latency-bound: their send rates say nothing
# about a slow NIC.
LAG_MIN_BYTES = 256 << 10
LAG_EVERY_S = 0.05


class LagMeter(Protocol):
    """Reads the links' send rates after a mesh reduction: the slow-rank vote's
    evidence (resilient.detect.slow_rank's SendRates is one)."""

    def measure(self, links: LinkTable, peers: Sequence[int]) -> None: ...


class RingEngine:
    """Runs ring collectives for one rank over a :class:`LinkTable`."""

    def __init__(
        self,
        *,
        rank: int,
        world: int,
        links: LinkTable,
        weights: Sequence[float] | None = None,
        sub_chunk_bytes: int = 1 << 20,
        mesh: bool = False,
        mesh_below_bytes: int = 8 << 20,
        single_rail_below_bytes: int = 256 << 10,
        mesh_split: bool = False,
    ) -> None:
        if sub_chunk_bytes < 1024:
            raise ConfigError(f"sub_chunk_bytes={sub_chunk_bytes}: must be >= 1024")
        self.rank, self.world, self.links = rank, world, links
        self.num_rails = len(links.rails)
        self.weights: tuple[float, ...] = tuple(weights or [1.0] * self.num_rails)
        if len(self.weights) != self.num_rails:
            raise ConfigError(f"{len(self.weights)} rail weights for {self.num_rails} rails")
        self.sub_chunk_bytes = sub_chunk_bytes
        self.mesh = mesh and world > 2  # with two ranks a ring already is a mesh
        self.mesh_below_bytes = mesh_below_bytes
        self.mesh_split = mesh_split  # the mesh also for calls cut across several rails
        self.single_rail_below_bytes = single_rail_below_bytes
        self._scratch: dict[tuple[int, torch.dtype, str], torch.Tensor] = {}
        self._plans: dict[tuple[int, int, tuple[float, ...], int | None], MeshPlan] = {}
        self._pool = ThreadPoolExecutor(max(1, self.num_rails - 1), thread_name_prefix="rail")
        self._rates = RailRates(self.num_rails)
        # Failover: the health board (which rails are dead where) and the number of
        # the call, the same on every rank, which names the failover records.
        self.board: Any = None
        self.failover_timeout_s = links.config.op_timeout_floor_s
        self.failovers: list[tuple[int, int, int, int]] = []  # see Route.log
        self.relay = False  # a pair with no rail left may go through the store
        # The rails every rank agreed are in service (resilient.detect.rail_weights.agreed_backups),
        # set with the weights of each call; None: those with a share.
        self.backups: frozenset[int] | None = None
        self._calls = 0
        # A rank whose NICs are all slow (agreed on by every rank, see
        # resilient.detect.slow_rank): all_reduce then leaves it out of the reduction work.
        self.slow_rank: int | None = None
        # Measures the links' send rates after mesh reductions (set by whoever
        # reads it: resilient.detect.slow_rank).
        self.lag_meter: LagMeter | None = None
        self._lag_at = 0.0
        # The ring order while some pair has no rail left (agreed by every rank, see
        # resilient.collectives.ring_plan.avoiding_ring); None: 0, 1, ..., world-1. With an order
        # every schedule is a ring in it, so no data goes through the store.
        self.order: tuple[int, ...] | None = None
        # The call running elided, as (call key, digest, this rank has news), set
        # by its caller around the one all_reduce it makes (resilient.collectives.digest_check); the
        # time its gate waited for every peer's first message, and whether one of
        # them had news.
        self.elided: tuple[int, int, bool] | None = None
        self.gate_waited_s = 0.0
        self.gate_news = False

    def route(self) -> Route:
        """The next call's route: numbers the call (alike on every rank)."""
        self._calls += 1
        key, digest, news = self.elided or (0, 0, False)
        return Route(
            links=self.links,
            seq=self._calls,
            timeout_s=self.failover_timeout_s,
            board=self.board,
            log=self.failovers,
            allowed=(
                self.backups
                if self.backups is not None
                else frozenset(r for r, w in enumerate(self.weights) if w > 0)
            ),
            relay=self.relay,
            epoch=self.links.epoch,
            base=key << CALL_SHIFT,
            digest=digest,
            sent_digest=digest | NEWS if news else digest,
        )

    def _pos_of(self, rank: int) -> int:
        """``rank``'s position in the ring order."""
        return rank if self.order is None else self.order.index(rank)

    def one_rail(self, nbytes: int) -> bool:
        """Whether a call of ``nbytes`` takes one rail only (see _weights_for)."""
        return not self._split_by_weights(nbytes) or sum(1 for w in self.weights if w > 0) == 1

    def _split_by_weights(self, nbytes: int) -> bool:
        """Whether a call of ``nbytes`` is cut across the rails by their weights;
        smaller ones take the heaviest rail only (their time is latency)."""
        return self.num_rails > 1 and nbytes >= self.single_rail_below_bytes

    @property
    def rail_rates(self) -> tuple[float, ...]:
        """Each rail's measured speed (bytes/s, smoothed; 0 = not measured yet): what
        this rank proposes for the learned rail weights (resilient.detect.rail_weights)."""
        return self._rates.rates

    @property
    def calls(self) -> int:
        """Calls routed in this epoch (they number failover records and acknowledgement
        tags alike on every rank)."""
        return self._calls

    @calls.setter
    def calls(self, value: int) -> None:
        # An elided call that fell back routed on some ranks and not on others.
        self._calls = value

    @property
    def pos(self) -> int:
        """This rank's position in the ring order."""
        return self._pos_of(self.rank)

    def rank_at(self, pos: int) -> int:
        """The rank at ring position ``pos`` (also the chunk that position owns)."""
        pos %= self.world
        return pos if self.order is None else self.order[pos]

    @property
    def left(self) -> int:
        return self.rank_at(self.pos - 1)

    @property
    def right(self) -> int:
        return self.rank_at(self.pos + 1)

    def close(self, *, wait: bool = True) -> None:
        """Stop the rail threads; ``wait=False`` leaves one still blocked in an op of
        an abandoned call to end at its own deadline (its link is gone anyway)."""
        self._pool.shutdown(wait=wait)

    def new_epoch(self) -> None:
        """Count calls from zero again, as a replacement's new engine does: failover
        records and acknowledgement tags carry the call number."""
        self._calls = 0
        self.slow_rank = None
        self.order = None

    # -- public collectives ------------------------------------------------------------
    def all_reduce(self, flat: torch.Tensor, op: Reduce, *, gated: bool = False) -> None:
        """Reduce ``flat`` across ranks in place (reduce-scatter then all-gather).
        ``gated``: an elided call whose gate passed (resilient.collectives.ring_gate).

        Raises:
            NotElided: the call runs elided (``elided`` set), ungated, and cannot be.
            DigestMismatch: it runs elided and a peer's call differs.
        """
        if self.elided is not None and not gated:
            self._mesh(flat, op, gather=True, plan=self._elidable(flat))
        elif self.world > 1:
            if self.slow_rank is not None and self.world > 2 and self.order is None:
                # Straggler-aware: the slow rank owns no chunk, so it sends its N
                # bytes once and receives the N-byte result once, while the others
                # reduce among themselves (DESIGN.md). Still the mesh's rank-order
                # fold, so the bits are the same as the mesh's.
                self._mesh(flat, op, gather=True, skip=self.slow_rank)
            elif self._use_mesh(flat):
                self._mesh(flat, op, gather=True)
            else:
                self._ring(
                    flat,
                    even_bounds(flat.numel(), self.world),
                    steps=2 * (self.world - 1),
                    reduce_steps=self.world - 1,
                    shift=0,
                    op=op,
                )
        finish_avg(flat, op, self.world)

    def reduce_scatter(self, flat: torch.Tensor, op: Reduce) -> Span:
        """``flat`` holds ``world`` equal blocks; afterwards block ``rank`` holds the result."""
        chunks = even_bounds(flat.numel(), self.world)
        if self.world > 1 and self._use_mesh(flat):
            self._mesh(flat, op, gather=False)
        elif self.world > 1:
            self._ring(
                flat, chunks, steps=self.world - 1, reduce_steps=self.world - 1, shift=-1, op=op
            )
        mine = chunks[self.rank]
        finish_avg(flat[mine.start : mine.stop], op, self.world)
        return mine

    def all_gather(self, flat: torch.Tensor) -> None:
        """``flat`` holds ``world`` equal blocks, block ``rank`` filled; fill the others."""
        if self.world > 1:
            if self._use_mesh(flat):
                self._mesh(flat, None, gather=True)
            else:
                chunks = even_bounds(flat.numel(), self.world)
                self._ring(
                    flat, chunks, steps=self.world - 1, reduce_steps=0, shift=0, op=Reduce.SUM
                )

    def broadcast(self, flat: torch.Tensor, root: int) -> None:
        """Copy ``flat`` from ``root`` to every rank along a pipelined chain per rail."""
        if self.world == 1:
            return
        whole = [Span(0, flat.numel())]
        pieces = rail_pieces(whole, self._weights_for(flat))
        # Built here, in one order on every rank: built by the rail threads as they
        # come, two ranks could each wait in a rendezvous the other is not in yet
        # (seen: a first call that is a broadcast on two rails hung to its deadline).
        self.links.ensure(
            (peer, rail) for rail in range(self.num_rails) for peer in (self.left, self.right)
        )
        route = self.route()

        def run(rail: int) -> None:
            piece = pieces[rail][0]
            if piece.size:
                subs = sub_spans(piece, self._subs_for([piece], flat.element_size()))
                chain(self, flat, subs, rail, self._pos_of(root), route)

        self._run_rails(run, _rail_bytes(pieces, flat.element_size()))

    def barrier(self) -> None:
        self.all_reduce(torch.zeros(1, dtype=torch.int32), Reduce.SUM)

    # -- ring machinery ----------------------------------------------------------------
    def scratch(self, rail: int, flat: torch.Tensor, numel: int) -> torch.Tensor:
        """A receive buffer of ``numel`` elements, reused across calls (one per rail,
        dtype and device): fresh large buffers cost page faults and zeroing every call."""
        key = (rail, flat.dtype, str(flat.device))
        buf = self._scratch.get(key)
        if buf is None or buf.numel() < numel:
            buf = self._scratch[key] = torch.empty(numel, dtype=flat.dtype, device=flat.device)
        return buf[:numel]

    def _elidable(self, flat: torch.Tensor) -> MeshPlan:
        """The mesh plan of an elided all_reduce: on socket links, one rail (the
        heaviest, the one every small call takes), every chunk non-empty there, so
        every rank's first message reaches every peer there. (On several rails a
        rank whose plan differs may send nothing on a rail its peer gates on; the
        wait there looked stalled and was cut before the refusal on the other rail
        ended it.)

        Raises:
            NotElided: the call is not one of those (nothing was posted).
        """
        if (
            self.world > 2
            and self.slow_rank is None
            and self.links.sockets
            and self._use_mesh(flat)
            # Links are built in checked calls only: a rendezvous with a peer that
            # left would wait for its timeout where an exchange fails at once.
            and self.links.has_all(
                (p, r) for r in range(self.num_rails) for p in range(self.world) if p != self.rank
            )
        ):
            plan = self._mesh_plan(flat, None)
            rails = plan.rails
            if len(rails) == 1 and all(plan.subs[rails[0]][c][0].size for c in range(self.world)):
                return plan
        raise NotElided(f"rank {self.rank}: this all_reduce does not run elided")

    def uses_mesh(self, nbytes: int) -> bool:
        """Whether a call of ``nbytes`` takes the mesh (see _use_mesh)."""
        split = self._split_by_weights(nbytes) and not self.mesh_split
        return self.mesh and self.order is None and nbytes < self.mesh_below_bytes and not split

    def _use_mesh(self, flat: torch.Tensor) -> bool:
        """Mesh (2 hops) while hops dominate; the ring's locality wins on large tensors.

        Every rank decides alike: the inputs are the same numel and dtype everywhere.
        Never while a ring order avoids a pair with no rail: a mesh needs every pair.
        Nor, unless ``mesh_split``, for a call cut across several rails: there the ring
        was faster at every size measured, 0.5 to 7 MiB (docs/BENCHMARKS.md).
        """
        return self.uses_mesh(flat.numel() * flat.element_size())

    def _weights_for(self, flat: torch.Tensor) -> tuple[float, ...]:
        """The rail weights for this tensor: only the heaviest rail for small ones."""
        if self.num_rails == 1 or self._split_by_weights(flat.numel() * flat.element_size()):
            return self.weights
        best = max(range(self.num_rails), key=lambda r: self.weights[r])
        return tuple(1.0 if r == best else 0.0 for r in range(self.num_rails))

    def _mesh(
        self,
        flat: torch.Tensor,
        op: Reduce | None,
        *,
        gather: bool,
        skip: int | None = None,
        plan: MeshPlan | None = None,
    ) -> None:
        """Mesh schedule: reduce-scatter (``op``), then all-gather when ``gather``.
        ``skip``: the straggler-aware variant, that rank owning no chunk (finer
        sub-chunks, gather posted early). ``plan``: an elided call's (gated)."""
        gated = plan is not None
        plan = plan or self._mesh_plan(flat, skip)
        peers = [p for p in range(self.world) if p != self.rank]
        # Every rail, used or not: a failover must find its backup link built
        # (building one in the middle of a collective is a rendezvous in odd order).
        self.links.ensure((p, rail) for rail in range(self.num_rails) for p in peers)
        route = self.route()

        def run(rail: int) -> None:
            if rail not in plan.rails:
                return
            m = MeshRail(
                rank=self.rank,
                world=self.world,
                rail=rail,
                route=route,
                flat=flat,
                subs=plan.subs[rail],
                scratch=lambda n: self.scratch(rail, flat, n),
                skip=skip,
                gated=gated,
            )
            if op is None:
                m.all_gather()
                return
            try:
                m.reduce_scatter(REDUCERS[op], then_gather=gather)
            except DigestMismatch:
                # A peer whose plan differs may send nothing on another rail this
                # rank gates on: dropping the call's receives ends that wait too.
                if self.elided is not None:
                    forget_call(self.links, self.elided[0])
                raise
            finally:
                self.gate_waited_s += m.gate_waited_s
                self.gate_news = self.gate_news or m.gate_news

        self._run_rails(run, plan.rail_bytes)
        elem = flat.element_size()
        if self.lag_meter is not None and op is not None and flat.numel() * elem >= LAG_MIN_BYTES:
            # At most every LAG_EVERY_S: each reading is a system call or five per
            # link, and DDP's back-to-back buckets would read the same interval twice.
            now = time.monotonic()
            if now - self._lag_at >= LAG_EVERY_S:
                self._lag_at = now
                self.lag_meter.measure(self.links, peers)

    def _mesh_plan(self, flat: torch.Tensor, skip: int | None) -> MeshPlan:
        """The cached :class:`MeshPlan` of this call (see resilient.collectives.mesh)."""
        weights = self._weights_for(flat)
        elem = flat.element_size()
        key = (flat.numel(), elem, weights, skip)
        plan = self._plans.get(key)
        if plan is None:
            # The straggler-aware schedule: up to FINE_MAX_SUBS of at least
            # FINE_SUB_BYTES, so the slow rank starts receiving the result soon after
            # it started sending, and its last piece is small.
            grain, most = (FINE_SUB_BYTES, FINE_MAX_SUBS) if skip is not None else (
                self.sub_chunk_bytes, MAX_SUBS)  # fmt: skip
            if len(self._plans) >= _PLANS_KEPT:
                self._plans.clear()
            plan = self._plans[key] = mesh_plan(
                flat.numel(), elem, self.world, weights, skip=skip, grain=grain, most=most
            )
        return plan

    def _subs_for(self, pieces: Sequence[Span], elem: int) -> int:
        """Sub-chunks per piece: ``sub_chunk_bytes`` each, but at most MAX_SUBS.

        Enough to overlap sending, receiving and reducing; more only adds per-op
        cost (each gloo op costs tens of microseconds of CPU) on large tensors.
        (The straggler-aware schedule's finer grain is in _mesh_plan.)
        """
        return sub_count(pieces, elem, self.sub_chunk_bytes, MAX_SUBS)

    def _ring(
        self,
        flat: torch.Tensor,
        chunks: list[Span],
        *,
        steps: int,
        reduce_steps: int,
        shift: int,
        op: Reduce,
    ) -> None:
        pieces = rail_pieces(chunks, self._weights_for(flat))
        used = [r for r in range(self.num_rails) if any(p.size for p in pieces[r])]
        self.links.ensure(
            (peer, rail) for rail in range(self.num_rails) for peer in (self.left, self.right)
        )
        elem = flat.element_size()
        plans = [
            RingPass(
                rail, pieces[rail], steps, reduce_steps, shift, self._subs_for(pieces[rail], elem)
            )
            for rail in range(self.num_rails)
        ]
        route = self.route()
        if self.elided is not None:  # its gate's frames took the call's first tag
            route.base += 1

        def run(rail: int) -> None:
            if rail in used:
                ring_pass(self, flat, plans[rail], op, route, self.scratch)

        self._run_rails(run, _rail_bytes(pieces, elem))

    def _run_rails(self, fn: Callable[[int], None], nbytes: Sequence[int] = ()) -> None:
        """Run ``fn(rail)`` for every rail concurrently; with ``nbytes`` (what each rail
        moves, in any fixed unit) also time each rail to learn its rate."""
        times = [0.0] * self.num_rails

        def timed(rail: int) -> None:
            start = time.perf_counter()
            fn(rail)
            times[rail] = time.perf_counter() - start

        futures: list[Future[None]] = [
            self._pool.submit(timed, rail) for rail in range(1, self.num_rails)
        ]
        error: BaseException | None = None
        try:
            timed(0)
        except BaseException as exc:
            error = exc
        for fut in futures:
            error = error or fut.exception()
        if error is not None:
            raise error
        if nbytes and self.num_rails > 1:
            self._rates.learn(nbytes, times)
