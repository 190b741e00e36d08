"""KeptLease's pacing against a client whose answers are slow (pure timing logic: a
fake client; the lease against a real etcd is tested in test_members and
test_node_fence)."""

from __future__ import annotations

import logging
import statistics
import threading
import time
from typing import Any, cast

import pytest

from membership.etcd_client import EtcdClient
from membership.kept_lease import KeptLease

pytestmark = pytest.mark.timeout(60)


class _SlowEtcd:
    """Answers every keep-alive ``latency_s`` after it was sent; records the sends."""

    def __init__(self, latency_s: float) -> None:
        self.latency_s = latency_s
        self.sent: list[float] = []
        self._lock = threading.Lock()

    def grant_lease(self, ttl: int) -> int:
        return 7

    def refresh_lease(self, lease_id: int, *, budget_s: float | None = None) -> int:
        with self._lock:
            self.sent.append(time.monotonic())
        time.sleep(self.latency_s)
        return 3

    def revoke_lease(self, lease_id: int, *, budget_s: float | None = None) -> None:
        pass


def _watched_for(etcd: _SlowEtcd, ttl_s: float, seconds: float) -> list[str]:
    """Keep a lease (no fence margin) against ``etcd`` for up to ``seconds``, or
    until it fences; the fences' reasons."""
    lease = KeptLease(cast(EtcdClient, cast(Any, etcd)), ttl_s, lambda: "rank 0", margin_s=0.0)
    fenced: list[str] = []
    lease.grant()
    lease.watch(fenced.append)
    try:
        began = time.monotonic()
        while not fenced and time.monotonic() - began < seconds:
            time.sleep(0.05)
    finally:
        lease.close()
    return fenced


def test_a_slow_answer_does_not_delay_the_next_refresh_past_the_fence(
    caplog: pytest.LogCaptureFixture,
) -> None:
    # TTL 3 s, a refresh due every 1 s, each answered 1.25 s after it was sent.
    # Paced from each answer, the refreshes went out 2.25 s apart, and the fence
    # (no margin) fired 3 s after the last acknowledged one was sent, with every
    # refresh answered; paced from each send, they go out 1.25 s apart.
    caplog.set_level(logging.WARNING, logger="membership.kept_lease")
    etcd = _SlowEtcd(latency_s=1.25)
    fenced = _watched_for(etcd, 3.0, 8.0)
    gaps = [b - a for a, b in zip(etcd.sent, etcd.sent[1:], strict=False)]
    assert len(gaps) >= 3, etcd.sent
    assert statistics.median(gaps) < 1.75, f"refreshes went out {gaps} s apart"
    assert not fenced, fenced
    # Every answer was slow; one warning says so (then at most one per 30 s).
    slow = [r.getMessage() for r in caplog.records if "answered after" in r.getMessage()]
    assert len(slow) == 1 and "rank 0: its node lease keep-alive" in slow[0], slow


def test_a_fence_says_whether_a_keep_alive_was_awaited_or_never_sent() -> None:
    # An etcd that never answers in time: the fence's reason says a keep-alive is
    # out and unanswered (a slow or lost etcd), not that none went out (a
    # keep-alive thread that did not run).
    fenced = _watched_for(_SlowEtcd(latency_s=3.0), 2.0, 10.0)
    assert len(fenced) == 1, fenced
    assert "was not refreshed for 2." in fenced[0], fenced
    assert "a keep-alive sent " in fenced[0] and "s ago is unanswered" in fenced[0], fenced
