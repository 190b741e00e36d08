"""Waits on gloo work that cutting the link can interrupt.

Cutting a link's connection (see :mod:`resilient.links.gloo_sockets`) fails the ops gloo
still has queued on the pair, but not a receive whose message was already
arriving: gloo moves that receive out of its pending list when the message's
header is read, and closing the pair does not signal it, so its ``wait`` sleeps
until its own timeout (measured on the netns testbed: a 256 MiB receive, its
connection cut 0.4 s in, returned only at its 4 s timeout; the same with the NIC
down). And gloo offers no way to wake a wait early: its work has no future, no
abort, and ``is_completed`` stays false until ``wait`` is called.

The same holds for a send that did not fit in the socket buffer (gloo queues
the rest, and closing the pair signals only ops on bound buffers). So a large
op is waited for in a helper thread, while the caller waits on an
event that either the helper or :meth:`Waiters.interrupt` sets. An interrupted
caller moves on (its channel fails over); the helper stays blocked until gloo's
timeout and then exits, on a link that is dead by then anyway. One helper thread
per (link, calling thread): a shared one would make independent schedules wait
behind each other's messages.
"""

from __future__ import annotations

import contextlib
import queue
import threading
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Final

__all__ = ["MIN_BYTES", "Pending", "Waiters"]

# Smaller messages take one or two segments: one caught half-way is rare, and
# a thread hand-off would cost more than the message.
MIN_BYTES: Final = 64 * 1024


@dataclass(slots=True)
class Pending:
    """One wait: ``done`` is set when it completed, failed or was interrupted."""

    work: Any
    timeout_s: float
    done: threading.Event = field(default_factory=threading.Event)
    error: BaseException | None = None
    interrupted: bool = False


class _Helper:
    def __init__(self, name: str) -> None:
        self.jobs: queue.SimpleQueue[Pending | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._run, name=name, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while True:
            job = self.jobs.get()
            if job is None:
                return
            try:
                job.work.wait(timedelta(seconds=job.timeout_s))
            except Exception as exc:  # handed to the caller, which raises it typed
                job.error = exc
            finally:
                # No reference to gloo work may outlive its wait here: a thread idle
                # in get() would keep the last one alive until interpreter teardown,
                # after its group is gone (seen: "terminate called" at exit).
                job.work = None
            job.done.set()
            job = None


class Waiters:
    """The helper threads of one link and the waits they are running."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._helpers: dict[int, _Helper] = {}
        self._jobs: dict[int, Pending] = {}
        self._lock = threading.Lock()
        self._closed = False

    def wait(self, work: Any, timeout_s: float) -> Pending:
        """Wait for ``work`` (at most ``timeout_s`` plus a second); returns the job.

        The caller checks ``error`` (gloo's exception) and ``interrupted``.
        """
        job = Pending(work, timeout_s)
        me = threading.get_ident()
        with self._lock:
            if self._closed:
                job.interrupted = True
                return job
            helper = self._helpers.get(me)
            if helper is None:
                helper = self._helpers[me] = _Helper(f"wait-{self.name}")
            self._jobs[id(job)] = job
        helper.jobs.put(job)
        try:
            if not job.done.wait(timeout_s + 1.0):
                job.error = TimeoutError(f"no completion within {timeout_s:.1f} s")
        finally:
            with self._lock:
                self._jobs.pop(id(job), None)
        return job

    def interrupt(self) -> None:
        """Wake every caller waiting now; later calls return interrupted at once."""
        with self._lock:
            self._closed = True
            jobs = list(self._jobs.values())
        for job in jobs:
            job.interrupted = True
            job.done.set()

    def close(self) -> None:
        """Let idle helpers exit (a helper blocked in gloo exits after its wait)."""
        self.interrupt()
        with self._lock:
            helpers, self._helpers = list(self._helpers.values()), {}
        for helper in helpers:
            with contextlib.suppress(Exception):
                helper.jobs.put(None)
