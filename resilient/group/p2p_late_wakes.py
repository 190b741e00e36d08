"""Waking a point-to-point channel's pump late, only for ops nobody drives.

Almost every p2p op is waited for by the thread that issued it (``dist.send`` and
``dist.recv`` wait at once; ``isend``/``irecv`` and ``batch_isend_irecv`` hand back
works the caller waits for), and that wait moves the channel's ops itself
(:meth:`~resilient.group.p2p_channel.Channel.wait_for`). Waking the channel's pump
for each op as well cost a pipe write, a thread wake-up and a fight for the GIL per
op: a third of a small ping-pong's round trip on this machine.

So a channel whose pump sleeps does not wake it when an op is issued: it *defers*
the wake-up here. The pump is woken anyway, by whichever comes first:

* the op's issuing thread waits for it: no wake-up is needed, the waiter drives;
* a thread about to block in another channel's wait (:meth:`LateWakes.flush`),
  so ops on one channel never wait for a wait on another (a rank that ``isend``\\ s
  to one peer and then waits on a ``recv`` from another);
* someone asks the op's work whether it completed, or takes its future;
* ``grace_s`` passed with nobody driving the channel (the ticker thread here): an
  op issued and never waited for still completes, ``grace_s`` later.
"""

from __future__ import annotations

import threading
import time
from typing import Final, Protocol

__all__ = ["Kickable", "LateWakes"]

_PARK_S: Final = 30.0  # the ticker's sleep while nothing is deferred (it is set when something is)
_JOIN_S: Final = 1.0


class Kickable(Protocol):
    def kick(self) -> bool:
        """Wake the pump if ops wait that nobody drives; whether it did."""


class LateWakes:
    """The deferred pump wake-ups of one group's channels (see the module docstring)."""

    def __init__(self, grace_s: float = 0.002, max_s: float = 0.016) -> None:
        if not 0 < grace_s <= max_s:
            raise ValueError(f"need 0 < grace_s <= max_s, got {grace_s} and {max_s}")
        self._grace_s, self._max_s = grace_s, max_s
        self._period_s = grace_s
        self._lock = threading.Lock()
        self._due: dict[Kickable, float] = {}  # channel -> when its first wake was deferred
        self._ticking = False
        self._closed = False
        self._event = threading.Event()
        self._thread: threading.Thread | None = None

    def defer(self, chan: Kickable) -> None:
        """``chan`` left its pump asleep with an op pending: kick it in ``grace_s``
        unless a waiter drives it first (its kick then finds nothing to do)."""
        with self._lock:
            if self._closed:
                start = False
            else:
                self._due.setdefault(chan, time.monotonic())
                start, self._ticking = not self._ticking, True
                if start and self._thread is None:
                    self._thread = threading.Thread(
                        target=self._run, name="resilient-p2p-late-wakes", daemon=True
                    )
                    self._thread.start()
        if start:
            self._event.set()
        if self._closed:
            chan.kick()

    def flush(self, but: Kickable) -> None:
        """Kick every deferred channel other than ``but`` now (a thread is about to
        block driving ``but``)."""
        if len(self._due) <= 1 and (not self._due or but in self._due):
            return  # the common case, read without the lock: one channel in use
        with self._lock:
            due = [c for c in self._due if c is not but]
            for chan in due:
                del self._due[chan]
        for chan in due:
            chan.kick()

    def _run(self) -> None:
        while True:
            with self._lock:
                if self._closed:
                    return
                if not self._due:
                    self._ticking = False
                    self._event.clear()
                ticking = self._ticking
            if not ticking:
                self._event.wait(_PARK_S)
                continue
            time.sleep(self._period_s)
            limit = time.monotonic() - self._grace_s
            with self._lock:
                due = [c for c, since in self._due.items() if since <= limit]
                for chan in due:
                    del self._due[chan]
            woke = [chan.kick() for chan in due]
            # Ticks that find every deferred op driven by its waiter (a ping-pong)
            # back off: each tick is a thread wake-up and a fight for the GIL, which
            # cost a 4 KiB ping-pong 15 % at a steady 2 ms here.
            self._period_s = self._grace_s if any(woke) else min(2 * self._period_s, self._max_s)

    def close(self) -> None:
        """Kick whatever is deferred and end the ticker."""
        with self._lock:
            self._closed = True
            due, self._due = list(self._due), {}
        self._event.set()
        for chan in due:
            chan.kick()
        if self._thread is not None:
            self._thread.join(_JOIN_S)
