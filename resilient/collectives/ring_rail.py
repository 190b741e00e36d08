"""One rail's share of a ring schedule: a ring pass, or a broadcast's chain.

A ring pass moves every piece around the ring, one ring step at a time, the first
``reduce_steps`` of them folding what arrives (reduce-scatter), the rest copying it
(all-gather); a chain is the ring cut open at a broadcast's root. Both run on
failover channels (:mod:`resilient.collectives.failover`), except that a ring pass
runs in C steps while its links are quiet (:mod:`resilient.collectives.ring_native`),
and the channels finish whatever a stopped C step handed back.

Pipelining: each piece is cut into sub-chunks. The sub-chunk received (and reduced)
at ring step t is exactly what is sent at step t+1, so its send is posted the moment
it is ready, while later sub-chunks are still in flight.
"""

from __future__ import annotations

import torch

from resilient.collectives.chain_native import ChainHandback, chain_in_c
from resilient.collectives.failover import Rx, Tx
from resilient.collectives.reduce_ops import REDUCERS, Reduce
from resilient.collectives.ring_native import Handback, Scratch, ring_in_c
from resilient.collectives.ring_plan import (
    RingPass,
    RingSeat,
    Span,
    recv_chunk,
    send_chunk,
    sub_spans,
)
from resilient.collectives.route import Route
from resilient.links import native_steps

__all__ = ["chain", "ring_pass"]


def ring_pass(
    ring: RingSeat,
    flat: torch.Tensor,
    plan: RingPass,
    op: Reduce,
    route: Route,
    scratch: Scratch,
) -> None:
    """One rail's ring pass over ``flat``, in place; in C while its links are quiet.
    ``scratch(rail, flat, numel)``: the receive buffers (RingEngine.scratch)."""
    moved = ring_in_c(ring, flat, plan, op, route, scratch)
    native_steps.count_pass(in_c=moved is True)
    if moved is not True:
        handback = moved if isinstance(moved, Handback) else None
        _on_channels(ring, flat, plan, op, route, scratch, handback)


def _on_channels(
    ring: RingSeat,
    flat: torch.Tensor,
    plan: RingPass,
    op: Reduce,
    route: Route,
    scratch: Scratch,
    handback: Handback | None,
) -> None:
    """The pass on channels; ``handback``: what stopped C steps moved (see Rx.ahead)
    and the (step, sub-chunk) receives they folded already."""
    acks = handback.acks if handback is not None else (None, None)
    tx = Tx(route, ring.right, plan.rail, ack=acks[0])
    rx = Rx(route, ring.left, plan.rail, ack=acks[1])
    folded: frozenset[tuple[int, int]] = frozenset()
    if handback is not None:
        tx.ahead.extend(handback.ahead[0])
        rx.ahead.extend(handback.ahead[1])
        folded = handback.folded
    reduce = REDUCERS[op]
    k, elem = plan.subs, flat.element_size()
    subs = [sub_spans(piece, k) for piece in plan.pieces]  # subs[chunk][j]
    largest = max((sp.size for chunk in subs for sp in chunk), default=0)
    pool = scratch(plan.rail, flat, largest * k)
    bufs = [pool[j * largest : (j + 1) * largest] for j in range(k)]
    sends: list[list[tuple[int, int]]] = [[] for _ in range(plan.steps)]
    recvs: list[list[tuple[int | None, Span]]] = [[] for _ in range(plan.steps)]

    pos, world = ring.pos, ring.world

    def post(step: int, j: int) -> None:
        # Positions, not ranks: in a re-ordered ring the chunk a position owns is
        # its rank's, so reduce_scatter and all_gather keep their meaning.
        r = subs[ring.rank_at(recv_chunk(pos, step, world, plan.shift))][j]
        s = subs[ring.rank_at(send_chunk(pos, step, world, plan.shift))][j]
        tag = step * k + j
        idx = None
        if r.size:
            into = bufs[j][: r.size] if step < plan.reduce_steps else flat[r.start : r.stop]
            idx = rx.post(into, tag)
        recvs[step].append((idx, r))
        if s.size:
            sends[step].append((tx.post(flat[s.start : s.stop], tag), s.size * elem))

    for j in range(k):
        post(0, j)
    for step in range(plan.steps):
        for j, (idx, r) in enumerate(recvs[step]):
            if idx is not None:
                rx.wait(idx, r.size * elem)
                if step < plan.reduce_steps and (step, j) not in folded:
                    reduce(flat[r.start : r.stop], bufs[j][: r.size])
            if step + 1 < plan.steps:
                post(step + 1, j)  # what just arrived is what goes out next
        if step >= 1:
            # Step-1 sends read regions that later steps overwrite: finish them now.
            for idx, nbytes in sends[step - 1]:
                tx.wait(idx, nbytes)
    for idx, nbytes in sends[plan.steps - 1]:
        tx.wait(idx, nbytes)
    _close(tx, rx)


def chain(
    ring: RingSeat,
    flat: torch.Tensor,
    subs: list[Span],
    rail: int,
    root_pos: int,
    route: Route,
) -> None:
    """One rail's part of a broadcast from the rank at ring position ``root_pos``:
    receive each sub-chunk of the rail's piece from the left, pass it on to the
    right (the chain ends left of the root)."""
    pos = (ring.pos - root_pos) % ring.world
    moved = chain_in_c(ring, flat, subs, rail, pos, route)
    native_steps.count_pass(in_c=moved is True)
    if moved is True:
        return
    back = moved if isinstance(moved, ChainHandback) else None
    elem = flat.element_size()
    acks = back.acks if back is not None else (None, None)
    tx = Tx(route, ring.right, rail, ack=acks[0]) if pos < ring.world - 1 else None
    rx = Rx(route, ring.left, rail, ack=acks[1]) if pos > 0 else None
    if back is not None:  # what the stopped C step moved of each message
        if tx is not None:
            tx.ahead.extend(back.sent)
        if rx is not None:
            rx.ahead.extend(back.got)
    sends: list[tuple[int, int]] = []
    recvs = [
        (rx.post(flat[s.start : s.stop], j) if rx else None, j, s)
        for j, s in enumerate(subs)
        if s.size
    ]
    for idx, j, s in recvs:
        if rx is not None and idx is not None:
            rx.wait(idx, s.size * elem)
        if tx is not None:
            sends.append((tx.post(flat[s.start : s.stop], j), s.size * elem))
    for idx, nbytes in sends:
        assert tx is not None
        tx.wait(idx, nbytes)
    _close(tx, rx)


def _close(tx: Tx | None, rx: Rx | None) -> None:
    """Acknowledge what was received, wait for what was sent to be acknowledged.

    Acknowledgements are posted before anyone waits for one, so no rank waits on a
    neighbour that waits on it.
    """
    if rx is not None:
        rx.ack()
    if tx is not None:
        tx.finish()
    if rx is not None:
        rx.finish()
