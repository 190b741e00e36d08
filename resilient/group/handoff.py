"""Handing work to another thread without waking it while holding the GIL.

Every collective passes from the caller (DDP's autograd hooks, on the training
thread) to the control thread and on to the communication thread. With
``queue.Queue`` and ``Future`` each hand-off releases a waiting thread's lock
while the GIL is held: on a busy host the woken thread preempts the waker at once,
finds the GIL taken and sleeps again, and the waker, descheduled with the GIL in
hand, stalls everyone in its process until it runs again. Measured with py-spy
(4 ranks of a DDP job on 2 cores, GIL-holding samples): the training thread spent
0.39 ms per collective inside ``Queue.put``'s wake-up, 0.8 ms a step.

Here the wake-up is a byte written to a pipe: ``os.write`` releases the GIL
around the system call, so a woken thread that preempts the waker finds the GIL
free and gets on with its work. Waiting is ``os.read`` on the pipe (also without
the GIL). A byte per hand-off to a consumer that sleeps (or is about to); the
reader drains them in bulk, and a byte left over only costs a spurious wake-up.
"""

from __future__ import annotations

import collections
import contextlib
import os
import threading
import time
from typing import Generic, TypeVar

__all__ = ["Handoff", "WakePipe"]

T = TypeVar("T")

_CLOSED_NAP_S = 0.05


class WakePipe:
    """A wake-up over a pipe: :meth:`ring` from any thread, :meth:`wait` in one."""

    def __init__(self) -> None:
        self._r, self._w = os.pipe()
        # A full pipe already holds plenty of wake-ups: never block the ringer.
        os.set_blocking(self._w, False)
        self._closed = False
        self._lock = threading.Lock()

    def ring(self) -> None:
        # Under the lock: once closed, the descriptor numbers may belong to anything.
        with self._lock, contextlib.suppress(BlockingIOError):  # full: enough wake-ups queued
            if not self._closed:
                os.write(self._w, b"\0")

    def wait(self) -> None:
        """Sleep until rung (returns at once if a ring came since the last wait)."""
        if self._closed:
            time.sleep(_CLOSED_NAP_S)  # a consumer left behind at shutdown: do not spin
            return
        with contextlib.suppress(OSError):
            os.read(self._r, 4096)

    def close(self) -> None:
        """Close the pipe; a reader blocked in :meth:`wait` sees its end and returns."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            os.close(self._w)
        os.close(self._r)


class Handoff(Generic[T]):
    """A FIFO with one consumer; ``put`` wakes it through a :class:`WakePipe`."""

    def __init__(self) -> None:
        self._items: collections.deque[T] = collections.deque()
        self._wake = WakePipe()
        # Set by the consumer before it looks at an empty queue a last time and
        # sleeps: a producer rings only then. A busy consumer (DDP's second bucket
        # comes while the first one's data moves) takes the item without a system
        # call on either side.
        self._sleeping = False

    def put(self, item: T) -> None:
        self._items.append(item)
        # Read after the append: a consumer that set the flag after this read
        # looks at the queue after setting it, so it finds the item.
        if self._sleeping:
            self._wake.ring()

    def get(self) -> T:
        """The oldest item, waiting for one (the only consumer calls this)."""
        while True:
            try:
                return self._items.popleft()
            except IndexError:
                pass
            self._sleeping = True
            try:
                if not self._items:
                    self._wake.wait()
            finally:
                self._sleeping = False

    def close(self) -> None:
        """Release the pipe (after the consumer is gone)."""
        self._wake.close()
