"""Follows the ranks' step progress records in etcd (see :mod:`resilient.progress`)."""

from __future__ import annotations

import json
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from membership.etcd_client import EtcdClient
from resilient.config import etcd_config
from resilient.errors import MembershipError
from resilient.progress import progress_prefix

logger = logging.getLogger(__name__)


# One record's cumulative rail pass counts: (ts, incarnation, pid, c_passes, python_passes).
PassSample = tuple[float, int, int, int, int]
# When one step finished: (ts, step, incarnation).
Commit = tuple[float, int, int]
# A record's resource counts: (ts, incarnation, step, open fds, threads).
Resources = tuple[float, int, int, int, int]


@dataclass(slots=True)
class RankTrack:
    """What one rank reported: samples ``(ts, step, incarnation)``, one per record
    read, its final record, the records' rail pass counts where they carry them
    (``passes``), and every step commit the records told of (``commits``, in time
    order: the records' ``commits`` lists, which also cover the records this watch
    never read; a record without that list contributes its own step and ``ts``)."""

    samples: list[tuple[float, int, int]] = field(default_factory=list)
    last: dict[str, Any] = field(default_factory=dict)
    passes: list[PassSample] = field(default_factory=list)
    commits: list[Commit] = field(default_factory=list)
    resources: list[Resources] = field(default_factory=list)

    @property
    def step(self) -> int:
        return int(self.last.get("step", -1))

    @property
    def done(self) -> bool:
        return bool(self.last.get("done"))


class ProgressWatch:
    """Polls ``/resilient/<job>/progress/`` every ``interval_s`` in a thread.

    Polling (not a watch) keeps it simple across an etcd member loss: each poll is
    one bounded read, and a failed poll is just a gap in the samples.
    """

    def __init__(self, endpoints: tuple[str, ...], job: str, *, interval_s: float = 0.05) -> None:
        self._client = EtcdClient(
            # TLS and auth from RESILIENT_ETCD_* (chaos.etcd_security)
            etcd_config(",".join(endpoints), request_timeout_s=1.0, retry_budget_s=1.0)
        )
        self._prefix = progress_prefix(job)
        self._interval = interval_s
        self._lock = threading.Lock()
        self.ranks: dict[int, RankTrack] = {}
        self.failed_polls = 0
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-progress", daemon=True)

    def start(self) -> ProgressWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop polling after one last read, so final records are not missed."""
        self._halt.set()
        self._thread.join(10.0)
        self.poll()
        self._client.close()

    def step_of(self, rank: int) -> int:
        with self._lock:
            track = self.ranks.get(rank)
            return track.step if track is not None else -1

    def max_step(self) -> int:
        with self._lock:
            return max((t.step for t in self.ranks.values()), default=-1)

    def pid_of(self, rank: int) -> int | None:
        with self._lock:
            track = self.ranks.get(rank)
            pid = track.last.get("pid") if track is not None else None
            return int(pid) if pid is not None else None

    def snapshot(self) -> dict[int, RankTrack]:
        with self._lock:
            return {
                r: RankTrack(
                    list(t.samples),
                    dict(t.last),
                    list(t.passes),
                    list(t.commits),
                    list(t.resources),
                )
                for r, t in self.ranks.items()
            }

    def poll(self) -> None:
        try:
            kvs, _ = self._client.get_prefix(self._prefix)
        except MembershipError as exc:
            self.failed_polls += 1
            logger.debug("progress poll failed: %s", exc)
            return
        with self._lock:
            for kv in kvs:
                self._record(kv.value)

    def _record(self, raw: bytes) -> None:
        try:
            rec = json.loads(raw)
            rank, step, inc = int(rec["rank"]), int(rec["step"]), int(rec["incarnation"])
            ts = float(rec["ts"])
        except (ValueError, KeyError, TypeError):
            logger.warning("ignoring malformed progress record %r", raw[:200])
            return
        track = self.ranks.setdefault(rank, RankTrack())
        if not track.samples or ts > track.samples[-1][0]:
            track.samples.append((ts, step, inc))
            counts = _pass_counts(rec)
            if counts is not None:
                track.passes.append((ts, inc, *counts))
            if isinstance(rec.get("fds"), int) and isinstance(rec.get("threads"), int):
                track.resources.append((ts, inc, step, rec["fds"], rec["threads"]))
            for commit in _commits(rec, ts, step, inc):
                # Consecutive records repeat commits: only the newer ones are new.
                if not track.commits or commit[0] > track.commits[-1][0]:
                    track.commits.append(commit)
        track.last = rec

    def _run(self) -> None:
        while not self._halt.is_set():
            start = time.monotonic()
            self.poll()
            self._halt.wait(max(0.0, self._interval - (time.monotonic() - start)))


def _pass_counts(rec: dict[str, Any]) -> tuple[int, int, int] | None:
    """A record's (pid, c_passes, python_passes), or None where it carries none."""
    try:
        return int(rec.get("pid", 0)), int(rec["c_passes"]), int(rec["python_passes"])
    except (KeyError, ValueError, TypeError):
        return None


def _commits(rec: dict[str, Any], ts: float, step: int, inc: int) -> list[Commit]:
    """The step commits a record tells of: its ``commits`` list (``[step, ts]``
    pairs), or where it has none (an older writer, or a malformed list) its own
    step at its ``ts``."""
    listed = rec.get("commits")
    if isinstance(listed, list):
        try:
            return [(float(t), int(s), inc) for s, t in listed]
        except (ValueError, TypeError):
            pass
    return [(ts, step, inc)]
