"""The recovery event log: what happened, where and how long, as JSON lines per writer.

Each writer (a rank, the launcher, the chaos runner) appends to its own file under
``RUN_DIR/events/`` (``rank-00003.jsonl``, ``launcher.jsonl``, ``chaos.jsonl``), so
no two processes share a file. One line is one event::

    {"schema_version": 1, "ts": 1764435012.123, "job": "job-1a2b3c4d", "epoch": 2,
     "rank": 1, "incarnation": 0, "kind": "link.down", "links": [[1, 2, 0]],
     "duration_ms": null, "reason": "...", "action": "...", "step": 41}

``links`` lists ``[rank, peer, rail]`` triples; ``rank`` is -1 for events not about
one rank (a fault on etcd, say). Extra fields may follow; readers ignore what they
do not know. docs/EVENTS.md describes every kind.

:meth:`EventLog.emit` never blocks: it queues the event for a writer thread, and
when the queue is full (the disk stalls) it drops the event and counts it in
``dropped``. Training never waits for the log.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import logging
import os
import queue
import sys
import threading
import time
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, Final, NoReturn

__all__ = [
    "EVENT_KINDS",
    "SCHEMA_VERSION",
    "EventLog",
    "default_log",
    "emit",
    "exit_now",
    "read_events",
    "set_members",
]

logger = logging.getLogger(__name__)

SCHEMA_VERSION: Final = 1
EVENT_KINDS: Final = frozenset(
    {
        "fault.injected",
        "fault.cleared",
        "link.down",
        "link.degraded",
        "link.rerouted",
        "link.repaired",
        "nic.down",
        "nic.up",
        "gpu.error",
        "gpu.degraded",
        "gpu.recovered",
        "gpu.health_unavailable",
        "rank.lost",
        "rank.evicted",
        "rank.fenced",
        "rank.joined",
        "node.lost",
        "node.fenced",
        "node.taken_over",
        "node.returned",
        "state.restored",
        "step.replayed",
        "straggler.suspected",
        "straggler.confirmed",
        "straggler.cleared",
        "recovery.started",
        "recovery.finished",
        "recovery.job_finished",
        "epoch.changed",
        "policy.decision",
        "monitor.failing",
        "monitor.recovered",
    }
)
_SUBDIR: Final = "events"
_MAX_QUEUE: Final = 10_000
_MAX_REASON: Final = 500


def events_dir(run_dir: str | os.PathLike[str]) -> Path:
    return Path(run_dir) / _SUBDIR


class EventLog:
    """Appends events of one writer to ``RUN_DIR/events/<name>.jsonl`` in a thread.

    ``name`` defaults to ``rank-<rank>``. Raises ``ValueError`` from :meth:`emit`
    for a kind not in :data:`EVENT_KINDS` (a programming error, caught in tests).
    Extra fields given to :meth:`emit` override the defaults (``ts=`` back-dates an
    event to when it happened).
    """

    def __init__(
        self,
        run_dir: str | os.PathLike[str],
        *,
        job: str,
        rank: int,
        incarnation: int = 0,
        name: str | None = None,
    ) -> None:
        self.path = events_dir(run_dir) / f"{name or f'rank-{rank:05d}'}.jsonl"
        self._stamp = {"job": job, "rank": rank, "incarnation": incarnation}
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(_MAX_QUEUE)
        self.dropped = 0
        self.written = 0
        self._thread = threading.Thread(target=self._run, name="event-log", daemon=True)
        self._thread.start()

    def emit(
        self,
        kind: str,
        *,
        epoch: int = 0,
        links: Iterable[Sequence[int]] = (),
        duration_ms: float | None = None,
        reason: str = "",
        action: str = "",
        step: int | None = None,
        rank: int | None = None,
        **extra: Any,
    ) -> None:
        """Queue one event (never blocks; see the module docstring)."""
        if kind not in EVENT_KINDS:
            raise ValueError(f"unknown event kind {kind!r}")
        event = {
            "schema_version": SCHEMA_VERSION,
            "ts": time.time(),
            **self._stamp,
            "epoch": epoch,
            "kind": kind,
            "links": [list(map(int, link)) for link in links],
            "duration_ms": None if duration_ms is None else round(float(duration_ms), 3),
            "reason": reason[:_MAX_REASON],
            "action": action,
            "step": step,
            **extra,
        }
        if rank is not None:
            event["rank"] = rank
        try:
            self._queue.put_nowait(event)
        except queue.Full:
            self.dropped += 1

    def close(self, timeout_s: float = 5.0) -> None:
        """Write what is queued (bounded by ``timeout_s``) and stop the writer."""
        with contextlib.suppress(queue.Full):
            self._queue.put(None, timeout=timeout_s)
        self._thread.join(timeout_s)

    def _run(self) -> None:
        try:
            self.path.parent.mkdir(parents=True, exist_ok=True)
            f = self.path.open("a", encoding="utf-8")
        except OSError as exc:
            logger.warning("event log %s cannot be opened (events dropped): %s", self.path, exc)
            f = None
        while True:
            event = self._queue.get()
            if event is None:
                break
            if f is None:
                self.dropped += 1
                continue
            try:
                f.write(json.dumps(event, default=str) + "\n")
                f.flush()
                self.written += 1
            except OSError as exc:
                self.dropped += 1
                logger.warning("event %s not written to %s: %s", event["kind"], self.path, exc)
        if f is not None:
            with contextlib.suppress(OSError):
                f.close()


def read_events(run_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every event under ``run_dir`` (all writers), ordered by time.

    Lines that are not JSON objects with a numeric ``ts`` (a torn last line after a
    crash, say) are skipped.
    """
    found: list[dict[str, Any]] = []
    base = events_dir(run_dir)
    for path in sorted(base.glob("*.jsonl")) if base.is_dir() else []:
        with contextlib.suppress(OSError), path.open(encoding="utf-8") as f:
            for line in f:
                with contextlib.suppress(ValueError):
                    ev = json.loads(line)
                    if isinstance(ev, dict) and isinstance(ev.get("ts"), int | float):
                        found.append(ev)
    return sorted(found, key=lambda e: float(e["ts"]))


_DEFAULT: EventLog | None = None
_DEFAULT_LOCK = threading.Lock()


def exit_now(code: int) -> NoReturn:
    """End the process at once with ``code``, as a crashed rank would, after this
    rank's event log (bounded: 2 s) and stdout/stderr are flushed: for a rank that
    must leave without running the script's clean-up (its collectives would hang)."""
    log = default_log()
    if log is not None:
        log.close(2.0)
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(Exception):
            stream.flush()
    os._exit(code)


def default_log() -> EventLog | None:
    """This rank's log (RESILIENT_RUN_DIR, RANK, ...), or None without a run dir.

    Created on first use and flushed at interpreter exit.
    """
    global _DEFAULT
    with _DEFAULT_LOCK:
        if _DEFAULT is None:
            from resilient.config import RankEnv
            from resilient.errors import ConfigError

            try:
                env = RankEnv.from_env()
            except ConfigError:
                return None
            if env.run_dir is None:
                return None
            _DEFAULT = EventLog(
                env.run_dir, job=env.job, rank=env.rank, incarnation=env.incarnation
            )
            atexit.register(_DEFAULT.close, 2.0)
        return _DEFAULT


# The real rank of each position while this process's group runs with fewer
# members than its world (after a shrink); None while every rank takes part.
_MEMBERS: tuple[int, ...] | None = None


def set_members(members: Sequence[int] | None) -> None:
    """Name ranks by ``members[position]`` in later events: a group that shrank
    numbers its members 0..M-1 internally, and SREs read job-wide rank ids."""
    global _MEMBERS
    _MEMBERS = None if members is None else tuple(members)


def _real(pos: int) -> int:
    members = _MEMBERS
    return members[pos] if members is not None and 0 <= pos < len(members) else pos


def emit(kind: str, **fields: Any) -> None:
    """Emit to this process's default log, if it has one (no-op otherwise).

    ``links`` and ``rank`` are positions in the group; after a shrink they are
    written as the job's rank ids (see :func:`set_members`).
    """
    log = default_log()
    if log is None:
        return
    if _MEMBERS is not None:
        if "links" in fields:
            fields["links"] = [(_real(a), _real(b), *rest) for a, b, *rest in fields["links"]]
        if fields.get("rank") is not None:
            fields["rank"] = _real(int(fields["rank"]))
    log.emit(kind, **fields)
