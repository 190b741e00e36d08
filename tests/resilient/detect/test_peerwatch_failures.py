"""A peer watch whose scan keeps failing says so once per streak, and goes on."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest

from resilient.detect.peer_watch import PeerWatch
from resilient.links.table import LinkTable
from resilient.procs import wait_until

pytestmark = pytest.mark.timeout(30)


def test_a_failing_scan_is_warned_reported_once_and_recovers(
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
    emitted: list[tuple[str, dict[str, Any]]],
) -> None:
    seen = emitted
    caplog.set_level(logging.INFO, "resilient.detect.peer_watch")
    failing = threading.Event()
    failing.set()

    def tables() -> list[LinkTable]:
        if failing.is_set():
            raise RuntimeError("table closed under the scan")
        return []

    watch = PeerWatch(7, tables, busy=lambda: True, on_closed=lambda: None).start()
    try:
        assert wait_until(lambda: any(k == "monitor.failing" for k, _ in seen), timeout_s=10)
        warned = [r for r in caplog.records if r.levelno == logging.WARNING]
        # One warning (not a traceback every 50 ms), with the rank and the error.
        assert len(warned) == 1
        assert warned[0].getMessage().startswith("rank 7: peer watch failed (1 in a row")
        assert "RuntimeError: table closed under the scan" in warned[0].getMessage()
        assert warned[0].name == "resilient.detect.peer_watch"
        failing.clear()
        assert wait_until(lambda: any(k == "monitor.recovered" for k, _ in seen), timeout_s=10)
        assert [k for k, _ in seen] == ["monitor.failing", "monitor.recovered"]
        assert seen[0][1]["site"] == "peer watch" and seen[0][1]["failures"] == 5
    finally:
        watch.stop()
