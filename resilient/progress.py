"""Step progress of each rank, published to etcd for the chaos CLI and operators.

A training loop calls ``reporter.step(n, loss=...)`` after each step and
``reporter.finish(params_sha256=...)`` at the end. ``step`` never blocks: it stores
the latest record and a background thread writes it to
``/resilient/<job>/progress/<rank>`` at most every ``min_interval_s`` (only the
newest record is written, so a slow etcd costs freshness, never training time;
from the environment: ``RESILIENT_PROGRESS_INTERVAL_S``, 0.25 s by default).
Records are JSON: ``rank, incarnation, pid, step, ts`` plus the caller's fields;
the final one has ``"done": true``. Once the data plane is loaded in the process
(``resilient.links.native_steps`` imported), every record also carries the rank's
cumulative rail passes moved whole in C and by the Python path, ``c_passes`` and
``python_passes``, and ``c_built`` (the C module is built): the chaos report's
fast-path share (:func:`pass_counts`; torch is never imported for it). Every
record also carries ``commits``: ``[step, ts]`` of this process's newest steps
(at most 16, oldest first, the record's own step last), because only the newest
record is written and a reader would otherwise never learn when the steps
between two writes finished (the chaos report times a recovery to the first step
after a fault). Readers that predate it ignore the field. And ``fds`` and
``threads``: the process's open file descriptors and live threads, whose growth
over a long run is a leak (the chaos soak checks it).

Without ``RESILIENT_ETCD`` (plain torchrun on gloo) :meth:`StepReporter.from_env`
returns a reporter that does nothing, so scripts need no branches.
"""

from __future__ import annotations

import json
import logging
import os
import sys
import threading
import time
from collections import deque
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Final

from resilient.config import RankEnv
from resilient.errors import ConfigError, MembershipError

if TYPE_CHECKING:
    from membership.etcd_client import EtcdClient

__all__ = ["StepReporter", "pass_counts", "progress_prefix"]

logger = logging.getLogger(__name__)

# Read from sys.modules, never imported here: it imports torch, and the CLI and
# the chaos runner use this module without torch.
_NATIVE_STEPS: Final = "resilient.links.native_steps"
# Steps whose commit times ride along in each record: enough to bridge a few
# records a reader missed (the chaos runner writes every 20 ms and polls every
# 50 ms), small enough that a record stays well under a kilobyte.
_COMMITS_KEPT: Final = 16


def pass_counts() -> dict[str, Any]:
    """This process's rail passes so far, moved whole in C and by the Python path
    (``resilient.links.native_steps.STATS``), and whether the C module is built;
    empty where the data plane was never loaded (gloo, or no collective module)."""
    module = sys.modules.get(_NATIVE_STEPS)
    stats = getattr(module, "STATS", None)
    available = getattr(module, "available", None)
    if not isinstance(stats, dict) or available is None:
        return {}  # not loaded, or still being imported by another thread
    return {
        "c_passes": int(stats.get("c_passes", 0)),
        "python_passes": int(stats.get("python_passes", 0)),
        "c_built": bool(available()),
    }


def resources() -> dict[str, int]:
    """This process's open file descriptors and live Python threads."""
    try:
        fds = len(os.listdir("/proc/self/fd"))
    except OSError:  # no procfs: not counted
        return {"threads": threading.active_count()}
    return {"fds": fds, "threads": threading.active_count()}


def progress_prefix(job: str) -> str:
    """The etcd prefix under which every rank of ``job`` publishes its progress."""
    from membership.keys import JobKeys

    return JobKeys(job).sub("progress")


class StepReporter:
    """Publishes one rank's latest step in the background; see the module docstring."""

    def __init__(
        self,
        client: EtcdClient | None,
        *,
        job: str,
        rank: int,
        incarnation: int = 0,
        min_interval_s: float = 0.25,
    ) -> None:
        self._client = client
        self._key = f"{progress_prefix(job)}{rank:06d}" if client is not None else ""
        self._stamp = {"rank": rank, "incarnation": incarnation, "pid": os.getpid()}
        self._interval = min_interval_s
        self._pending: dict[str, Any] | None = None
        self._last: dict[str, Any] = {"step": -1}
        self._commits: deque[tuple[int, float]] = deque(maxlen=_COMMITS_KEPT)
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None
        if client is not None:
            self._thread = threading.Thread(target=self._run, name="step-reporter", daemon=True)
            self._thread.start()

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> StepReporter:
        """A reporter for this rank from RANK/WORLD_SIZE/RESILIENT_* (no-op without etcd).

        Raises:
            ConfigError: the environment is malformed.
        """
        env = os.environ if env is None else env
        if not env.get("RESILIENT_ETCD") or "RANK" not in env:
            return cls(None, job="default", rank=0)
        renv = RankEnv.from_env(env)
        if renv.etcd is None:  # pragma: no cover - guarded above
            raise ConfigError("RESILIENT_ETCD is empty")
        from membership.etcd_client import EtcdClient
        from membership.guarded import job_client

        # With RESILIENT_TOKEN each write checks the job token (membership.guarded).
        client = job_client(EtcdClient(renv.etcd), renv.job, renv.token)
        return cls(
            client, job=renv.job, rank=renv.rank, incarnation=renv.incarnation,
            min_interval_s=renv.progress_interval_s,
        )  # fmt: skip

    @property
    def enabled(self) -> bool:
        return self._client is not None

    def step(self, step: int, **fields: Any) -> None:
        """Record that ``step`` finished; written in the background (never blocks)."""
        if self._client is None:
            return
        now = time.time()
        with self._lock:
            self._commits.append((step, now))
            self._last = {
                **self._stamp, **pass_counts(), **fields, "step": step, "ts": now,
                "commits": [[s, t] for s, t in self._commits],
            }  # fmt: skip
            self._pending = self._last
        self._wake.set()

    def finish(self, *, timeout_s: float = 5.0, **fields: Any) -> None:
        """Write the final record (``done: true`` plus ``fields``) and stop; bounded."""
        if self._client is None or self._closed.is_set():
            return
        with self._lock:
            self._pending = {
                **self._stamp, **self._last, **pass_counts(), **fields,
                "done": True, "ts": time.time(),
            }  # fmt: skip
        self.close(timeout_s)

    def close(self, timeout_s: float = 5.0) -> None:
        """Flush what is pending (bounded by ``timeout_s``) and stop the thread."""
        self._closed.set()
        self._wake.set()
        if self._thread is not None:
            self._thread.join(timeout_s)
        if self._client is not None:
            self._client.close()

    def _run(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                record, self._pending = self._pending, None
            if record is not None:
                self._write(record)
            if self._closed.is_set():
                with self._lock:
                    record, self._pending = self._pending, None
                if record is not None:
                    self._write(record)
                return
            # Rate limit: later steps overwrite _pending meanwhile.
            self._closed.wait(self._interval)

    def _write(self, record: dict[str, Any]) -> None:
        assert self._client is not None
        # Counted when a record is written (at most every min_interval_s), not at
        # every step: listing /proc/self/fd is a system call per descriptor batch.
        record = {**record, **resources()}
        try:
            self._client.put(self._key, json.dumps(record, sort_keys=True))
        except MembershipError as exc:
            # Progress is telemetry: an etcd outage must not stop training.
            logger.warning(
                "rank %s: step %s progress not written: %s",
                record.get("rank"),
                record.get("step"),
                exc,
            )
