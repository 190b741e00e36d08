"""What the kernel shows of a dead connection (``Progress.dead``): data lost in
transit, and data a firewall drops before it leaves (how a partition is made on the
sending host), but not a peer too busy to read (real loopback sockets; the drop
needs root and iptables)."""

from __future__ import annotations

import os
import shutil
import socket
import time
from collections.abc import Iterator

import pytest

from resilient.links import gloo_sockets
from resilient.links.gloo_sockets import Progress
from tests._iptables import iptables

pytestmark = pytest.mark.timeout(60)

A, B = "127.0.1.1", "127.0.1.2"
Pair = tuple[socket.socket, socket.socket]
WATCH_S = 3.0


def test_lost_in_transit_is_dead_once_no_ack_came_for_long_enough() -> None:
    lost = Progress(unacked=3, retransmits=2, since_ack_ms=1200)
    assert lost.dead(1000) is not None
    assert lost.dead(1500) is None
    assert Progress(unacked=3, retransmits=0, since_ack_ms=5000).dead(1000) is None


def test_data_that_cannot_leave_is_dead_only_while_the_peers_window_is_open() -> None:
    kept = Progress(unacked=0, retransmits=0, since_ack_ms=1200, notsent=4096, probes=2,
                    window=65536, mss=1448)  # fmt: skip
    assert kept.dead(1000) is not None
    # A peer that stopped reading: its window is shut, the probes are window probes.
    assert Progress(unacked=0, retransmits=0, since_ack_ms=1200, notsent=4096, probes=2,
                    window=0, mss=1448).dead(1000) is None  # fmt: skip
    # A kernel that does not report the window: no verdict on unsent data.
    assert Progress(unacked=0, retransmits=0, since_ack_ms=1200, notsent=4096, probes=2,
                    window=-1, mss=1448).dead(1000) is None  # fmt: skip
    # Something in flight: that is the retransmission case, not this one.
    assert Progress(unacked=1, retransmits=0, since_ack_ms=1200, notsent=4096, probes=2,
                    window=65536, mss=1448).dead(1000) is None  # fmt: skip


@pytest.fixture
def pair() -> Iterator[Pair]:
    """A connected TCP pair on loopback, from A to B."""
    srv = socket.socket()
    srv.bind((B, 0))
    srv.listen(1)
    a = socket.create_connection(srv.getsockname(), timeout=5, source_address=(A, 0))
    b, _ = srv.accept()
    srv.close()
    try:
        yield a, b
    finally:
        a.close()
        b.close()


def _conn(s: socket.socket) -> gloo_sockets.Conn:
    return gloo_sockets.Conn(s.fileno(), s.getsockname()[:2], s.getpeername()[:2])


def _verdicts(s: socket.socket, for_s: float) -> list[str | None]:
    out = []
    end = time.monotonic() + for_s
    while time.monotonic() < end:
        p = gloo_sockets.progress(_conn(s))
        assert p is not None
        out.append(p.dead(1000))
        time.sleep(0.1)
    return out


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (iptables)")
@pytest.mark.skipif(shutil.which("iptables") is None, reason="iptables is not installed")
def test_data_dropped_before_it_leaves_is_seen_dead(pair: Pair) -> None:
    a, b = pair
    a.sendall(b"x" * 4096)
    assert len(b.recv(8192)) > 0
    assert not any(_verdicts(a, 0.5))  # idle and healthy
    tag = ["-m", "comment", "--comment", f"rsl-test-{os.getpid()}", "-j", "DROP"]
    rules = [["OUTPUT", "-d", B, *tag], ["INPUT", "-s", B, *tag]]
    try:
        iptables("-I", rules, check=True)
        a.sendall(b"y" * 4096)
        seen = _verdicts(a, WATCH_S)
    finally:
        iptables("-D", rules)  # also what a failed insert left behind
    assert any(v is not None for v in seen), seen


def test_a_peer_that_stopped_reading_is_not_dead(pair: Pair) -> None:
    a, _ = pair
    a.setblocking(False)
    sent = 0
    with pytest.raises(BlockingIOError):  # the window shuts
        for _ in range(100_000):
            sent += a.send(b"z" * 65536)
    p = gloo_sockets.progress(_conn(a))
    assert p is not None and p.notsent > 0  # data waits, the peer reads nothing
    assert not any(_verdicts(a, WATCH_S))
    assert sent > 0
