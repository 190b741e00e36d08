"""Mesh and ring steps' socket traffic moved in C, without the GIL, when the links are quiet.

The Python socket engine (:mod:`resilient.links.socket_engine`) pays the interpreter for every
poll, read and write, on a thread that shares the GIL and two cores with the
training thread. A mesh step knows in advance every frame each of its sockets will
carry, in order: the contributions it sends and receives, or the results (and a
ring pass: each ring step's sub-chunks, resilient.collectives.ring_native). So when
the step's socket pairs hold nothing half-done (:func:`quiet`), ``_stepio.exchange``
moves them all in one call that releases the GIL (measured: DDP's step overhead
from +5 % to about 0 %, docs/BENCHMARKS.md).

The C code decides nothing. The first thing that is not plain progress (a frame of
another tag, size or digest, a socket error, the end of a stream, the time slice
running out) stops the step, and :func:`hand_back` gives every pair the exact state
of its stream: a header read so far goes back into the pair's buffer, a message
half written goes to the head of its queue, a body half read becomes the pair's
body in progress. The ordinary path (channels, failover, digest checks, stall watch)
then finishes the step from there, as if it had moved those bytes itself.

Without the compiled module (no C compiler at install) :func:`available` is False
and the Python path runs alone.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import TYPE_CHECKING, Any, Final

import torch

from resilient.links import fault_hook
from resilient.links.ledger import OpLedger
from resilient.links.socket_engine import SocketWork
from resilient.links.socket_frames import HEADER, NEWS
from resilient.links.socket_pair import SocketPair

if TYPE_CHECKING:
    from resilient.links.table import Link, LinkTable

try:
    from resilient.links import _stepio  # type: ignore[attr-defined]
except ImportError:  # built without a C compiler
    _stepio = None

__all__ = [
    "DONE",
    "FOLDS",
    "STATS",
    "Moved",
    "Step",
    "available",
    "count_pass",
    "finished",
    "hand_back",
    "quiet",
    "quiet_links",
]

# How long one C step may wait before the Python path takes over (with its stall
# watch and deadlines): healthy steps take milliseconds, plus the time their bytes
# take at what a healthy link moves at least (a whole ring pass is one step).
SLICE_S: Final = 0.05
HEALTHY_BYTES_PER_S: Final = 1e9
# A message moved whole by the C step (where a work would stand otherwise).
DONE: Final = "done"
_HDR: Final = HEADER.size


# The sums a receive may be folded with in C (Step.recv), bit for bit torch's add_.
FOLDS: Final[dict[torch.dtype, int]] = {
    torch.float32: 1,
    torch.float64: 2,
    torch.int32: 3,
    torch.int64: 4,
}
# C steps run, and those that stopped and handed back; a call's rail passes (a
# ring pass, a mesh rail's share, a chain) moved whole in C, and those the Python
# channels moved in whole or in part (for tests, benchmarks and the chaos report).
STATS: Final[dict[str, int]] = {"steps": 0, "stopped": 0, "c_passes": 0, "python_passes": 0}


def count_pass(*, in_c: bool) -> None:
    """Count one rail pass of a call (see STATS)."""
    STATS["c_passes" if in_c else "python_passes"] += 1


class _Blocked:
    """A C step as one op of each of its links' ledgers."""

    __slots__ = ("done",)

    def __init__(self) -> None:
        self.done = False

    def is_completed(self) -> bool:
        return self.done


def available() -> bool:
    return _stepio is not None


def quiet_links(table: LinkTable, peers: Sequence[int], rail: int) -> list[Link] | None:
    """The links to ``peers`` on ``rail`` when C steps may move a call's bytes: the
    module is built and on (``native_io``), socket links, no injected fault active
    (the chaos hook's faults act in the Python path; one that starts during a step
    acts from the next), and every pair healthy and :func:`quiet`. Else None.
    On several rails the caller adds the acknowledgements a failover needs
    (resilient.collectives.native_acks)."""
    chaos = fault_hook.hook()
    if (
        _stepio is None
        or not table.sockets
        or not table.config.native_io
        or (chaos is not None and chaos.faults)
    ):
        return None
    links = [table.get(p, rail) for p in peers]
    if any(link.broken or not quiet(link.pg) for link in links):
        return None
    return links


def quiet(pair: Any) -> bool:
    """``pair`` is a healthy socket pair with nothing queued, posted, stashed or half
    read (so its stream is exactly at a frame boundary on both sides)."""
    return (
        type(pair) is SocketPair
        and pair.error is None
        and not pair._outq
        and not pair._pending
        and not pair._stash
        and pair._body is None
        and pair._start == pair._end
        and not pair._parked
    )


class Step:
    """The frames of one mesh step, in the order each socket carries them.

    A message is (pair index, wire tag, digest, address, bytes) for the C code, and
    (byte view, offset) to hand it back from."""

    __slots__ = ("ledgers", "news", "pairs", "recv_at", "recvs", "send_at", "sends")

    def __init__(self, pairs: Sequence[SocketPair], ledgers: Sequence[OpLedger]) -> None:
        self.pairs, self.ledgers = pairs, ledgers
        self.sends: list[tuple[int, ...]] = []
        self.recvs: list[tuple[int, ...]] = []
        self.send_at: list[tuple[memoryview, int]] = []
        self.recv_at: list[tuple[memoryview, int]] = []
        self.news = False

    def send(
        self,
        i: int,
        tag: int,
        digest: int,
        view: memoryview,
        base: int,
        off: int,
        n: int,
        *,
        after_recv: int = -1,
    ) -> int:
        """Add a send; its index. ``after_recv``: it starts once that receive (an
        index into this step's) is whole, and folded when it folds."""
        if after_recv >= 0:
            self.sends.append((i, tag, digest, base + off, n, after_recv, -1))
        else:
            self.sends.append((i, tag, digest, base + off, n))
        self.send_at.append((view, off))
        return len(self.sends) - 1

    def recv(
        self,
        i: int,
        tag: int,
        digest: int,
        view: memoryview,
        base: int,
        off: int,
        n: int,
        *,
        fold: int = 0,
        kind: int = 0,
        after_recv: int = -1,
    ) -> int:
        """Add a receive; its index. ``fold``, ``kind``: add the message into that
        address once whole (see FOLDS), in C, while the rest of the step still
        moves. ``after_recv``: it starts once that receive (an index) is whole."""
        if kind or after_recv >= 0:
            self.recvs.append((i, tag, digest, base + off, n, fold, kind, after_recv, -1))
        else:
            self.recvs.append((i, tag, digest, base + off, n))
        self.recv_at.append((view, off))
        return len(self.recvs) - 1

    def slice_s(self) -> float:
        moved = sum(m[4] for m in self.sends) + sum(m[4] for m in self.recvs)
        return SLICE_S + moved / HEALTHY_BYTES_PER_S

    def run(self) -> tuple[list[Any], list[Any]] | None:
        """Move every frame; None when all moved, else the works to finish it with:
        per send DONE, per receive a finished work, a :class:`SocketWork` the pair
        finishes, or None (not begun: post it as usual). Claims the pairs meanwhile
        (:meth:`Engine.claim`), so no Python driver touches these sockets."""
        assert _stepio is not None
        engine = self.pairs[0].engine
        fds = [p.fileno for p in self.pairs]
        # The step is an op a thread is blocked on, for each link's ledger: a given-up
        # call cuts such links (which ends the step at once), and recovery keeps no
        # link with one (resilient.links.ledger, recovery.agree).
        blocked = _Blocked()
        entered = []
        for ledger in self.ledgers:
            ledger.posted(blocked)
            if not ledger.begin_wait(blocked):
                break
            entered.append(ledger)
        claimed = False
        try:
            with engine.lock:
                # Pairs another step holds (another rail's, another group's) or that
                # are mid-stream are left to the Python path, which waits its turn.
                if len(entered) < len(self.ledgers) or not all(
                    quiet(p) and not p.claimed for p in self.pairs
                ):
                    return [None] * len(self.sends), [None] * len(self.recvs)
                engine.claim(self.pairs)
                claimed = True
            # Without the lock: the rails' steps move their bytes at once, and a
            # Python driver serves the other pairs meanwhile.
            code, news, states = _stepio.exchange(
                fds, self.sends, self.recvs, int(self.slice_s() * 1000), engine.stop_r
            )
            with engine.lock:
                claimed = False
                try:
                    self.news = self.news or bool(news)
                    STATS["steps"] += 1
                    if code == 0:
                        return None
                    STATS["stopped"] += 1
                    # Still claimed: no driver reads a stream before its state is back.
                    return hand_back(self, states)
                finally:
                    engine.release(self.pairs)
        finally:
            if claimed:  # the exchange raised
                with engine.lock:
                    engine.release(self.pairs)
            blocked.done = True
            for ledger in self.ledgers:
                ledger.end_wait(blocked, finished=True)


def hand_back(
    step: Step, states: Sequence[tuple[int, int, int, int, bytes]]
) -> tuple[list[Any], list[Any]]:
    """Give each pair its stream's state after a stopped C step (holds the lock)."""
    sent: list[Any] = [DONE] * len(step.sends)
    got: list[Any] = [DONE] * len(step.recvs)
    for f, (si, soff, ri, roff, head) in enumerate(states):
        pair = step.pairs[f]
        for i in _from(step.sends, f, si):
            sent[i] = None
        for i in _from(step.recvs, f, ri):
            got[i] = None
        if si >= 0 and soff:
            sent[si] = _half_sent(pair, step, si, soff)
        if ri >= 0 and roff > _HDR:
            got[ri] = _half_read(pair, step, ri, roff, head)
        elif ri >= 0 and roff:
            # The header so far (the whole one, when it was another frame) goes back
            # into the pair's buffer, and is delivered as if the pair had read it
            # (stashed, parked or dropped; a part of one waits for the rest).
            pair._buf[: len(head)] = head
            pair._start, pair._end = 0, len(head)
            pair._deliver()
    for i, w in enumerate(got):
        if w is DONE:
            got[i] = finished(step.pairs[step.recvs[i][0]], step.news)
    for pair in step.pairs:
        if pair.error is not None:  # failed while the step ran: so are the works made here
            pair.fail_locked(pair.error)
    return sent, got


def _from(msgs: Sequence[tuple[int, ...]], f: int, first: int) -> Iterator[int]:
    """Indexes of pair ``f``'s messages from ``first`` on (none when first < 0)."""
    if first < 0:
        return
    for i in range(first, len(msgs)):
        if msgs[i][0] == f:
            yield i


def _half_sent(pair: SocketPair, step: Step, i: int, off: int) -> SocketWork:
    _, tag, digest, _, n = step.sends[i][:5]
    view, at = step.send_at[i]
    payload = view[at : at + n]
    header = memoryview(HEADER.pack(tag, n, digest))
    bufs = [header[off:], payload] if off < _HDR else [payload[off - _HDR :]]
    work = SocketWork(pair, payload, sending=True)
    # First: its bytes are the stream's next, before anything queued during the step.
    pair._outq.appendleft((bufs, work))
    return work


def _half_read(pair: SocketPair, step: Step, i: int, off: int, head: bytes) -> SocketWork:
    _, tag, expected, _, n = step.recvs[i][:5]
    view, at = step.recv_at[i]
    into = view[at : at + n]
    digest = HEADER.unpack(head)[2]
    work = SocketWork(pair, into, sending=False, digest=expected)
    work.news = digest & NEWS != 0
    pair._body = (tag, into, off - _HDR, work, digest)
    return work


class Moved(SocketWork):
    """A receive a C step completed (and folded, when it was to fold)."""

    __slots__ = ()


def finished(pair: SocketPair, news: bool) -> Moved:
    """A receive the C step completed, as a finished work (its news: the step's)."""
    work = Moved(pair, memoryview(b""), sending=False)
    work.done, work.news = True, news
    return work
