"""The peer watch cuts a link whose connection the kernel sees dead although no op
waits on it: a send that completed locally while its bytes were lost to a partition
(real processes and gloo links; iptables drops rail 0 on loopback, as root)."""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

import pytest
import torch

from resilient.detect.peer_watch import PeerWatch
from resilient.errors import LinkError
from tests._dist import run_world
from tests._iptables import drop_rules, iptables

pytestmark = [
    pytest.mark.timeout(120),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (iptables)"),
    pytest.mark.skipif(shutil.which("iptables") is None, reason="iptables is not installed"),
]

RAIL0 = ("127.0.1.1", "127.0.1.2")  # rail 0 of ranks 0 and 1 (tests._dist's addresses)
NUMEL = 1024  # 4 KiB: the send completes once the bytes are in the socket
CUT_WITHIN_S = 6.0


def _scan_until_broken(watch: PeerWatch, link: Any, within_s: float) -> float | None:
    """Scan until ``link`` is broken; seconds it took, or None after ``within_s``."""
    start = time.monotonic()
    while time.monotonic() - start < within_s:
        watch.scan()
        if link.broken:
            return time.monotonic() - start
        time.sleep(0.05)
    return None


def _idle_dead_link(pg: Any, rank: int, world: int, tag: str) -> dict[str, Any]:
    store = pg.links.store
    link = pg.links.get(1 - rank, 0)
    watch = PeerWatch(rank, lambda: [pg.links], lambda: True, lambda: None)
    out: dict[str, Any] = {}
    if rank == 1:
        link.wait(link.irecv(torch.zeros(NUMEL), 7), NUMEL * 4)
        # Posted before the partition, so the sender's bytes go out at once.
        work = link.irecv(torch.zeros(NUMEL), 8)
        store.set("posted", "1")
        start = time.monotonic()
        try:
            link.wait(work, NUMEL * 4)
        except LinkError:
            out["failed_after_s"] = time.monotonic() - start
        store.wait(["done"])
        return out
    # A message that arrived: the idle link is healthy, scanning it changes nothing.
    link.wait(link.isend(torch.ones(NUMEL), 7), NUMEL * 4)
    out["healthy_cut_after_s"] = _scan_until_broken(watch, link, 1.5)
    store.wait(["posted"])
    try:
        iptables("-I", drop_rules(RAIL0, tag), check=True)
        # The send completes locally, its bytes never arrive, and no op of this
        # rank waits on the link: only the kernel's view shows the connection dead.
        link.wait(link.isend(torch.ones(NUMEL), 8), NUMEL * 4)
        out["dead_cut_after_s"] = _scan_until_broken(watch, link, CUT_WITHIN_S)
        out["reason"] = link.cut_reason
    finally:
        iptables("-D", drop_rules(RAIL0, tag))
        store.set("done", "1")
    return out


def test_an_idle_link_whose_bytes_were_lost_is_cut_and_the_waiting_peer_released() -> None:
    tag = f"rsl-test-{os.getpid()}"
    try:
        out = run_world(_idle_dead_link, 2, rails=2, args=(tag,))
    finally:
        iptables("-D", drop_rules(RAIL0, tag))  # whatever a failed run left behind
    sender, receiver = out
    assert sender["healthy_cut_after_s"] is None
    # Dead: unacknowledged data, a retransmission timeout, and no ACK for a second
    # (counted from the last ACK, which came for the healthy message).
    assert sender["dead_cut_after_s"] is not None, sender
    assert sender["reason"] is not None
    # The receiver, whose own socket shows nothing wrong, is told through the store
    # and its wait ends, long before the op's 20 s deadline.
    assert receiver.get("failed_after_s") is not None, receiver
    assert receiver["failed_after_s"] < CUT_WITHIN_S + 2.0
