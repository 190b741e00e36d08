"""All-to-all: every rank sends one block of bytes straight to each peer.

A pairwise exchange over the engine's data links, no folds: block ``p`` of this
rank's send buffer goes to rank ``p``, and rank ``p``'s block for this rank lands in
block ``p`` of the receive buffer; this rank's own block is a local copy. Every
message's size was agreed before the call (the process group checks every rank's
splits first: a size that differed between the two ends would fail the pair).

A message is cut across the rails by the engine's agreed weights when it is large
(``single_rail_below_bytes`` and up, as the engine's other schedules), else it
takes the heaviest rail; both ends cut it alike, from its size and the weights.

* Quiet socket links: one C step (:mod:`resilient.links.native_steps`) moves every
  frame of every rail without the GIL (on 2+ rails with the acknowledgements,
  :mod:`resilient.collectives.native_acks`). A step that stops hands its streams
  back and the failover channels finish from there, as the mesh does
  (:mod:`resilient.collectives.mesh_native`).
* Otherwise: a :class:`~resilient.collectives.failover.Tx` / ``Rx`` per (peer, rail)
  with bytes to move, every receive posted before any send, on this one thread
  (the socket engine moves every pair's bytes from the thread that waits), with
  the links' deadlines, failover and acknowledgements.

An *elided* call (the engine's ``elided`` set: no signature exchange ran, see
:mod:`resilient.collectives.digest_check`) is *gated*: its first message to each
peer is a header-only frame carrying the call's digest, and no data is read
before every peer's gate frame came with the same digest (the C step chains the
gate receives and makes every data receive wait for the last). A peer whose call
differs sends another digest (or a hello, which no receive accepts), so every
rank refuses the call at its gate, with nothing written into its receive buffer,
and falls back to a full exchange. Only equal splits elide (the process group
decides): equal digests then mean equal block sizes everywhere.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, NamedTuple, TypeVar

import torch

from resilient.collectives.digest_check import NotElided
from resilient.collectives.engine import RingEngine
from resilient.collectives.failover import Rx, Tx
from resilient.collectives.native_acks import StepAcks, acked
from resilient.collectives.ring_plan import Span, rail_sizes
from resilient.collectives.route import Route
from resilient.links import native_steps
from resilient.links.byte_views import bytes_of
from resilient.links.socket_frames import DigestMismatch

if TYPE_CHECKING:
    from resilient.links.table import Link

__all__ = ["all_to_all", "equal_sizes", "gate", "sizes_of", "sizes_payload", "spans_of"]

# The tags of a call's messages (the route adds the call's base): an elided call's
# header-only gate frame per peer, the tag a peer's hello comes under (digest_check),
# then one data message per (peer, rail).
_GATE = 0
_TAG = 1

_C = TypeVar("_C", Tx, Rx)
_NOTHING = torch.empty(0, dtype=torch.uint8)

# Where one piece goes: (peer, rail, span in the send buffer or the receive buffer).
_Piece = tuple[int, int, Span]


def spans_of(sizes: Sequence[int]) -> list[Span]:
    """Consecutive spans of ``sizes`` (one per rank), from 0."""
    out, at = [], 0
    for n in sizes:
        out.append(Span(at, at + n))
        at += n
    return out


def sizes_payload(send: Sequence[int], recv: Sequence[int]) -> torch.Tensor:
    """This rank's row of sizes (elements it sends each rank, then receives from
    each), as the call's inline payload: int64, ``2 * ranks`` of them."""
    return torch.tensor([*send, *recv], dtype=torch.int64)


def sizes_of(table: torch.Tensor, world: int) -> torch.Tensor:
    """Every rank's :func:`sizes_payload` from an exchange's payload ``table`` (one
    row of bytes per rank), as a ``(world, 2 * world)`` int64 table."""
    return table[:, : 2 * world * 8].contiguous().view(torch.int64)


def equal_sizes(table: torch.Tensor, world: int) -> bool:
    """Whether every rank sends and receives one block size to and from every rank
    (``table``: the exchange's payloads; empty when the sizes did not fit)."""
    if table.dim() != 2 or table.shape[0] != world or table.shape[1] < 2 * world * 8:
        return False
    sizes = sizes_of(table, world)
    return bool((sizes == sizes[0, 0]).all())


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
    ``send_spans[rank]`` on every rank (checked by the caller beforehand, or by
    the gate of an elided call).

    Raises:
        NotElided: the call runs elided and cannot be (nothing was posted).
        DigestMismatch: it runs elided and a peer's call differs (nothing was
            written into ``recv``).
        LinkError: a link failed and no failover could finish the call.
        PeerLost: as any collective.
    """
    me = engine.rank
    gated = engine.elided is not None
    peers = [p for p in range(engine.world) if p != me]
    if gated:
        _check_elidable(engine, send, peers)
    sends, recvs = _pieces(engine, send_spans), _pieces(engine, recv_spans)
    if sends or recvs or gated:
        # Every rail, used or not: a failover must find its backup link built.
        engine.links.ensure((p, rail) for rail in range(engine.num_rails) for p in peers)
        # The engine numbers its calls when it makes a route (failover records and
        # acknowledgement tags carry the number, alike on every rank).
        _exchange(engine, engine.route(), peers, send, recv, sends, recvs, gated=gated)
    # Last: an elided call's gate may refuse it, and nothing may be written then.
    own_in, own_out = send_spans[me], recv_spans[me]
    recv[own_out.start : own_out.stop].copy_(send[own_in.start : own_in.stop])


def gate(engine: RingEngine) -> None:
    """An elided call's gate alone, for a schedule that cannot gate by its own first
    messages (resilient.collectives.ring_gate): what an elided all_to_all with no
    data moves. A header-only frame with the call's digest to every peer on rail 0,
    every peer's awaited, then (several rails) the acknowledgements, so a rail lost
    meanwhile fails the frames over as any call's. A call of its own number.

    Raises:
        NotElided: a link to some peer is not built (nothing was posted).
        DigestMismatch: a peer's call differs.
        LinkError: a link failed and no failover could finish the gate.
        PeerLost: as any collective.
    """
    peers = [p for p in range(engine.world) if p != engine.rank]
    links = engine.links
    if not links.sockets or not links.has_all(
        (p, rail) for rail in range(engine.num_rails) for p in peers
    ):
        raise NotElided(f"rank {engine.rank}: a link is not built, this call does not gate")
    _exchange(engine, engine.route(), peers, _NOTHING, _NOTHING, (), (), gated=True)


def _check_elidable(engine: RingEngine, send: torch.Tensor, peers: Sequence[int]) -> None:
    """Raises NotElided unless an elided call can gate here: CPU bytes, socket
    links, one rail, a link to every peer already built (links are built in
    checked calls only: a rendezvous with a peer that left would wait for its
    timeout, where an exchange fails at once)."""
    if (
        engine.num_rails == 1
        and send.device.type == "cpu"
        and engine.links.sockets
        and engine.links.has_all((p, 0) for p in peers)
    ):
        return
    raise NotElided(f"rank {engine.rank}: this all_to_all does not run elided")


class _Handback(NamedTuple):
    """What a stopped C step leaves the channels, by (peer, rail): what it did of
    each message (see Rx.ahead) and of each acknowledgement (native_acks)."""

    tx: dict[tuple[int, int], list[object]]
    rx: dict[tuple[int, int], list[object]]
    tx_acks: dict[tuple[int, int], Any]
    rx_acks: dict[tuple[int, int], Any]


def _exchange(
    engine: RingEngine,
    route: Route,
    peers: Sequence[int],
    send: torch.Tensor,
    recv: torch.Tensor,
    sends: Sequence[_Piece],
    recvs: Sequence[_Piece],
    *,
    gated: bool,
) -> None:
    """Move the pieces: one C step when it can, else (or from where it stopped)
    the failover channels."""
    back = None
    if send.device.type == "cpu":
        moved = _in_c(engine, route, peers, send, recv, sends, recvs, gated=gated)
        if moved is True:
            native_steps.count_pass(in_c=True)
            return
        back = moved or None
    native_steps.count_pass(in_c=False)
    _on_channels(engine, route, peers, send, recv, sends, recvs, back, gated=gated)


def _in_c(
    engine: RingEngine,
    route: Route,
    peers: Sequence[int],
    send: torch.Tensor,
    recv: torch.Tensor,
    sends: Sequence[_Piece],
    recvs: Sequence[_Piece],
    *,
    gated: bool,
) -> bool | _Handback:
    """The exchange as one C step over every rail it uses. True: it ran whole;
    False: some link is not quiet, nothing moved; else what the channels finish."""
    rails = sorted({r for _, r, _ in (*sends, *recvs)} | ({0} if gated else set()))
    links: list[Link] = []
    for rail in rails:
        quiet = native_steps.quiet_links(engine.links, peers, rail)
        if quiet is None:
            return False
        links.extend(quiet)
    at = {(link.peer, link.rail): i for i, link in enumerate(links)}
    step = _step(links, at, route, peers, send, recv, sends, recvs, gated=gated)
    # The gate's channels acknowledge too (rail 0, every peer; see _on_channels).
    gates = [(p, 0, Span(0, 0)) for p in peers] if gated else []
    ack_sends, ack_recvs = [*gates, *sends], [*gates, *recvs]
    acks = [_acks(step, route, rail, at, links, ack_sends, ack_recvs) for rail in rails] if acked(
        route
    ) else []  # fmt: skip
    began = time.monotonic()
    stopped = step.run()
    if gated:  # the step's wait for its peers counts as the gate's (as the mesh's)
        engine.gate_waited_s += time.monotonic() - began
        engine.gate_news = engine.gate_news or step.news
    if stopped is None:
        for one in acks:
            one.ran_whole()
        return True
    sent, got = stopped
    tx_acks: dict[tuple[int, int], Any] = {}
    rx_acks: dict[tuple[int, int], Any] = {}
    # No acknowledgements on one rail; on several, the last rail's come last.
    for rail, one in reversed(list(zip(rails, acks, strict=False))):
        sent, got, tx, rx = one.split(sent, got)
        tx_acks.update({(p, rail): w for p, w in tx.items()})
        rx_acks.update({(p, rail): w for p, w in rx.items()})
    ahead_tx: dict[tuple[int, int], list[object]] = {}
    ahead_rx: dict[tuple[int, int], list[object]] = {}
    for out, w in zip(step.sends[: len(sent)], sent, strict=True):
        ahead_tx.setdefault((links[out[0]].peer, links[out[0]].rail), []).append(w)
    for into, w in zip(step.recvs[: len(got)], got, strict=True):
        ahead_rx.setdefault((links[into[0]].peer, links[into[0]].rail), []).append(w)
    return _Handback(ahead_tx, ahead_rx, tx_acks, rx_acks)


def _acks(
    step: native_steps.Step,
    route: Route,
    rail: int,
    at: dict[tuple[int, int], int],
    links: Sequence[Link],
    sends: Sequence[_Piece],
    recvs: Sequence[_Piece],
) -> StepAcks:
    """The acknowledgements of ``rail``'s channels: one per peer we receive from
    there (sent), one per peer we send to there (received)."""
    acks = StepAcks(route, rail, len(links))
    for peer in dict.fromkeys(p for p, r, _ in recvs if r == rail):
        i = at[(peer, rail)]
        acks.give(step, i, peer, links[i])
    for peer in dict.fromkeys(p for p, r, _ in sends if r == rail):
        i = at[(peer, rail)]
        acks.expect(step, i, peer, links[i])
    return acks


def _step(
    links: Sequence[Link],
    at: dict[tuple[int, int], int],
    route: Route,
    peers: Sequence[int],
    send: torch.Tensor,
    recv: torch.Tensor,
    sends: Sequence[_Piece],
    recvs: Sequence[_Piece],
    *,
    gated: bool,
) -> native_steps.Step:
    """The whole exchange as one C step, posted (not run); ``at``: the index of the
    link of each (peer, rail). ``gated`` (one rail): each peer's gate frame first,
    the gate receives chained one after the other and every data receive after the
    last, so no data is read before every gate passed."""
    ledgers = [link.ledger for link in links]
    step = native_steps.Step([link.pg for link in links], ledgers)
    sview, sbase = bytes_of(send), send.data_ptr()
    rview, rbase = bytes_of(recv), recv.data_ptr()
    last = -1
    if gated:
        for p in peers:
            i = at[(p, 0)]
            tag = ledgers[i].tag(_GATE + route.base)
            last = step.recv(i, tag, route.digest, rview, rbase, 0, 0, after_recv=last)
    for peer, rail, span in recvs:
        i = at[(peer, rail)]
        tag = ledgers[i].tag(_TAG + route.base)
        step.recv(i, tag, route.digest, rview, rbase, span.start, span.size, after_recv=last)
    if gated:
        for p in peers:
            i = at[(p, 0)]
            tag = ledgers[i].tag(_GATE + route.base)
            step.send(i, tag, route.sent_digest, sview, sbase, 0, 0)
    for peer, rail, span in sends:
        i = at[(peer, rail)]
        tag = ledgers[i].tag(_TAG + route.base)
        step.send(i, tag, route.sent_digest, sview, sbase, span.start, span.size)
    return step


def _on_channels(
    engine: RingEngine,
    route: Route,
    peers: Sequence[int],
    send: torch.Tensor,
    recv: torch.Tensor,
    sends: Sequence[_Piece],
    recvs: Sequence[_Piece],
    back: _Handback | None,
    *,
    gated: bool,
) -> None:
    """The exchange on failover channels, one per (peer, rail) with a piece
    (``back``: what a stopped C step moved); ``gated``: every peer's gate frame
    first (rail 0), and no data receive posted before all came.

    Raises:
        DigestMismatch: a peer's gate frame refuses the call (the channels let go).
    """
    sockets = route.links.sockets and send.device.type == "cpu"
    # Socket links take slices of one byte view (no tensor view per message).
    sview = bytes_of(send) if sockets else send
    rview = bytes_of(recv) if sockets else recv
    rx_of: dict[tuple[int, int], Rx] = {}
    tx_of: dict[tuple[int, int], Tx] = {}

    def channel(kind: type[_C], of: dict[tuple[int, int], _C], peer: int, rail: int) -> _C:
        one = of.get((peer, rail))
        if one is None:
            tx = kind is Tx
            ack = None if back is None else (back.tx_acks if tx else back.rx_acks).get((peer, rail))
            one = of[(peer, rail)] = kind(route, peer, rail, ack=ack)
            if back is not None:
                one.ahead.extend((back.tx if tx else back.rx).get((peer, rail), ()))
        return one

    rxs: list[tuple[Rx, int, int]] = []

    def post_recvs() -> None:
        for peer, rail, span in recvs:
            rx = channel(Rx, rx_of, peer, rail)
            rxs.append((rx, rx.post(rview[span.start : span.stop], _TAG), span.size))

    gates = [channel(Rx, rx_of, p, 0) for p in peers] if gated else []
    gate_idx = [rx.post(rview[0:0], _GATE) for rx in gates]
    if not gated:  # every receive before any send: an early message is copied twice
        post_recvs()
    txs: list[tuple[Tx, int, int]] = []
    for peer in peers if gated else ():
        tx = channel(Tx, tx_of, peer, 0)
        txs.append((tx, tx.post(sview[0:0], _GATE), 0))
    for peer, rail, span in sends:
        tx = channel(Tx, tx_of, peer, rail)
        txs.append((tx, tx.post(sview[span.start : span.stop], _TAG), span.size))
    if gated:
        _gate(engine, list(zip(gates, gate_idx, strict=True)), [*tx_of.values(), *rx_of.values()])
        post_recvs()
    for rx, idx, nbytes in rxs:
        rx.wait(idx, nbytes)
    for tx, idx, nbytes in txs:
        tx.wait(idx, nbytes)
    # Acknowledgements are posted before anyone waits for one (see failover).
    for rx in rx_of.values():
        rx.ack()
    for tx in tx_of.values():
        tx.finish()
    for rx in rx_of.values():
        rx.finish()


def _gate(engine: RingEngine, gates: Sequence[tuple[Rx, int]], channels: Sequence[Tx | Rx]) -> None:
    """Wait for every peer's gate frame (its digest is the peer's call's). On a
    refused one every channel lets go, so no failover of this call starts later.

    Raises:
        DigestMismatch: a peer's call differs.
    """
    began = time.monotonic()
    try:
        for rx, i in gates:
            rx.wait(i, 0)
            engine.gate_news = engine.gate_news or rx.news(i)
    except DigestMismatch:
        for ch in channels:
            ch.release()
        raise
    finally:
        engine.gate_waited_s += time.monotonic() - began
