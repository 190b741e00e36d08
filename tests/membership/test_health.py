"""HealthPublisher: an etcd outage is counted and warned about at a bounded rate."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest

from membership.health import HealthPublisher
from resilient.errors import EtcdUnavailable
from resilient.procs import wait_until

pytestmark = pytest.mark.timeout(30)


class _Client:
    """Stands in for EtcdClient.put: fails while ``down`` is set."""

    def __init__(self) -> None:
        self.down = threading.Event()
        self.down.set()
        self.written: list[str] = []

    def put(self, key: str, value: str, *, lease: int | None = None) -> None:
        if self.down.is_set():
            raise EtcdUnavailable(f"etcd put {key}: no answer")
        self.written.append(key)


def test_failed_writes_warn_once_report_once_and_recover(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    seen: list[tuple[str, dict[str, Any]]] = []
    monkeypatch.setattr("resilient.events.emit", lambda kind, **f: seen.append((kind, f)))
    caplog.set_level(logging.INFO, "membership.health")
    client = _Client()
    pub = HealthPublisher(
        client,  # type: ignore[arg-type]
        lease=lambda: None,
        stamp=lambda: {"rank": 0},
        min_interval_s=0.01,
    )
    pub.start()
    try:
        for i in range(6):  # six keys, each written once and failing
            pub.publish(f"/h/{i}", {"ok": True})
        assert wait_until(lambda: pub.failures.total == 6, timeout_s=10)
        warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(warned) == 1 and "health record write failed (1 in a row" in warned[0]
        assert "'/h/0': EtcdUnavailable" in warned[0]
        assert [k for k, _ in seen] == ["monitor.failing"]
        client.down.clear()
        pub.publish("/h/0", {"ok": True})
        assert wait_until(lambda: client.written == ["/h/0"], timeout_s=10)
        assert wait_until(lambda: [k for k, _ in seen][-1] == "monitor.recovered", timeout_s=5)
        assert pub.writes == 1 and pub.failures.consecutive == 0
    finally:
        pub.stop()
