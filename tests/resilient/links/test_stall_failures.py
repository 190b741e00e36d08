"""The stall watchdog and the link repair thread say when they keep failing.

Before, a failing ``network_stall`` check was a DEBUG line per tick, an exception
in a tick ended the process's only watchdog thread, and a failing repair round
logged a traceback every 50 ms, forever.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import pytest

from resilient.links.repair import LinkRepair
from resilient.links.stall import StallWatch
from resilient.procs import wait_until

pytestmark = pytest.mark.timeout(30)


def _kinds(emitted: list[tuple[str, dict[str, Any]]], site: str) -> list[str]:
    return [k for k, f in list(emitted) if f.get("site") == site]


class _BadConn:
    """A link whose kernel check fails until ``broken`` is cleared."""

    def __init__(self) -> None:
        self.broken = True
        self.asked = 0

    def network_stall(self, min_ms: int = 1000) -> str | None:
        self.asked += 1
        if self.broken:
            raise OSError(9, "Bad file descriptor")
        return None

    def __repr__(self) -> str:
        return "<conn 0-2 rail 0>"


def test_failing_stall_checks_are_counted_warned_and_reported_once(
    emitted: list[tuple[str, dict[str, Any]]], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "resilient.links.stall")
    w = StallWatch()
    conn, good = _BadConn(), _BadConn()
    good.broken = False  # its checks succeed in every tick: the streak is per tick
    token = w.begin((0, 2, 0), conn, 0.0, report=False)
    other = w.begin((0, 3, 0), good, 0.0, report=False)
    try:
        site = w.check_failures.site
        assert wait_until(lambda: "monitor.failing" in _kinds(emitted, site), timeout_s=10)
        assert w.check_failures.consecutive >= 5
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 1 and "<conn 0-2 rail 0>: OSError" in warned[0]
        conn.broken = False
        assert wait_until(lambda: "monitor.recovered" in _kinds(emitted, site), timeout_s=10)
        assert _kinds(emitted, site) == ["monitor.failing", "monitor.recovered"]
        assert any("recovered after" in r.getMessage() for r in caplog.records)
        assert good.asked
    finally:
        w.end(token)
        w.end(other)


def test_a_tick_that_raises_does_not_end_the_watchdog(
    emitted: list[tuple[str, dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> None:
    w = StallWatch()
    failing = threading.Event()
    failing.set()

    def cut_dead(overdue: list[Any]) -> set[int]:
        if failing.is_set():
            raise RuntimeError("a bug in a tick")
        return set()

    monkeypatch.setattr(w, "_cut_dead", cut_dead)
    token = w.begin((0, 1, 0), "link-a", 0.0)
    try:
        assert wait_until(lambda: w.tick_failures.consecutive >= 3, timeout_s=10)
        failing.clear()
        assert wait_until(lambda: w.tick_failures.consecutive == 0, timeout_s=10)
        assert w._thread is not None and w._thread.is_alive()
        assert w.tick_failures.total >= 3
    finally:
        w.end(token)


class _FailingTable:
    """A table whose broken links cannot be listed (its store is gone, say)."""

    name, closed, abandoned = "link", False, None

    def __init__(self) -> None:
        self.failing = True
        self.calls = 0

    def broken(self) -> list[Any]:
        self.calls += 1
        if self.failing:
            raise RuntimeError("store gone")
        return []


def test_a_failing_repair_round_backs_off_and_recovers(
    emitted: list[tuple[str, dict[str, Any]]], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, "resilient.links.repair")
    repair = LinkRepair(rank=2, board=None, epoch=3, interval_s=0.01, max_backoff_s=0.16)
    table = _FailingTable()
    repair.attach(table)  # type: ignore[arg-type]
    repair.start()
    try:
        time.sleep(1.0)
        # Every 10 ms without the backoff (~100 rounds); with it, 0.01, 0.02, ...
        # up to 0.16 s between rounds (~12).
        assert 5 <= table.calls <= 25, table.calls
        assert repair._round_failures.consecutive == table.calls
        site = "link repair round"
        assert _kinds(emitted, site) == ["monitor.failing"]
        [(_, failing)] = [e for e in emitted if e[1].get("site") == site]
        assert failing["epoch"] == 3 and failing["failures"] == 5
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 1 and warned[0].startswith("rank 2: link repair round failed")
        table.failing = False
        assert wait_until(lambda: "monitor.recovered" in _kinds(emitted, site), timeout_s=5)
        calls = table.calls
        time.sleep(0.2)
        assert table.calls - calls >= 5  # back to every interval_s
    finally:
        repair.stop()
