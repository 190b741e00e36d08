"""Direct (mesh) schedules: every rank talks to every peer, two hops per all-reduce.

A ring all-reduce takes 2(P-1) dependent hops; when hops are latency-bound (small
worlds, small tensors, busy CPUs) that dominates. The mesh reduce-scatter sends
each global chunk straight to its owner, which reduces the P contributions in rank
order 0..P-1; the all-gather sends each finished chunk straight to every peer. Same
bytes per rank as a ring, 2 hops instead of 2(P-1).

Determinism is kept: chunk c's elements are reduced in rank order, whichever rail
carried them, and every rank receives the owner's bits. Only commutativity of the
two-operand op is used (``a op b == b op a`` bitwise for IEEE add/mul/min/max), to
fold the local contribution in at its rank position without an extra copy.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from resilient.collectives.failover import Rx, Tx
from resilient.collectives.mesh_native import MeshSteps
from resilient.collectives.reduce_ops import Reducer
from resilient.collectives.ring_plan import (
    Span,
    even_bounds,
    rail_pieces,
    skip_bounds,
    sub_count,
    sub_spans,
)
from resilient.collectives.route import Route
from resilient.links import native_steps
from resilient.links.byte_views import bytes_of
from resilient.links.socket_frames import DigestMismatch

if TYPE_CHECKING:
    from resilient.collectives.native_acks import StepAcks

__all__ = ["MeshPlan", "MeshRail", "mesh_plan"]

# The straggler-aware schedule's owners fold sub-chunk j - PACE_LAG right after
# sending sub-chunk j. Sending them all first held back the slow rank's first
# result by 30-110 ms on the netns testbed: a gloo send can block its caller for
# tens of ms (the pair's lock, held by its event loop), and nothing folds meanwhile.
PACE_LAG = 2


@dataclass(frozen=True, slots=True)
class MeshPlan:
    """Where one mesh call's bytes go, on every rail: a pure function of the call's
    size, the world, the rail weights and the slow rank, so it is computed once per
    such key (DDP repeats the same buckets every step).

    ``subs[rail][chunk][j]``: sub-chunk j of the chunk's piece on the rail;
    ``rails``: the rails with bytes to move; ``rail_bytes``: bytes per rail.
    """

    subs: tuple[list[list[Span]], ...]
    rails: tuple[int, ...]
    rail_bytes: tuple[int, ...]


def mesh_plan(
    numel: int,
    elem: int,
    world: int,
    weights: Sequence[float],
    *,
    skip: int | None,
    grain: int,
    most: int,
) -> MeshPlan:
    """The plan of a mesh call over ``numel`` elements of ``elem`` bytes: global
    chunks (rank ``skip`` owning none, when given), cut across rails by
    ``weights``, each piece into at most ``most`` sub-chunks of ``grain`` bytes."""
    chunks = even_bounds(numel, world) if skip is None else skip_bounds(numel, world, skip)
    pieces = rail_pieces(chunks, weights)
    subs = []
    for on_rail in pieces:
        k = sub_count(on_rail, elem, grain, most)
        subs.append([sub_spans(p, k) for p in on_rail])
    rail_bytes = tuple(sum(p.size for p in rail) * elem for rail in pieces)
    rails = tuple(r for r, rail in enumerate(pieces) if any(p.size for p in rail))
    return MeshPlan(subs=tuple(subs), rails=rails, rail_bytes=rail_bytes)


class MeshRail:
    """One rail's share of a mesh all-reduce / reduce-scatter / all-gather."""

    def __init__(
        self,
        *,
        rank: int,
        world: int,
        rail: int,
        route: Route,
        flat: torch.Tensor,
        subs: list[list[Span]],
        scratch: Callable[[int], torch.Tensor],
        skip: int | None = None,
        gated: bool = False,
    ) -> None:
        """``skip``: the straggler-aware schedule's slow rank (it owns no chunk).
        ``gated``: an elided call's (resilient.collectives.digest_check): the reduce-scatter checks
        every peer's first message before it folds anything."""
        self.rank, self.world, self.rail = rank, world, rail
        self.gated = gated
        self.gate_waited_s = 0.0
        self.gate_news = False  # a peer's first message said it has news
        self.skip = skip
        self.flat = flat
        self.subs = subs  # subs[chunk][j] (MeshPlan.subs of this rail)
        self.k = len(subs[0])
        self.elem = flat.element_size()
        # On socket links a CPU call's messages are posted as slices of one byte
        # view of the buffer: a tensor view per message, and the byte view the
        # socket pair makes of it, cost tens of microseconds each on a busy host.
        self._bytes = bytes_of(flat) if route.links.sockets and flat.device.type == "cpu" else None
        self.peers = [p for p in range(world) if p != rank]
        # The slow rank gets each result first: its NIC is what the call waits for.
        self.gather_to = self.peers
        if skip is not None and skip != rank:
            self.gather_to = [skip, *(p for p in self.peers if p != skip)]
        self.route = route
        # Built when the Python path moves bytes: a C step needs none (links.native_steps).
        self.tx: dict[int, Tx] = {}
        self.rx: dict[int, Rx] = {}
        self._scratch = scratch
        # Sends of the reduce-scatter and of the all-gather are waited for apart: a
        # rank must not wait for its gather sends before posting its gather receives,
        # or two ranks would wait for each other once messages exceed socket buffers.
        self.rs_sends: list[tuple[Tx, int, int]] = []
        self.ag_sends: list[tuple[Tx, int, int]] = []

    def _channels(
        self,
        tx_ahead: dict[int, list[object]] | None = None,
        rx_ahead: dict[int, list[object]] | None = None,
        tx_acks: dict[int, Any] | None = None,
        rx_acks: dict[int, Any] | None = None,
    ) -> None:
        """Build the channels; ``*_ahead``, ``*_acks``: what a stopped C step moved
        of the messages and of the acknowledgements (see Rx.ahead, native_acks)."""
        if self.tx:
            return
        for p in self.peers:
            self.tx[p] = Tx(self.route, p, self.rail, ack=(tx_acks or {}).get(p))
            self.rx[p] = Rx(self.route, p, self.rail, ack=(rx_acks or {}).get(p))
            self.tx[p].ahead.extend((tx_ahead or {}).get(p, ()))
            self.rx[p].ahead.extend((rx_ahead or {}).get(p, ()))

    def _view(self, span: Span) -> torch.Tensor:
        return self.flat[span.start : span.stop]

    def _io(self, span: Span) -> torch.Tensor | memoryview:
        """What a message of ``span`` is posted as (see ``_bytes``)."""
        if self._bytes is None:
            return self._view(span)
        return self._bytes[span.start * self.elem : span.stop * self.elem]

    def _send(self, into: list[tuple[Tx, int, int]], peer: int, span: Span, tag: int) -> None:
        if span.size:
            tx = self.tx[peer]
            into.append((tx, tx.post(self._io(span), tag), span.size * self.elem))

    @staticmethod
    def _wait_all(sends: list[tuple[Tx, int, int]]) -> None:
        for tx, idx, nbytes in sends:
            tx.wait(idx, nbytes)
        sends.clear()

    def _close(self) -> None:
        """Acknowledge receipts, then wait for ours (see resilient.collectives.failover)."""
        for p in self.peers:
            self.rx[p].ack()
        for p in self.peers:
            self.tx[p].finish()
        for p in self.peers:
            self.rx[p].finish()

    def reduce_scatter(self, reduce: Reducer, *, then_gather: bool) -> None:
        """Own chunk ``rank`` ends fully reduced; with ``then_gather`` every chunk does.

        The results' receives are posted as soon as the contributions went out, straight
        into the buffer: an owner's result for a region cannot exist before the owner
        consumed our contribution sent from that region, so nothing lands there while
        a send (or a failover's re-send of an unconsumed message) still reads it.

        With ``skip`` (the straggler-aware schedule, always with ``then_gather``) the
        gather's receives are posted before any send, into scratch, and copied in at
        the end (:meth:`_owner_paced`, :meth:`_send_once_receive_once`), so the slow
        rank's results leave as its parts come in.
        """
        own = self.subs[self.rank]
        own_n = len(self.peers) * sum(s.size for s in own)
        if self.skip is not None and then_gather:
            native_steps.count_pass(in_c=False)  # the straggler-aware schedule is Python's
            if own_n == 0:
                self._send_once_receive_once()
            else:
                self._owner_paced(reduce, own_n)
            return
        # Every receive before any send: a message that comes before its receive is
        # read into a fresh buffer and copied again. With the results' receives
        # posted only once our sends had finished, that was a quarter of the results
        # on 4 ranks sharing 2 cores (and posting a receive reads its socket, which
        # may already hold a peer's result).
        pool = self._scratch(own_n)
        if not self._in_c(reduce, pool, then_gather=then_gather):
            self._channels()
            self._python(reduce, pool, then_gather=then_gather, folded=False)

    def _in_c(self, reduce: Reducer, pool: torch.Tensor, *, then_gather: bool) -> bool:
        """The call's two steps in C (resilient.collectives.mesh_native): the
        contributions, then the results. False: the pairs are not quiet, nothing was
        moved. A step that stops hands its streams back, and the channels finish the
        call from there."""
        c = self._c_steps(pool)
        if c is None:
            native_steps.count_pass(in_c=False)
            return False
        one = c.contributions()
        acks = None if then_gather else c.acks(one)
        began = time.monotonic()
        stopped = one.run()
        if self.gated:  # waiting for the peers' contributions, as at the Python gate
            self.gate_waited_s += time.monotonic() - began
        if stopped is not None:
            native_steps.count_pass(in_c=False)
            self._handed_back(c, one, stopped, acks, None)
            self._python(reduce, pool, then_gather=then_gather, folded=False)
            return True
        if acks is not None:
            acks.ran_whole()
        self.gate_news = one.news
        for j in range(self.k):
            if c.own[j].size:
                self._fold(j, reduce, c.scratch, {}, waited=True)
        if not then_gather:
            native_steps.count_pass(in_c=True)
            return True
        two = c.results()
        acks = c.acks(two)
        stopped = two.run()
        self.gate_news = self.gate_news or two.news
        native_steps.count_pass(in_c=stopped is None)
        if stopped is not None:
            self._handed_back(c, two, stopped, acks, one)
            self._python(reduce, pool, then_gather=True, folded=True)
        elif acks is not None:
            acks.ran_whole()
        return True

    def _handed_back(
        self,
        c: MeshSteps,
        step: native_steps.Step,
        stopped: tuple[list[Any], list[Any]],
        acks: StepAcks | None,
        before: native_steps.Step | None,
    ) -> None:
        """Build the channels from where a stopped C step left every stream."""
        tx_acks: dict[int, Any] = {}
        rx_acks: dict[int, Any] = {}
        if acks is not None:
            sent, got, tx_acks, rx_acks = acks.split(*stopped)
            stopped = (sent, got)
        self._channels(*c.ahead(step, stopped, before), tx_acks, rx_acks)

    def _c_steps(self, pool: torch.Tensor) -> MeshSteps | None:
        """The call's C steps, or None: CUDA or gloo links, a slow rank (the
        straggler-aware schedule is the Python path's), or links not quiet."""
        if self._bytes is None or self.skip is not None:
            return None
        links = native_steps.quiet_links(self.route.links, self.peers, self.rail)
        if links is None:
            return None
        return MeshSteps(
            links, self.route, self.rank, self.peers, self.subs, self.flat, self._bytes, pool
        )

    def _python(
        self, reduce: Reducer, pool: torch.Tensor, *, then_gather: bool, folded: bool
    ) -> None:
        """The general path on channels (``folded``: a C step did the folds)."""
        own = self.subs[self.rank]
        scratch, recvs = self._post_contributions(pool)
        gathers = self._post_gathers() if then_gather else []
        for j in range(self.k):
            for p in self.peers:
                self._send(self.rs_sends, p, self.subs[p][j], j)
        if self.gated and not folded:
            self._gate(recvs)
        if folded:  # the C step received them all: each is a finished work
            for (p, j), idx in recvs.items():
                self.rx[p].wait(idx, own[j].size * self.elem)
        for j in range(self.k):
            if own[j].size and not folded:
                self._fold(j, reduce, scratch, recvs, waited=self.gated and j == 0)
            if then_gather:
                self._start_gather(j)
        self._wait_all(self.rs_sends)
        self._finish_gather(gathers)
        self._close()

    def _gate(self, recvs: dict[tuple[int, int], int]) -> None:
        """Wait for every peer's first contribution before anything folds (an elided
        call's check: its digest is the peer's call's). On a refused one the
        channels are let go, so no failover of this call starts later.

        Raises:
            DigestMismatch: a peer's call differs.
        """
        began = time.monotonic()
        nbytes = self.subs[self.rank][0].size * self.elem
        try:
            for p in self.peers:
                self.rx[p].wait(recvs[(p, 0)], nbytes)
                self.gate_news = self.gate_news or self.rx[p].news(recvs[(p, 0)])
        except DigestMismatch:
            for p in self.peers:
                self.tx[p].release()
                self.rx[p].release()
            raise
        finally:
            self.gate_waited_s += time.monotonic() - began

    def _post_contributions(
        self, pool: torch.Tensor
    ) -> tuple[dict[tuple[int, int], torch.Tensor], dict[tuple[int, int], int]]:
        """Post the receives of every peer's part of our chunk, sub-chunk by sub-chunk,
        into ``pool``: (buffer, op index) by (peer, j)."""
        own = self.subs[self.rank]
        scratch: dict[tuple[int, int], torch.Tensor] = {}
        recvs: dict[tuple[int, int], int] = {}
        raw = bytes_of(pool) if self._bytes is not None else None
        e = self.elem
        offset = 0
        for j in range(self.k):
            for p in self.peers:
                if own[j].size:
                    end = offset + own[j].size
                    scratch[(p, j)] = buf = pool[offset:end]
                    into = buf if raw is None else raw[offset * e : end * e]
                    recvs[(p, j)] = self.rx[p].post(into, j)
                    offset = end
        return scratch, recvs

    def _owner_paced(self, reduce: Reducer, own_n: int) -> None:
        """An owner of the straggler-aware schedule: every receive posted first, so
        the slow rank may send at once (gloo moves nothing before the receive is
        posted); then sub-chunk j's sends, and the fold and gather of j - PACE_LAG,
        so the slow rank's results leave as soon as its parts came in."""
        self._channels()
        own = self.subs[self.rank]
        gather_n = sum(s.size for p in self.peers for s in self.subs[p])
        pool = self._scratch(own_n + gather_n)
        scratch, recvs = self._post_contributions(pool)
        landed = self._post_gather_into(pool[own_n:])
        for j in range(self.k + PACE_LAG):
            if j < self.k:
                for p in self.peers:
                    self._send(self.rs_sends, p, self.subs[p][j], j)
            done = j - PACE_LAG
            if done >= 0:
                if own[done].size:
                    self._fold(done, reduce, scratch, recvs)
                self._start_gather(done)
        self._wait_all(self.rs_sends)
        for p, idx, span, buf in landed:
            self.rx[p].wait(idx, span.size * self.elem)
            self._view(span).copy_(buf)
        self._wait_all(self.ag_sends)
        self._close()

    def _send_once_receive_once(self) -> None:
        """The slow rank of the straggler-aware schedule owns nothing: it sends its
        sub-chunks and receives the result, copying each part in as it lands while
        later sends are still going out (the general path waits for all its sends
        first). A part overwrites the region its send read, so that send is waited
        for first: it has finished, since the owner needed it to make the result.
        """
        self._channels()
        landed = self._post_gather_into(self._scratch(sum(
            s.size for p in self.peers for s in self.subs[p])))  # fmt: skip
        for j in range(self.k):
            for p in self.peers:
                self._send(self.rs_sends, p, self.subs[p][j], j)
        # Both lists run over the same non-empty spans subs[p][j], j-major.
        for (tx, send_idx, nbytes), (p, idx, span, buf) in zip(self.rs_sends, landed, strict=True):
            tx.wait(send_idx, nbytes)
            self.rx[p].wait(idx, span.size * self.elem)
            self._view(span).copy_(buf)
        self.rs_sends.clear()
        self._close()

    def _post_gather_into(self, pool: torch.Tensor) -> list[tuple[int, int, Span, torch.Tensor]]:
        """Post every gather receive into ``pool``: (peer, op index, span, buffer)."""
        out = []
        offset = 0
        for j in range(self.k):
            for p in self.peers:
                span = self.subs[p][j]
                if span.size:
                    buf = pool[offset : offset + span.size]
                    offset += span.size
                    out.append((p, self.rx[p].post(buf, self.k + j), span, buf))
        return out

    def _fold(
        self,
        j: int,
        reduce: Reducer,
        scratch: dict[tuple[int, int], torch.Tensor],
        recvs: dict[tuple[int, int], int],
        *,
        waited: bool = False,
    ) -> None:
        """Reduce sub-chunk j of the own chunk in rank order 0..P-1 (``waited``: its
        receives were waited for already, by the gate)."""
        mine = self._view(self.subs[self.rank][j])
        nbytes = mine.numel() * self.elem
        acc: torch.Tensor | None = None
        for q in range(self.world):
            if q == self.rank:
                if acc is not None:
                    reduce(mine, acc)  # acc op x_rank, computed in place as x_rank op acc
                continue
            if not waited:
                self.rx[q].wait(recvs[(q, j)], nbytes)
            part = scratch[(q, j)]
            if q < self.rank and acc is None:
                acc = part
            elif q < self.rank:
                assert acc is not None
                reduce(acc, part)
            else:
                reduce(mine, part)

    def _start_gather(self, j: int) -> None:
        """Send own sub-chunk j to every peer."""
        for p in self.gather_to:
            self._send(self.ag_sends, p, self.subs[self.rank][j], self.k + j)

    def _post_gathers(self) -> list[tuple[int, int, Span]]:
        """Post the receive of every peer's finished sub-chunks, straight into the
        buffer: (peer, op index, span), in the order they are waited for."""
        recvs = []
        for j in range(self.k):
            for p in self.peers:
                span = self.subs[p][j]
                if span.size:
                    recvs.append((p, self.rx[p].post(self._io(span), self.k + j), span))
        return recvs

    def _finish_gather(self, recvs: list[tuple[int, int, Span]]) -> None:
        for p, idx, span in recvs:
            self.rx[p].wait(idx, span.size * self.elem)
        self._wait_all(self.ag_sends)

    def all_gather(self) -> None:
        """Own chunk ``rank`` is filled; fill every other chunk from its owner (in
        one C step while the links are quiet: the all-reduce's second step)."""
        c = self._c_steps(self._scratch(0))
        if c is not None:
            two = c.results()
            acks = c.acks(two)
            stopped = two.run()
            if stopped is None:
                native_steps.count_pass(in_c=True)
                if acks is not None:
                    acks.ran_whole()
                return
            self._handed_back(c, two, stopped, acks, None)
        native_steps.count_pass(in_c=False)
        self._channels()
        recvs = self._post_gathers()
        for j in range(self.k):
            self._start_gather(j)
        self._finish_gather(recvs)
        self._close()
