"""A ring pass in C steps (links.native_steps), one per ring step, when its links are quiet.

Every ring step sends this rank's sub-chunks of one chunk to the right neighbour and
receives the left's of another: one C step moves them all, then the step's folds
run (in torch, in the Python path's order, so the bits are the same). The next
step's sends are what the folds just made. A step that stops hands its streams
back in a :class:`Handback`, and :func:`resilient.collectives.ring_rail.ring_pass`
finishes the pass on channels, told what every message's C step did and which
sub-chunks were folded.

No fold overlaps a transfer here, where the Python path folds sub-chunk j while
j + 1 arrives: on a host whose ranks share its cores the CPU, not the overlap,
is what a pass waits for, and a C step per ring step costs microseconds of
interpreter where the Python path's 2 x 8 messages per step cost milliseconds.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from resilient.collectives.native_acks import StepAcks, acked
from resilient.collectives.reduce_ops import REDUCERS, Reduce
from resilient.collectives.ring_plan import (
    RingPass,
    RingSeat,
    Span,
    recv_chunk,
    send_chunk,
    sub_spans,
)
from resilient.links import native_steps
from resilient.links.byte_views import bytes_of

if TYPE_CHECKING:
    from resilient.collectives.route import Route
    from resilient.links.table import Link

__all__ = ["Handback", "Scratch", "ring_in_c"]

# The engine's receive buffers: scratch(rail, like, numel) (RingEngine.scratch).
Scratch = Callable[[int, torch.Tensor, int], torch.Tensor]


class Handback(NamedTuple):
    """What a pass whose C steps stopped leaves the channels to finish."""

    ahead: tuple[list[object], list[object]]  # every message's C step (see Rx.ahead)
    folded: frozenset[tuple[int, int]]  # the (step, sub-chunk) receives folded already
    # What the last step did of the acknowledgements (several rails): the one
    # received from the right (Tx's) and the one sent to the left (Rx's).
    acks: tuple[Any, Any] = (None, None)


def ring_in_c(
    ring: RingSeat,
    flat: torch.Tensor,
    plan: RingPass,
    op: Reduce,
    route: Route,
    scratch: Scratch,
) -> bool | Handback:
    """Run the pass in C steps. True: it ran whole; False: the links are not quiet,
    nothing was moved; a :class:`Handback`: a C step stopped, the channels finish."""
    if flat.device.type != "cpu":
        return False
    links = native_steps.quiet_links(route.links, [ring.right, ring.left], plan.rail)
    if links is None:
        return False
    # A sum of a dtype C adds bit for bit like torch folds in C, as each sub-chunk
    # lands: then the whole pass is one C step. Other ops fold in torch between steps.
    kind = native_steps.FOLDS.get(flat.dtype, 0) if REDUCERS[op] is REDUCERS[Reduce.SUM] else 0
    whole = kind != 0 or plan.reduce_steps == 0
    stopped = Pass(ring, flat, plan, route, links, kind, scratch).run(op, whole=whole)
    return True if stopped is None else stopped


class Pass:
    """One ring pass's C steps over the rail's [right, left] links."""

    def __init__(
        self,
        ring: RingSeat,
        flat: torch.Tensor,
        plan: RingPass,
        route: Route,
        links: list[Link],
        kind: int,
        scratch: Scratch,
    ) -> None:
        self.ring, self.flat, self.plan, self.route, self.kind = ring, flat, plan, route, kind
        self.right, self.left = links
        two = self.right is not self.left  # with two ranks both neighbours are one pair
        self.pairs = [self.right.pg, self.left.pg] if two else [self.right.pg]
        self.ledgers = [self.right.ledger, self.left.ledger] if two else [self.right.ledger]
        self.li = 1 if two else 0
        k = plan.subs
        self.subs = [sub_spans(piece, k) for piece in plan.pieces]  # subs[chunk][j]
        self.largest = max((sp.size for chunk in self.subs for sp in chunk), default=0)
        self.pool = scratch(plan.rail, flat, self.largest * k)
        self.buf, self.base = bytes_of(flat.reshape(-1)), flat.data_ptr()
        self.raw, self.pbase = bytes_of(self.pool), self.pool.data_ptr()

    def spans(self, step: int, send: bool) -> list[Span]:
        ring, p = self.ring, self.plan
        chunk = (send_chunk if send else recv_chunk)(ring.pos, step, ring.world, p.shift)
        return self.subs[ring.rank_at(chunk)]

    def post(self, one: native_steps.Step, step: int, got: dict[tuple[int, int], int]) -> None:
        """Add ring step ``step``'s messages to ``one``; ``got``: (step, j) -> receive
        index, for a send that waits for its sub-chunk's last receive (and fold)."""
        e, k, route = self.flat.element_size(), self.plan.subs, self.route
        into_scratch = step < self.plan.reduce_steps
        for j, (s, r) in enumerate(
            zip(self.spans(step, True), self.spans(step, False), strict=True)
        ):
            tag = step * k + j + route.base
            if s.size:
                wire, waits = self.right.ledger.tag(tag), got.get((step - 1, j), -1)
                one.send(
                    0,
                    wire,
                    route.sent_digest,
                    self.buf,
                    self.base,
                    s.start * e,
                    s.size * e,
                    after_recv=waits,
                )
            if not r.size:
                continue
            wire = self.left.ledger.tag(tag)
            if into_scratch:
                at, fold = j * self.largest * e, (self.base + r.start * e if self.kind else 0)
                got[(step, j)] = one.recv(
                    self.li,
                    wire,
                    route.digest,
                    self.raw,
                    self.pbase,
                    at,
                    r.size * e,
                    fold=fold,
                    kind=self.kind,
                )
            else:
                got[(step, j)] = one.recv(
                    self.li, wire, route.digest, self.buf, self.base, r.start * e, r.size * e
                )

    def acks(self, one: native_steps.Step) -> StepAcks | None:
        """Add the acknowledgements to the pass's last step (several rails)."""
        if not acked(self.route):
            return None
        acks = StepAcks(self.route, self.plan.rail, 1)
        acks.give(one, self.li, self.ring.left, self.left)
        acks.expect(one, 0, self.ring.right, self.right)
        return acks

    def run(self, op: Reduce, *, whole: bool) -> Handback | None:
        """The pass: one C step for all of it (``whole``: folds in C or none), else a
        C step per ring step with torch's folds after each. None: it ran whole."""
        plan, reduce = self.plan, REDUCERS[op]
        groups = [list(range(plan.steps))] if whole else [[s] for s in range(plan.steps)]
        done: tuple[list[object], list[object]] = ([], [])  # what finished steps moved
        folded: set[tuple[int, int]] = set()
        for n, steps in enumerate(groups):
            one = native_steps.Step(self.pairs, self.ledgers)
            got: dict[tuple[int, int], int] = {}
            for step in steps:
                self.post(one, step, got)
            acks = self.acks(one) if n == len(groups) - 1 else None
            stopped = one.run()
            if stopped is not None:
                for (step, j), idx in got.items():  # those the C step completed, folded
                    if (
                        self.kind
                        and step < plan.reduce_steps
                        and isinstance(stopped[1][idx], native_steps.Moved)
                    ):
                        folded.add((step, j))
                sent, recvd, theirs = stopped[0], stopped[1], (None, None)
                if acks is not None:
                    sent, recvd, tx, rx = acks.split(sent, recvd)
                    theirs = (tx[self.ring.right], rx[self.ring.left])
                ahead = (done[0] + sent, done[1] + recvd)
                return Handback(ahead, frozenset(folded), theirs)
            if acks is not None:
                acks.ran_whole()
            done[0].extend(native_steps.DONE for _ in one.sends)
            done[1].extend(native_steps.finished(self.pairs[m[0]], one.news) for m in one.recvs)
            for step, j in got:
                if step < plan.reduce_steps:
                    if not self.kind:
                        r, at = self.spans(step, False)[j], j * self.largest
                        reduce(self.flat[r.start : r.stop], self.pool[at : at + r.size])
                    folded.add((step, j))
        return None
