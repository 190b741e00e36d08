"""A link rendezvous whose connection attempt goes unanswered fails while its gloo
pair still exists, so the process survives the network healing afterwards.

Before: the attempt outlived the pair it was bound to, and the first SYN
retransmission after the heal ran gloo's callback on the freed pair (SIGSEGV,
reproduced with this test's setup). Real gloo, a real etcd store, a real peer
process; iptables drops the SYNs to the listening end (as root).
"""

from __future__ import annotations

import multiprocessing as mp
import os
import shutil
import socket
import time
from typing import Any

import psutil
import pytest

from membership.store import EtcdStore
from resilient.config import DataPlaneConfig
from resilient.errors import LinkError
from resilient.links import gloo_connects, link
from tests._iptables import iptables

pytestmark = pytest.mark.timeout(90)

PREFIX = "syn/"
PASSIVE, ACTIVE = "127.0.0.92", "127.0.0.93"  # the larger address connects (gloo)
BOUND_S = 1.0


def _record(ip: bytes, port: int, family: int = socket.AF_INET) -> bytes:
    """A rendezvous record shaped like gloo's: a header, the sockaddr, then more."""
    head = b"\x02\x00\x00\x00\x00\x00\x00\x00" + os.urandom(8)
    if family == socket.AF_INET:
        addr = family.to_bytes(2, "little") + port.to_bytes(2, "big") + ip + bytes(8)
    else:
        addr = family.to_bytes(2, "little") + port.to_bytes(2, "big") + bytes(4) + ip + bytes(4)
    return head + addr + bytes(40) + b"\xff" * 16


def test_the_peers_listener_is_read_where_the_own_address_sits() -> None:
    mine = _record(socket.inet_aton("10.100.0.2"), 40000)
    theirs = _record(socket.inet_aton("10.100.0.3"), 41234)
    assert gloo_connects.listener_of(mine, "10.100.0.2", theirs) == ("10.100.0.3", 41234)
    six_mine = _record(socket.inet_pton(socket.AF_INET6, "fd00::2"), 1, socket.AF_INET6)
    six_theirs = _record(socket.inet_pton(socket.AF_INET6, "fd00::3"), 2, socket.AF_INET6)
    assert gloo_connects.listener_of(six_mine, "fd00::2", six_theirs) == ("fd00::3", 2)


def test_an_unrecognised_record_gives_no_listener() -> None:
    mine = _record(socket.inet_aton("10.100.0.2"), 40000)
    theirs = _record(socket.inet_aton("10.100.0.3"), 41234)
    assert gloo_connects.listener_of(mine, "10.100.0.9", theirs) is None  # not found
    assert gloo_connects.listener_of(mine + mine, "10.100.0.2", theirs + theirs) is None  # twice
    assert gloo_connects.listener_of(mine, "10.100.0.2", theirs[:-1]) is None  # other layout
    assert gloo_connects.listener_of(mine, "eth0", theirs) is None  # not an address


def _syn_sent_to(ip: str) -> int:
    return sum(
        1
        for c in psutil.Process().net_connections(kind="inet")
        if c.status == psutil.CONN_SYN_SENT and c.raddr and c.raddr.ip == ip
    )


def _active(store: EtcdStore, out: Any, healed: Any) -> None:
    """The connecting end: its SYNs are dropped. Reports how its build ended, then
    lives on past the SYN retransmissions that land after the heal."""
    began = time.monotonic()
    try:
        link.Link(
            rank=1, peer=0, rail=0, address=ACTIVE, store=store, prefix=PREFIX,
            config=DataPlaneConfig(connect_timeout_s=BOUND_S),
        )  # fmt: skip
        out.put(("built", time.monotonic() - began, _syn_sent_to(PASSIVE)))
    except LinkError:
        out.put(("failed", time.monotonic() - began, _syn_sent_to(PASSIVE)))
    healed.wait(30)
    time.sleep(12)  # retransmissions 1, 3, 7, 15 s after the first SYN


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root (iptables)")
@pytest.mark.skipif(shutil.which("iptables") is None, reason="iptables is not installed")
def test_an_unanswered_connection_attempt_is_aborted_before_its_pair_is_freed(
    etcd_store: EtcdStore,
) -> None:
    rule = [
        ["INPUT", "-p", "tcp", "--syn", "-d", PASSIVE, "-m", "comment",
         "--comment", f"rsl-test-{os.getpid()}", "-j", "DROP"],
    ]  # fmt: skip
    ctx = mp.get_context("spawn")
    out, healed = ctx.Queue(), ctx.Event()
    active = ctx.Process(target=_active, args=(etcd_store, out, healed), daemon=True)
    iptables("-I", rule, check=True)
    try:
        active.start()
        with pytest.raises(LinkError):
            link.Link(
                rank=0, peer=1, rail=0, address=PASSIVE, store=etcd_store, prefix=PREFIX,
                config=DataPlaneConfig(connect_timeout_s=BOUND_S),
            )  # fmt: skip
        how, took, pending = out.get(timeout=30)
        iptables("-D", rule)
        healed.set()
        active.join(timeout=40)
        assert active.exitcode == 0, active.exitcode  # was -11 (SIGSEGV)
        assert how == "failed"
        assert pending == 0  # nothing left to connect once the network heals
        # Aborted past gloo's deadline, well before its 5x wait for the connection.
        assert took < 5 * BOUND_S - 1.0, took
    finally:
        iptables("-D", rule)
        if active.is_alive():
            active.kill()
            active.join(5)
