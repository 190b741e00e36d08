"""Socket control links: real TCP sockets on loopback, rendezvoused through a real
TCPStore; the two ends of each pair run in two threads of this process."""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from resilient.links import gloo_sockets
from resilient.links.socket_link import PairError, SocketPair, connect_pair
from resilient.procs import free_port
from tests._held import HeldStore

pytestmark = pytest.mark.timeout(60)

A, B = "127.0.1.1", "127.0.1.2"


def _store(prefix: str) -> tuple[Any, Any]:
    port = free_port()
    server = dist.TCPStore(
        "127.0.0.1", port, 2, True, timeout=timedelta(seconds=10), wait_for_workers=False
    )
    client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=10))
    return dist.PrefixStore(prefix, server), dist.PrefixStore(prefix, client)


def _both(fn0: Callable[[], Any], fn1: Callable[[], Any]) -> tuple[Any, Any]:
    with ThreadPoolExecutor(2) as pool:
        f0, f1 = pool.submit(fn0), pool.submit(fn1)
        return f0.result(timeout=30), f1.result(timeout=30)


def _pair(token: bytes = b"t") -> tuple[SocketPair, SocketPair]:
    s0, s1 = _store("p/")
    a, b = _both(
        lambda: connect_pair(s0, 0, A, 10.0, token=token),
        lambda: connect_pair(s1, 1, B, 10.0, token=token),
    )
    assert a.getsockname()[0] == A and b.getsockname()[0] == B  # bound to the rails
    return SocketPair(a), SocketPair(b)


@contextlib.contextmanager
def _opened_pair() -> Iterator[tuple[SocketPair, SocketPair]]:
    """A connected pair, both ends shut down afterwards (also when the test fails)."""
    a, b = _pair()
    try:
        yield a, b
    finally:
        a.shutdown()
        b.shutdown()


def test_messages_meet_their_receives_by_tag_in_any_order() -> None:
    with _opened_pair() as (a, b):
        for tag in (1, 2, 3):
            a.send([torch.full((4,), float(tag))], 0, tag)
        time.sleep(0.05)  # all three are in b's socket before anything is posted
        outs = {tag: torch.zeros(4) for tag in (3, 1, 2)}
        works = {tag: b.recv([out], 0, tag) for tag, out in outs.items()}
        for work in works.values():
            work.wait(timedelta(seconds=5))
        assert {tag: out[0].item() for tag, out in outs.items()} == {1: 1.0, 2: 2.0, 3: 3.0}
        # Posted first, sent later: the waiting reader delivers it.
        late = torch.zeros(2, dtype=torch.int64)
        work = b.recv([late], 0, 9)
        threading.Timer(0.1, a.send, args=([torch.tensor([7, 8])], 0, 9)).start()
        work.wait(timedelta(seconds=5))
        assert late.tolist() == [7, 8]


def test_a_pairs_send_counters_come_from_its_own_socket() -> None:
    # What the send-rate meter reads (SocketLink.sent): the same counters as a
    # reading through the descriptor number, and None once the pair is closed.
    a, b = _pair()
    try:
        out = torch.zeros(1 << 18)
        work = b.recv([out], 0, 3)
        a.send([torch.ones(1 << 18)], 0, 3).wait(timedelta(seconds=10))
        work.wait(timedelta(seconds=10))
        own = gloo_sockets.sent_of(a.tcp_info(gloo_sockets.SENT_INFO_BYTES))
        sock = a._sock  # the descriptor the other reading goes through
        conn = gloo_sockets.Conn.of(sock)
        via_fd = gloo_sockets.sent(conn)
        assert own is not None and via_fd is not None
        assert own[0] >= 4 << 18  # every byte of the message was acknowledged
        assert own[0] == via_fd[0] and own[3] <= via_fd[3]
    finally:
        a.shutdown()
        b.shutdown()
    assert a.tcp_info(gloo_sockets.SENT_INFO_BYTES) is None


def test_a_pairs_state_and_progress_come_from_its_own_socket() -> None:
    # What the peer watch reads of a socket link (SocketLink._states, _progresses).
    a, b = _pair()
    try:
        sock = a._sock
        conn = gloo_sockets.Conn.of(sock)
        assert (
            gloo_sockets.state_of(a.tcp_info(1)) == gloo_sockets.tcp_state(conn) == 1
        )  # ESTABLISHED
        own = gloo_sockets.progress_of(a.tcp_info(gloo_sockets.PROGRESS_INFO_BYTES))
        via_fd = gloo_sockets.progress(conn)
        assert own is not None and via_fd is not None and own.mss == via_fd.mss
        assert own.dead(0) is None
        b.shutdown()
        deadline = time.monotonic() + 5.0
        while gloo_sockets.state_of(a.tcp_info(1)) not in gloo_sockets.PEER_GONE_STATES:
            assert time.monotonic() < deadline, "the peer's close never showed"
            time.sleep(0.01)
        assert gloo_sockets.tcp_state(conn) in gloo_sockets.PEER_GONE_STATES
    finally:
        a.shutdown()
        b.shutdown()
    assert gloo_sockets.state_of(a.tcp_info(1)) is None
    assert gloo_sockets.progress_of(a.tcp_info(gloo_sockets.PROGRESS_INFO_BYTES)) is None


def test_a_message_larger_than_its_receive_fails_the_receive_not_the_process() -> None:
    with _opened_pair() as (a, b):
        a.send([torch.zeros(8)], 0, 5)
        work = b.recv([torch.zeros(2)], 0, 5)
        with pytest.raises(PairError, match="32 B for a receive of 8 B"):
            work.wait(timedelta(seconds=5))


def test_the_probe_sums_both_ends() -> None:
    with _opened_pair() as (a, b):
        ta, tb = torch.ones(1), torch.ones(1)
        wa, wb = a.allreduce([ta]), b.allreduce([tb])
        _both(lambda: wa.wait(timedelta(seconds=5)), lambda: wb.wait(timedelta(seconds=5)))
        assert ta.item() == tb.item() == 2.0


def test_a_peer_closing_fails_a_waiting_receive_as_closed_by_peer() -> None:
    a, b = _pair()
    work = b.recv([torch.zeros(1)], 0, 1)
    threading.Timer(0.2, a.shutdown).start()
    start = time.monotonic()
    with pytest.raises(PairError, match="closed by peer"):
        work.wait(timedelta(seconds=10))
    assert time.monotonic() - start < 5.0
    b.shutdown()


def test_a_receive_past_its_deadline_fails() -> None:
    with _opened_pair() as (_a, b):
        work = b.recv([torch.zeros(1)], 0, 1)
        start = time.monotonic()
        with pytest.raises(PairError, match="deadline"):
            work.wait(timedelta(seconds=0.3))
        assert 0.25 < time.monotonic() - start < 3.0


def test_cutting_the_connection_ends_a_blocked_wait_at_once() -> None:
    with _opened_pair() as (_a, b):
        sock = b._sock
        conn = gloo_sockets.Conn.of(sock)
        work = b.recv([torch.zeros(1)], 0, 1)
        threading.Timer(0.2, gloo_sockets.cut, args=([conn],)).start()
        start = time.monotonic()
        with pytest.raises(PairError):
            work.wait(timedelta(seconds=10))
        assert time.monotonic() - start < 5.0


def test_a_stray_connection_is_not_taken_for_the_peer() -> None:
    import socket

    s0, s1 = _store("stray/")

    def stray_then_peer() -> socket.socket:
        where = ""
        while not where:
            where = s1.get("sock/0").decode() if s1.check(["sock/0"]) else ""
            time.sleep(0.01)
        host, port = where.rsplit("|", 1)
        with socket.create_connection((host, int(port))) as stray:
            stray.sendall(b"RSL1" + (3).to_bytes(4, "little") + b"bad")
            time.sleep(0.1)
        return connect_pair(s1, 1, B, 10.0, token=b"good")

    a, b = _both(lambda: connect_pair(s0, 0, A, 10.0, token=b"good"), stray_then_peer)
    try:
        assert a.getpeername() == b.getsockname()
    finally:
        a.close()
        b.close()


def test_socket_links_are_kept_out_of_gloo_connection_scans() -> None:
    with _opened_pair() as (a, b):
        found, _ = gloo_sockets._established()
        assert a._sock.fileno() not in found and b._sock.fileno() not in found


def test_a_rendezvous_nobody_answers_gives_up_in_time() -> None:
    s0, _ = _store("alone/")
    start = time.monotonic()
    with pytest.raises(PairError, match="timed out"):
        connect_pair(s0, 0, A, 0.5)
    assert time.monotonic() - start < 3.0


def _tables(rails: int) -> list[Any]:
    from resilient.config import DataPlaneConfig
    from resilient.links.table import LinkTable

    s0, s1 = _store("mesh/")
    config = DataPlaneConfig(connect_timeout_s=10.0, op_timeout_floor_s=5.0)
    return [
        LinkTable(
            rank=r,
            rails=tuple(f"127.0.{k + 1}.{r + 1}" for k in range(rails)),
            store=s,
            config=config,
            name="ctl",
            transport="socket",
        )
        for r, s in ((0, s0), (1, s1))
    ]


def _exchange(meshes: list[Any], seq: int) -> list[torch.Tensor]:
    from resilient.collectives.signature import WIDTH

    tables = [torch.zeros((2, WIDTH), dtype=torch.int64) for _ in meshes]
    for r, t in enumerate(tables):
        t[r] = seq * 10 + r
    _both(*(lambda m=m, t=t: m.all_gather(t, seq, 0) for m, t in zip(meshes, tables, strict=True)))
    return tables


def test_a_control_row_whose_link_broke_comes_through_the_store() -> None:
    from resilient.check.control_mesh import ControlMesh
    from resilient.collectives.relay import RELAY_RAIL

    tables = _tables(rails=2)
    meshes = [ControlMesh(rank=r, world=2, links=t) for r, t in enumerate(tables)]
    try:
        for t in _exchange(meshes, 1):
            assert t[:, 0].tolist() == [10, 11]
        # Rank 0 cuts its end of rail 0 (as after a NIC down); rank 1 still thinks it
        # healthy and only sees the connection end while it waits.
        tables[0].get(1, 0).abort("test: NIC down")
        for t in _exchange(meshes, 2):
            assert t[:, 0].tolist() == [20, 21]
        relayed = [f for m in meshes for f in m.failovers]
        assert relayed and all(f[1] == 0 and f[2] == RELAY_RAIL for f in relayed), relayed
    finally:
        for t in tables:
            t.close()


def test_rows_published_from_two_threads_at_once_keep_the_newest_row() -> None:
    from resilient.check.control_mesh import ControlMesh

    tables = _tables(rails=2)
    meshes = [ControlMesh(rank=r, world=2, links=t) for r, t in enumerate(tables)]
    held = HeldStore(tables[0].store, "ctlrow/", hold_s=1.5)
    cutter = None
    try:
        _exchange(meshes, 1)
        tables[0].store = held
        # The link's break publishes rank 0's rows (exchange 1 only) from another
        # thread, which stalls before storing them; meanwhile exchange 2 starts and
        # publishes rows 1 and 2 itself. Stored last, the older set would hide row 2
        # from rank 1, which reads the store once the cut reaches it.
        link = tables[0].get(1, 0)
        cutter = threading.Thread(target=link.abort, args=("test: NIC down",), daemon=True)
        cutter.start()
        assert held.first_in.wait(10.0)
        for t in _exchange(meshes, 2):
            assert t[:, 0].tolist() == [20, 21]
    finally:
        if cutter is not None:
            cutter.join(10.0)
        for t in tables:
            t.close()


def test_with_one_rail_a_broken_control_link_fails_the_exchange() -> None:
    from resilient.check.control_mesh import ControlMesh
    from resilient.errors import LinkError

    tables = _tables(rails=1)
    meshes = [ControlMesh(rank=r, world=2, links=t) for r, t in enumerate(tables)]
    try:
        _exchange(meshes, 1)
        tables[0].get(1, 0).abort("test: NIC down")
        with pytest.raises(LinkError):
            _exchange(meshes, 2)
    finally:
        for t in tables:
            t.close()


def test_a_handoff_keeps_order_and_wakes_its_consumer() -> None:
    from resilient.group.handoff import Handoff

    box: Handoff[int | None] = Handoff()
    got: list[int] = []

    def consume() -> None:
        while (item := box.get()) is not None:
            got.append(item)

    thread = threading.Thread(target=consume)
    thread.start()
    for i in range(1000):
        box.put(i)
        if i % 100 == 0:
            time.sleep(0.01)  # let the consumer block in between
    box.put(None)
    thread.join(timeout=10)
    assert not thread.is_alive() and got == list(range(1000))
    box.close()
    box.put(1)  # after close: no write to a descriptor number that is not ours any more


def test_a_handoff_to_a_busy_consumer_rings_no_bell(monkeypatch: pytest.MonkeyPatch) -> None:
    from resilient.group import handoff
    from resilient.group.handoff import Handoff

    rings = []
    ring = handoff.WakePipe.ring
    monkeypatch.setattr(handoff.WakePipe, "ring", lambda self: (rings.append(1), ring(self)))
    box: Handoff[int | None] = Handoff()
    busy, got = threading.Event(), []

    def consume() -> None:
        while (item := box.get()) is not None:
            got.append(item)
            busy.wait(10)  # busy with the first item while the others are put

    thread = threading.Thread(target=consume, daemon=True)
    thread.start()
    try:
        time.sleep(0.05)  # asleep on an empty queue: the first put must wake it
        box.put(0)
        deadline = time.monotonic() + 5
        while not got and time.monotonic() < deadline:
            time.sleep(0.001)
        for i in range(1, 50):
            box.put(i)
    finally:  # the consumer ends even when a step above failed
        busy.set()
        box.put(None)
        thread.join(timeout=10)
    assert not thread.is_alive() and got == list(range(50))
    # One ring woke it for item 0; the rest found it busy (a last one may come
    # when it drained the queue and went to sleep just before None was put).
    assert 1 <= len(rings) <= 2
    box.close()


def test_a_message_followed_at_once_by_the_peers_close_is_still_delivered() -> None:
    # A job's final barrier: the peer sends its last row and closes right away.
    for _ in range(20):
        a, b = _pair()
        out = torch.zeros(4)
        work = b.recv([out], 0, 1)  # posted first: the waiting reader meets data + EOF
        a.send([torch.ones(4)], 0, 1)
        a.shutdown()
        time.sleep(0.01)  # both the message and the FIN are in b's socket now
        work.wait(timedelta(seconds=5))
        assert out.tolist() == [1.0] * 4
        b.shutdown()
