"""All-to-all: every rank sends one block of bytes straight to each peer.

A pairwise exchange over the engine's data links, no folds: block ``p`` of this
rank's send buffer goes to rank ``p``, and rank ``p``'s block for this rank lands in
block ``p`` of the receive buffer; this rank's own block is a local copy. Every
message's size was agreed before the call (the process group checks every rank's
splits first: a size that differed between the two ends would fail the pair).

A message is cut across the rails by the engine's agreed weights when it is large
(``single_rail_below_bytes`` and up, as the engine's other schedules), else it
takes the heaviest rail; both ends cut it alike, from its size and the weights.

* One rail with quiet socket links: one C step (:mod:`resilient.links.native_steps`)
  moves every frame without the GIL. A step that stops hands its streams back and
  the failover channels finish from there, as the mesh does
  (:mod:`resilient.collectives.mesh_native`).
* Otherwise: a :class:`~resilient.collectives.failover.Tx` / ``Rx`` per (peer, rail)
  with bytes to move, every receive posted before any send, on this one thread
  (the socket engine moves every pair's bytes from the thread that waits), with
  the links' deadlines, failover and acknowledgements.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

import torch

from resilient.collectives.engine import RingEngine
from resilient.collectives.failover import Rx, Tx
from resilient.collectives.ring_plan import Span, rail_sizes
from resilient.collectives.route import Route
from resilient.links import native_steps
from resilient.links.byte_views import bytes_of

if TYPE_CHECKING:
    from resilient.links.table import Link

__all__ = ["all_to_all", "spans_of"]

# One message per (peer, rail) and call: its tag (the route adds the call's base).
_TAG = 0

# Where one piece goes: (peer, rail, span in the send buffer or the receive buffer).
_Piece = tuple[int, int, Span]


def spans_of(sizes: Sequence[int]) -> list[Span]:
    """Consecutive spans of ``sizes`` (one per rank), from 0."""
    out, at = [], 0
    for n in sizes:
        out.append(Span(at, at + n))
        at += n
    return out


def _rail_cut(engine: RingEngine, nbytes: int) -> list[int]:
    """Bytes of an ``nbytes`` message on each rail: by the weights when large, else
    all on the heaviest rail (the rule of RingEngine's schedules)."""
    if engine.num_rails == 1:
        return [nbytes]
    weights = engine.weights
    if nbytes < engine.single_rail_below_bytes:
        best = max(range(engine.num_rails), key=lambda r: weights[r])
        weights = tuple(1.0 if r == best else 0.0 for r in range(engine.num_rails))
    return rail_sizes(nbytes, weights)


def _pieces(engine: RingEngine, spans: Sequence[Span]) -> list[_Piece]:
    """Every non-empty piece of the peers' spans, peer by peer, rail by rail."""
    out: list[_Piece] = []
    for peer, span in enumerate(spans):
        if peer == engine.rank or not span.size:
            continue
        at = span.start
        for rail, n in enumerate(_rail_cut(engine, span.size)):
            if n:
                out.append((peer, rail, Span(at, at + n)))
            at += n
    return out


def all_to_all(
    engine: RingEngine,
    send: torch.Tensor,
    recv: torch.Tensor,
    send_spans: Sequence[Span],
    recv_spans: Sequence[Span],
) -> None:
    """Send ``send[send_spans[p]]`` to rank ``p`` and receive rank ``p``'s block
    into ``recv[recv_spans[p]]``, for every rank ``p`` (this rank's own: a copy).

    ``send`` and ``recv`` are contiguous 1-D uint8 tensors (the bytes); the spans
    are in bytes, and ``recv_spans[p]`` has the size of rank ``p``'s
    ``send_spans[rank]`` on every rank (checked by the caller beforehand).

    Raises:
        LinkError: a link failed and no failover could finish the call.
        PeerLost: as any collective.
    """
    me = engine.rank
    own_in, own_out = send_spans[me], recv_spans[me]
    recv[own_out.start : own_out.stop].copy_(send[own_in.start : own_in.stop])
    sends, recvs = _pieces(engine, send_spans), _pieces(engine, recv_spans)
    if not sends and not recvs:
        return
    peers = [p for p in range(engine.world) if p != me]
    # Every rail, used or not: a failover must find its backup link built.
    engine.links.ensure((p, rail) for rail in range(engine.num_rails) for p in peers)
    # The engine numbers its calls when it makes a route (failover records and
    # acknowledgement tags carry the number, alike on every rank).
    route = engine.route()
    ahead: tuple[dict[int, list[object]], dict[int, list[object]]] | None = None
    if engine.num_rails == 1 and send.device.type == "cpu":
        links = native_steps.quiet_links(engine.links, peers, 0)
        if links is not None:
            step = _step(links, route, peers, send, recv, sends, recvs)
            stopped = step.run()
            if stopped is None:
                return
            ahead = _ahead(peers, step, stopped)
    _on_channels(route, send, recv, sends, recvs, ahead)


def _step(
    links: Sequence[Link],
    route: Route,
    peers: Sequence[int],
    send: torch.Tensor,
    recv: torch.Tensor,
    sends: Sequence[_Piece],
    recvs: Sequence[_Piece],
) -> native_steps.Step:
    """The whole exchange as one C step, posted (not run)."""
    pairs = [link.pg for link in links]
    ledgers = [link.ledger for link in links]
    at = {p: i for i, p in enumerate(peers)}
    step = native_steps.Step(pairs, ledgers)
    sview, sbase = bytes_of(send), send.data_ptr()
    rview, rbase = bytes_of(recv), recv.data_ptr()
    for peer, _, span in recvs:
        i = at[peer]
        tag = ledgers[i].tag(_TAG + route.base)
        step.recv(i, tag, route.digest, rview, rbase, span.start, span.size)
    for peer, _, span in sends:
        i = at[peer]
        tag = ledgers[i].tag(_TAG + route.base)
        step.send(i, tag, route.sent_digest, sview, sbase, span.start, span.size)
    return step


def _ahead(
    peers: Sequence[int], step: native_steps.Step, stopped: tuple[list[object], list[object]]
) -> tuple[dict[int, list[object]], dict[int, list[object]]]:
    """Per peer, what the stopped C step did of its send and its receive."""
    tx: dict[int, list[object]] = {p: [] for p in peers}
    rx: dict[int, list[object]] = {p: [] for p in peers}
    for out, w in zip(step.sends, stopped[0], strict=True):
        tx[peers[out[0]]].append(w)
    for got, w in zip(step.recvs, stopped[1], strict=True):
        rx[peers[got[0]]].append(w)
    return tx, rx


def _on_channels(
    route: Route,
    send: torch.Tensor,
    recv: torch.Tensor,
    sends: Sequence[_Piece],
    recvs: Sequence[_Piece],
    ahead: tuple[dict[int, list[object]], dict[int, list[object]]] | None,
) -> None:
    """The exchange on failover channels, one per (peer, rail) with a piece
    (``ahead``: what a stopped C step moved, on rail 0)."""
    sockets = route.links.sockets and send.device.type == "cpu"
    # Socket links take slices of one byte view (no tensor view per message).
    sview = bytes_of(send) if sockets else send
    rview = bytes_of(recv) if sockets else recv
    rxs: list[tuple[Rx, int, int]] = []
    for peer, rail, span in recvs:
        rx = Rx(route, peer, rail)
        if ahead is not None:
            rx.ahead.extend(ahead[1].get(peer, ()))
        rxs.append((rx, rx.post(rview[span.start : span.stop], _TAG), span.size))
    txs: list[tuple[Tx, int, int]] = []
    for peer, rail, span in sends:
        tx = Tx(route, peer, rail)
        if ahead is not None:
            tx.ahead.extend(ahead[0].get(peer, ()))
        txs.append((tx, tx.post(sview[span.start : span.stop], _TAG), span.size))
    for rx, idx, nbytes in rxs:
        rx.wait(idx, nbytes)
    for tx, idx, nbytes in txs:
        tx.wait(idx, nbytes)
    # Acknowledgements are posted before anyone waits for one (see failover).
    for rx, _, _ in rxs:
        rx.ack()
    for tx, _, _ in txs:
        tx.finish()
    for rx, _, _ in rxs:
        rx.finish()
