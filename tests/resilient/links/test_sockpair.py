"""Socket pairs moved by whichever thread waits (resilient.links.socket_pair): real TCP
sockets on loopback, rendezvoused through a real TCPStore. Each simulated rank has
an Engine of its own, as a process would; its ranks' threads run in this process."""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from resilient.links import gloo_sockets
from resilient.links.socket_connect import PairError, connect_pair
from resilient.links.socket_engine import Engine
from resilient.links.socket_frames import CALL_SHIFT, DigestMismatch
from resilient.links.socket_frames import HEADER as _HEADER
from resilient.links.socket_pair import SocketPair
from resilient.procs import free_port

pytestmark = pytest.mark.timeout(60)

BIG = 8 << 20  # bytes: far more than loopback's socket buffers take at once
WAIT = timedelta(seconds=20)


def _sockets_between(addr0: str, addr1: str, name: str) -> tuple[socket.socket, socket.socket]:
    port = free_port()
    server = dist.TCPStore(
        "127.0.0.1", port, 2, True, timeout=timedelta(seconds=10), wait_for_workers=False
    )
    client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=10))
    out: dict[int, socket.socket] = {}

    def end(i: int, store: Any, addr: str) -> None:
        out[i] = connect_pair(dist.PrefixStore(name, store), i, addr, 10.0, token=b"t")

    threads = [
        threading.Thread(target=end, args=(0, server, addr0)),
        threading.Thread(target=end, args=(1, client, addr1)),
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return out[0], out[1]


@pytest.fixture
def new_engine() -> Iterator[Callable[[], Engine]]:
    """Engines for the test's simulated ranks, their wake-up pipes closed after it."""
    made: list[Engine] = []

    def make() -> Engine:
        made.append(Engine())
        return made[-1]

    yield make
    for engine in made:
        engine.close()


@contextlib.contextmanager
def _ring(
    n: int, new_engine: Callable[[], Engine]
) -> Iterator[tuple[list[SocketPair], list[SocketPair]]]:
    """``n`` ranks in a ring, one engine each: (to the right, from the left) per rank."""
    engines = [new_engine() for _ in range(n)]
    right: list[SocketPair] = []
    left: list[SocketPair | None] = [None] * n
    try:
        for r in range(n):
            a, b = _sockets_between(f"127.0.2.{r + 1}", f"127.0.2.{(r + 1) % n + 1}", f"r{r}/")
            right.append(SocketPair(a, engines[r]))
            left[(r + 1) % n] = SocketPair(b, engines[(r + 1) % n])
        yield right, [p for p in left if p is not None]
    finally:
        for pair in right + [p for p in left if p is not None]:
            pair.shutdown()


@contextlib.contextmanager
def _pair(
    new_engine: Callable[[], Engine], addr0: str, addr1: str, name: str
) -> Iterator[tuple[SocketPair, SocketPair]]:
    """The two ends of one pair, an engine each (two simulated ranks), shut down after."""
    a_s, b_s = _sockets_between(addr0, addr1, name)
    a, b = SocketPair(a_s, new_engine()), SocketPair(b_s, new_engine())
    try:
        yield a, b
    finally:
        a.shutdown()
        b.shutdown()


@contextlib.contextmanager
def _two_pairs(
    new_engine: Callable[[], Engine], addr0: str, addr1: str, name: str
) -> Iterator[tuple[SocketPair, SocketPair, SocketPair, SocketPair]]:
    """Two pairs X and Y between two simulated ranks, an engine each: (x0, y0, x1,
    y1), ends 0 on rank 0's engine; shut down after."""
    e0, e1 = new_engine(), new_engine()
    x0s, x1s = _sockets_between(addr0, addr1, f"{name}x/")
    y0s, y1s = _sockets_between(addr0, addr1, f"{name}y/")
    pairs = (SocketPair(x0s, e0), SocketPair(y0s, e0), SocketPair(x1s, e1), SocketPair(y1s, e1))
    try:
        yield pairs
    finally:
        for pair in pairs:
            pair.shutdown()


def test_a_ring_of_messages_larger_than_the_socket_buffers_completes(
    new_engine: Callable[[], Engine],
) -> None:
    # Every rank sends to its right and waits for its left neighbour first: with
    # each pair moved only by its own waits, every send would stay queued.
    n = 3
    payloads = [torch.arange(BIG // 4, dtype=torch.int32) * (r + 1) for r in range(n)]
    got = [torch.zeros(BIG // 4, dtype=torch.int32) for _ in range(n)]
    errors: list[BaseException] = []
    with _ring(n, new_engine) as (right, left):

        def rank(r: int) -> None:
            try:
                sent = right[r].send([payloads[r]], 0, 7)
                recv = left[r].recv([got[r]], 0, 7)
                recv.wait(WAIT)
                sent.wait(WAIT)
            except BaseException as exc:  # handed to the test's thread
                errors.append(exc)

        threads = [threading.Thread(target=rank, args=(r,)) for r in range(n)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(40)
    assert not errors, errors
    for r in range(n):
        assert torch.equal(got[r], payloads[(r - 1) % n])


def test_a_send_queued_while_another_thread_drives_still_goes_out(
    new_engine: Callable[[], Engine],
) -> None:
    # Rank 0's thread T1 drives its engine, waiting for rank 1's answer on pair X;
    # T2 then queues a large send on pair Y, which rank 1 must receive before it
    # answers. The driver has to notice Y's queued bytes (the wake-up pipe).
    big = torch.randn(2 * BIG)  # 64 MiB: more than both sockets' buffers hold together
    into = torch.zeros_like(big)
    answer = torch.zeros(1)
    with _two_pairs(new_engine, "127.0.3.1", "127.0.3.2", "q") as (x0, y0, x1, y1):

        def rank1() -> None:
            y1.recv([into], 0, 1).wait(WAIT)
            x1.send([torch.ones(1)], 0, 2).wait(WAIT)

        peer = threading.Thread(target=rank1)
        peer.start()
        waiting = x0.recv([answer], 0, 2)
        driver = threading.Thread(target=waiting.wait, args=(WAIT,))
        driver.start()
        time.sleep(0.2)  # T1 sits in its poll now
        sent = y0.send([big], 0, 1)
        driver.join(30)
        sent.wait(WAIT)
        peer.join(30)
        assert waiting.is_completed() and waiting.error is None
        assert answer.item() == 1.0 and torch.equal(into, big)


def test_threads_waiting_on_one_engine_get_their_ops_handed_over(
    new_engine: Callable[[], Engine],
) -> None:
    e0, e1 = new_engine(), new_engine()
    pairs = [_sockets_between("127.0.4.1", "127.0.4.2", f"h{i}/") for i in range(2)]
    mine = [SocketPair(a, e0) for a, _ in pairs]
    theirs = [SocketPair(b, e1) for _, b in pairs]
    outs = [torch.zeros(1 << 16) for _ in range(2)]
    try:
        works = [mine[i].recv([outs[i]], 0, 3) for i in range(2)]
        waiters = [threading.Thread(target=w.wait, args=(WAIT,)) for w in works]
        for t in waiters:
            t.start()
        time.sleep(0.1)
        for i in (1, 0):  # the second waiter's message first
            theirs[i].send([torch.full((1 << 16,), float(i + 1))], 0, 3).wait(WAIT)
            time.sleep(0.05)
        for t in waiters:
            t.join(30)
        assert all(w.is_completed() and w.error is None for w in works)
        assert [o[0].item() for o in outs] == [1.0, 2.0] and outs[1].eq(2.0).all()
    finally:
        for pair in mine + theirs:
            pair.shutdown()


def test_a_large_message_sent_before_its_receive_is_kept_whole(
    new_engine: Callable[[], Engine],
) -> None:
    with _pair(new_engine, "127.0.5.1", "127.0.5.2", "s/") as (a, b):
        first, second = torch.randn(1 << 20), torch.randn(1 << 20)
        sends = [a.send([first], 0, 4), a.send([second], 0, 4), a.send([torch.ones(1)], 0, 5)]
        sender = threading.Thread(target=lambda: [w.wait(WAIT) for w in sends])
        sender.start()  # rank a's thread, moving a's bytes
        # A receive on another tag makes b read (and keep) both large messages first.
        b.recv([torch.zeros(1)], 0, 5).wait(WAIT)
        sender.join(30)
        assert all(w.is_completed() and w.error is None for w in sends)
        outs = [torch.zeros(1 << 20), torch.zeros(1 << 20)]
        for out in outs:
            b.recv([out], 0, 4).wait(WAIT)
        assert torch.equal(outs[0], first) and torch.equal(outs[1], second)
        # A large message for a receive too small fails that receive; the pair goes on.
        late = [a.send([torch.zeros(1 << 16)], 0, 6), a.send([torch.tensor([1.0, 2.0, 3.0])], 0, 7)]
        sender = threading.Thread(target=lambda: [w.wait(WAIT) for w in late])
        sender.start()
        with pytest.raises(PairError, match="for a receive of"):
            b.recv([torch.zeros(8)], 0, 6).wait(WAIT)
        after = torch.zeros(3)
        b.recv([after], 0, 7).wait(WAIT)
        sender.join(30)
        assert after.tolist() == [1.0, 2.0, 3.0]


def test_forgotten_receives_never_write_into_their_buffers(
    new_engine: Callable[[], Engine],
) -> None:
    # What a link kept into a new epoch does with a given-up call's receives
    # (resilient.links.ledger): one half read into its buffer, one not started, one
    # message stashed. Afterwards the buffers are the caller's again.
    with _pair(new_engine, "127.0.5.3", "127.0.5.4", "f/") as (a, b):
        half, unread = torch.zeros(4 * BIG // 4), torch.zeros(4)
        first = b.recv([half], 0, 5)
        second = b.recv([unread], 0, 6)
        # Nobody moves a's bytes yet: what the sockets' buffers took is all b can read.
        sends = [a.send([torch.ones(4 * BIG // 4)], 0, 5), a.send([torch.ones(4)], 0, 6)]
        sends += [a.send([torch.ones(4)], 0, 7), a.send([torch.full((3,), 9.0)], 0, 8)]
        deadline = time.monotonic() + 20
        while not half.any() and time.monotonic() < deadline:
            with b.engine.lock:  # what a driver does: read what the socket holds now
                b.read_some()
            time.sleep(0.01)
        assert half.any() and not half.all(), "the large message should be half read"
        assert b.forget(lambda tag: tag in (5, 6, 7), "given up") == 2
        sender = threading.Thread(target=lambda: [w.wait(WAIT) for w in sends])
        sender.start()
        half.fill_(42.0)
        unread.fill_(42.0)
        after = torch.zeros(3)
        b.recv([after], 0, 8).wait(WAIT)  # moves the rest of the forgotten messages
        sender.join(30)
        assert after.tolist() == [9.0, 9.0, 9.0]
        assert bool((half == 42.0).all()) and bool((unread == 42.0).all())
        assert first.error == "given up" and second.error == "given up"
        with pytest.raises(PairError):  # nothing of tag 7 was kept for a late receive
            b.recv([torch.zeros(4)], 0, 7).wait(timedelta(seconds=0.5))


def test_cutting_a_pair_mid_message_ends_the_wait_at_once(new_engine: Callable[[], Engine]) -> None:
    # The case gloo cannot interrupt (resilient.links.gloo_wait): the receive's message has
    # begun to arrive when its connection is cut.
    raw, b_s = _sockets_between("127.0.6.1", "127.0.6.2", "c/")
    b = SocketPair(b_s, new_engine())
    try:
        work = b.recv([torch.zeros(1 << 20)], 0, 8)
        raw.sendall(_HEADER.pack(8, 4 << 20, 0) + bytes(1 << 16))  # a quarter of it
        conn = gloo_sockets.Conn.of(b_s)
        threading.Timer(0.3, gloo_sockets.cut, args=([conn],)).start()
        start = time.monotonic()
        with pytest.raises(PairError):
            work.wait(timedelta(seconds=15))
        assert time.monotonic() - start < 3.0
    finally:
        raw.close()
        b.shutdown()


def test_failing_a_pair_from_another_thread_wakes_its_driver_at_once(
    new_engine: Callable[[], Engine],
) -> None:
    # How a link marked broken ends the waits on it before it publishes the break.
    with _pair(new_engine, "127.0.7.1", "127.0.7.2", "f/") as (_, b):
        work = b.recv([torch.zeros(4)], 0, 1)
        threading.Timer(0.2, b.fail, args=("the link broke",)).start()
        start = time.monotonic()
        with pytest.raises(PairError, match="the link broke"):
            work.wait(timedelta(seconds=15))
        assert time.monotonic() - start < 3.0
        assert b.send([torch.zeros(1)], 0, 2).error == "the link broke"  # stays failed


def test_closing_an_engine_closes_its_wake_up_pipe() -> None:
    engine = Engine()
    fds = (engine._wake_r, engine._wake_w)
    engine.close()
    for fd in fds:
        with pytest.raises(OSError):
            os.fstat(fd)
    engine.close()  # twice is harmless


def test_messages_that_came_before_the_peer_closed_are_still_delivered(
    new_engine: Callable[[], Engine],
) -> None:
    # A rank that sends a state and exits closes its end behind the bytes; the
    # receiver may read the close before it posts the receives (test_transfer.py
    # lost 7 of 20 runs that way).
    a_s, b_s = _sockets_between("127.0.8.1", "127.0.8.2", "e/")
    a, b = SocketPair(a_s, new_engine()), SocketPair(b_s, new_engine())
    try:
        sent = [torch.randn(1 << 18), torch.randn(16)]  # a body read in place, a small one
        for i, t in enumerate(sent):
            a.send([t], 0, 10 + i).wait(WAIT)
        a.shutdown()
        with pytest.raises(PairError, match="closed by peer"):
            b.recv([torch.zeros(1)], 0, 99).wait(WAIT)  # reads both, then the close
        outs = [torch.zeros_like(t) for t in sent]
        for i, out in enumerate(outs):
            b.recv([out], 0, 10 + i).wait(WAIT)
        assert all(torch.equal(o, t) for o, t in zip(outs, sent, strict=True))
        with pytest.raises(PairError, match="closed by peer"):
            b.recv([torch.zeros(16)], 0, 11).wait(WAIT)  # nothing left for it
    finally:
        b.shutdown()


def _cpu_s() -> float:
    return time.process_time()


def test_a_large_message_nobody_asked_for_yet_waits_in_the_socket(
    new_engine: Callable[[], Engine],
) -> None:
    # A peer one call ahead: its next call's data comes while this rank's engine is
    # driven by a wait on another pair. The body is left in the socket (parked), not
    # read into a buffer of its own, and lands in its receive once that is posted.
    ahead = torch.randn(1 << 18)  # 1 MiB, fits the socket buffers
    with _two_pairs(new_engine, "127.0.9.1", "127.0.9.2", "p") as (x0, y0, x1, y1):
        x0.send([ahead], 0, 3).wait(WAIT)
        other = y1.recv([torch.zeros(1)], 0, 1)
        driver = threading.Thread(target=other.wait, args=(WAIT,))
        driver.start()  # rank 1 drives its engine, waiting on pair Y
        deadline = time.monotonic() + 10
        while not x1.parked and time.monotonic() < deadline:
            time.sleep(0.01)
        assert x1.parked, "the message should wait in the socket"
        cpu = _cpu_s()
        time.sleep(0.3)  # the driver must not spin on the parked socket
        assert _cpu_s() - cpu < 0.15
        assert not x1._stash and x1._body is None
        out = torch.zeros_like(ahead)
        x1.recv([out], 0, 3).wait(WAIT)
        assert torch.equal(out, ahead) and not x1.parked
        y0.send([torch.ones(1)], 0, 1).wait(WAIT)
        driver.join(30)
        assert other.is_completed() and other.error is None


def test_a_receive_of_another_tag_goes_on_past_a_parked_message(
    new_engine: Callable[[], Engine],
) -> None:
    # What is waited for may come behind a message nobody asked for yet: any
    # receive posted on the pair unparks it (read aside, as before parking).
    with _pair(new_engine, "127.0.9.3", "127.0.9.4", "pk/") as (a, b):
        big = torch.randn(1 << 18)
        sends = [a.send([big], 0, 4), a.send([torch.full((2,), 5.0)], 0, 5)]
        for w in sends:
            w.wait(WAIT)
        deadline = time.monotonic() + 10
        while not b.parked and time.monotonic() < deadline:
            with b.engine.lock:  # what a driver does when the socket is readable
                b.read_some()
            time.sleep(0.01)
        assert b.parked
        small = torch.zeros(2)
        b.recv([small], 0, 5).wait(WAIT)
        assert small.tolist() == [5.0, 5.0] and not b.parked
        out = torch.zeros_like(big)
        b.recv([out], 0, 4).wait(WAIT)
        assert torch.equal(out, big)


def test_cutting_a_parked_pair_fails_it_without_spinning(
    new_engine: Callable[[], Engine],
) -> None:
    with _two_pairs(new_engine, "127.0.9.5", "127.0.9.6", "c") as (x0, y0, x1, y1):
        x0.send([torch.randn(1 << 18)], 0, 3).wait(WAIT)
        other = y1.recv([torch.zeros(1)], 0, 1)
        driver = threading.Thread(target=other.wait, args=(WAIT,))
        driver.start()
        deadline = time.monotonic() + 10
        while not x1.parked and time.monotonic() < deadline:
            time.sleep(0.01)
        assert x1.parked
        sock = x1._sock
        conn = gloo_sockets.Conn.of(sock)
        gloo_sockets.cut([conn])
        deadline = time.monotonic() + 5
        while x1.error is None and time.monotonic() < deadline:
            time.sleep(0.01)
        assert x1.error is not None, "the cut should fail the parked pair"
        cpu = _cpu_s()
        time.sleep(0.3)
        assert _cpu_s() - cpu < 0.15
        y0.send([torch.ones(1)], 0, 1).wait(WAIT)
        driver.join(30)
        assert other.error is None


def test_a_receive_refuses_a_message_of_another_call_and_the_pair_carries_on(
    new_engine: Callable[[], Engine],
) -> None:
    # Calls checked by digest (collectives.digest_check): a message whose digest is not the
    # receive's fails that receive, whether it came through the shared buffer, as a
    # large body read straight in, or from the stash; nothing lands in its buffer
    # and the pair is not failed. Forgetting the call drops what is left of it.
    call, other = 5, 6
    tag = call << CALL_SHIFT
    with _pair(new_engine, "127.0.2.1", "127.0.2.2", "digest/") as (a, b):
        small, big, early = torch.zeros(16), torch.zeros(64 << 10), torch.zeros(16)
        refused = [b.recv([small], 0, tag, 7), b.recv([big], 0, tag + 1, 7)]
        a.send([torch.ones(16)], 1, tag, 9).wait(WAIT)
        a.send([torch.ones(64 << 10)], 1, tag + 1, 9).wait(WAIT)
        a.send([torch.ones(16)], 1, tag + 2, 9).wait(WAIT)
        refused.append(b.recv([early], 0, tag + 2, 7))
        for work in refused:
            with pytest.raises(DigestMismatch):
                work.wait(WAIT)
        assert not small.any() and not big.any() and not early.any()
        assert b.error is None and a.error is None
        pending = b.recv([torch.zeros(16)], 0, tag + 3, 9)
        assert b.forget_call(call, "refused") == 1
        assert not pending.done and pending.error == "refused"
        a.send([torch.ones(16)], 1, tag + 4, 9).wait(WAIT)  # late: discarded
        got = torch.zeros(16)
        nxt = b.recv([got], 0, other << CALL_SHIFT, 11)
        a.send([torch.full((16,), 2.0)], 1, other << CALL_SHIFT, 11).wait(WAIT)
        nxt.wait(WAIT)
        assert torch.equal(got, torch.full((16,), 2.0))
        assert not b._stash and b.error is None
