"""A health board whose etcd dies says so (rate-limited), reports it once, recovers.

Before, its watcher swallowed every store error at DEBUG and retried forever: an
etcd outage left the board blind with nothing in the log or the event log.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from membership import EmbeddedEtcd
from membership.store import EtcdStore
from resilient import failures
from resilient.config import EtcdConfig
from resilient.detect.health_board import HealthBoard
from resilient.failures import FailureConfig
from resilient.procs import wait_until

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def own_etcd() -> Iterator[EmbeddedEtcd]:
    """A private server this test may kill and restart."""
    with EmbeddedEtcd(fsync=False) as server:
        yield server


class Events:
    def __init__(self) -> None:
        self.seen: list[tuple[str, dict[str, Any]]] = []
        self.lock = threading.Lock()

    def __call__(self, kind: str, **fields: Any) -> None:
        with self.lock:
            self.seen.append((kind, fields))

    def of(self, kind: str, site: str) -> list[dict[str, Any]]:
        with self.lock:
            return [f for k, f in self.seen if k == kind and f.get("site") == site]


def test_a_board_whose_etcd_dies_warns_reports_once_and_recovers(
    own_etcd: EmbeddedEtcd, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    events = Events()
    monkeypatch.setattr("resilient.events.emit", events)
    monkeypatch.setattr(failures, "DEFAULT_CONFIG", FailureConfig(warn_every_s=60.0, event_after=2))
    caplog.set_level(logging.INFO, "resilient.detect.health_board")
    # Short etcd bounds: each look at a dead etcd fails within a second.
    config = EtcdConfig(endpoints=own_etcd.endpoints, request_timeout_s=0.5, retry_budget_s=1.0)
    store = EtcdStore(config, "/resilient/board-failures/store/")
    board = HealthBoard(rank=1, world=2, store=store, epoch=4).start()
    site = "health board watch"
    try:
        own_etcd.kill(0)
        # The watcher looks at least every safety_s (1 s) and every look now fails.
        assert wait_until(lambda: bool(events.of("monitor.failing", site)), timeout_s=30), (
            events.seen
        )
        [failing] = events.of("monitor.failing", site)
        assert failing["failures"] == 2 and failing["epoch"] == 4
        assert failing["action"] == "retrying every 0.2 s"
        warned = [
            r.getMessage()
            for r in caplog.records
            if r.levelno == logging.WARNING and site in r.getMessage()
        ]
        # Rate-limited: one warning for the whole outage so far, with rank and count.
        assert len(warned) == 1, warned
        assert warned[0].startswith("rank 1: health board watch failed (1 in a row, 1 in all")

        own_etcd.restart(0)
        assert wait_until(lambda: bool(events.of("monitor.recovered", site)), timeout_s=30)
        recovered = [r.getMessage() for r in caplog.records if "recovered after" in r.getMessage()]
        assert any(m.startswith("rank 1: health board watch recovered after") for m in recovered)
        assert len(events.of("monitor.failing", site)) == 1  # one event for the whole streak
        # And the board works again: a published record reaches the store.
        assert not store.check(["health/e4/r1"])
        board.nic_changed(0, False)
        assert store.check(["health/e4/r1"]) and board._publish_failures.total == 0
    finally:
        board.stop()
        store.close()
