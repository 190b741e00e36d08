"""Rate-limited health records in etcd (never written from the hot path).

Callers hand the latest record to :class:`HealthPublisher` (a dict update under a
lock, microseconds); a background thread writes each changed record at most once
per ``min_interval_s``, attached to the member's lease so a dead member's records
vanish with it. An etcd outage only delays records; it never blocks the caller.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Mapping
from typing import Any

from membership.etcd_client import EtcdClient
from resilient.errors import MembershipError
from resilient.failures import FailureSite

__all__ = ["HealthPublisher"]

logger = logging.getLogger(__name__)


class HealthPublisher:
    """Coalesces health records and flushes them to etcd in the background."""

    def __init__(
        self,
        client: EtcdClient,
        *,
        lease: Callable[[], int | None],
        stamp: Callable[[], Mapping[str, Any]],
        min_interval_s: float = 1.0,
    ) -> None:
        self._client = client
        self._lease = lease
        self._stamp = stamp
        self._interval = min_interval_s
        self._lock = threading.Lock()
        self._pending: dict[str, dict[str, Any]] = {}
        self._last_write: dict[str, float] = {}
        self._wake = threading.Event()
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self.writes = 0
        # One streak for all keys: an outage fails them all, and one warning per
        # key per interval was a line a second per key for as long as it lasted.
        self.failures = FailureSite(
            "health record write",
            action="dropped; the next record of that key is written",
            log=logger,
        )

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="health-publisher", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 3.0) -> None:
        self._stopped.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)

    def publish(self, key: str, record: Mapping[str, Any]) -> None:
        """Queue ``record`` for ``key``; only the latest record per key is written."""
        with self._lock:
            self._pending[key] = dict(record)
        self._wake.set()

    def _due(self, now: float) -> tuple[dict[str, dict[str, Any]], float]:
        """Pop records whose key may be written now; return them and the next wake time."""
        ready: dict[str, dict[str, Any]] = {}
        next_wake = self._interval
        with self._lock:
            for key in list(self._pending):
                wait = self._last_write.get(key, -1e9) + self._interval - now
                if wait <= 0:
                    ready[key] = self._pending.pop(key)
                else:
                    next_wake = min(next_wake, wait)
        return ready, next_wake

    def _run(self) -> None:
        while not self._stopped.is_set():
            ready, next_wake = self._due(time.monotonic())
            for key, record in ready.items():
                self._write(key, record)
            self._wake.wait(next_wake if not ready else 0.0)
            self._wake.clear()

    def _write(self, key: str, record: dict[str, Any]) -> None:
        body = {**self._stamp(), **record, "ts": time.time()}
        try:
            self._client.put(key, json.dumps(body, sort_keys=True), lease=self._lease())
            self.writes += 1
        except MembershipError as exc:
            self.failures.failed(exc, about=key)
        else:
            self.failures.succeeded()
        with self._lock:
            self._last_write[key] = time.monotonic()
