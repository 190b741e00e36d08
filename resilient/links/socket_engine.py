"""The engine that moves the bytes of socket pairs, and the ops it completes.

Nothing runs in the background. Every :class:`~resilient.links.socket_pair.SocketPair`
belongs to an :class:`Engine`, and the thread that waits for an op (a
:class:`SocketWork`) moves the bytes of *every* pair of its engine: it polls all of
their sockets, writes what each can take and reads what each holds, until its op is
done; other threads that wait meanwhile sleep until the driver hands their op over,
or until it leaves and one of them drives. One pair at a time would deadlock as soon
as messages outgrow the socket buffers: in a ring every rank waits for its left
neighbour while its own send to the right is still queued.

Why not a progress thread as gloo's: that hop (post, wake the loop, wake the waiter
again) is most of what a medium-sized collective costs on a loaded host.

An op past its deadline fails its pair (every op still pending on it), with a
:class:`~resilient.links.socket_connect.PairError` from ``wait``.
"""

from __future__ import annotations

import contextlib
import os
import select
import threading
import time
import weakref
from datetime import timedelta
from typing import Final, Protocol

from resilient.links.socket_connect import PairError, remaining
from resilient.links.socket_frames import DigestMismatch

__all__ = ["Engine", "Pair", "SocketWork", "engine"]

_FOREVER_S: Final = 3600.0
_IN: Final = select.POLLIN | select.POLLPRI
_GONE: Final = select.POLLHUP | select.POLLERR | select.POLLNVAL


class Pair(Protocol):
    """What an engine needs of a pair whose bytes it moves (a SocketPair). Every
    method runs under the engine's lock."""

    fileno: int
    error: str | None
    engine: Engine
    claimed: bool

    @property
    def parked(self) -> bool: ...

    @property
    def has_output(self) -> bool: ...

    def write_some(self) -> None: ...

    def read_some(self) -> None: ...

    def unpark(self) -> None: ...

    def fail_locked(self, why: str) -> None: ...


class SocketWork:
    """One send or receive on a :class:`~resilient.links.socket_pair.SocketPair` (the
    subset of gloo's Work used).

    ``digest``: a receive's expected call digest (0: any); a message with another
    nonzero digest fails it with :class:`DigestMismatch`. ``news``: the message
    that filled it carried the NEWS flag."""

    __slots__ = ("digest", "done", "error", "mismatch", "news", "pair", "sending", "view")

    def __init__(self, pair: Pair, view: memoryview, *, sending: bool, digest: int = 0) -> None:
        self.pair, self.view, self.sending = pair, view, sending
        self.digest = digest
        self.done = self.mismatch = self.news = False
        self.error: str | None = None

    def is_completed(self) -> bool:
        return self.done or self.error is not None

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the op completed, at most ``timeout`` (moving every pair's bytes
        of this engine meanwhile, or letting the thread that does hand it over).

        Raises:
            PairError: the pair failed, or the op did not complete in time (the pair
                is then failed).
            DigestMismatch: the message was of another call (the pair stays).
        """
        if not self.done:
            secs = timeout.total_seconds() if timeout is not None else _FOREVER_S
            self.pair.engine.wait(self, time.monotonic() + (secs if secs > 0 else _FOREVER_S))
        if self.error is not None:
            if self.mismatch:
                raise DigestMismatch(self.error)
            raise PairError(self.error)
        return True


class Engine:
    """The pairs whose bytes one driving thread moves together (see the module doc).

    Every socket operation runs under ``lock``; only the driver's ``poll`` runs
    without it. A thread that queues output while another drives rings the wake-up
    pipe, so the driver adds that socket to its poll.
    """

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._cond = threading.Condition(self.lock)
        self._pairs: dict[int, Pair] = {}
        self._driving = False
        self._sleepers = 0
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._rung = False
        # C steps (resilient.links.native_steps) run without the lock on the pairs they
        # claimed; a thread that needs such a pair (to fail or close it) writes here
        # first, which ends every running step at once. The byte stays until no
        # step runs: several steps (one per rail) may be watching it.
        self.stop_r, self._stop_w = os.pipe()
        self._claims = 0
        os.set_blocking(self.stop_r, False)
        os.set_blocking(self._stop_w, False)
        # The process's engines live as long as it does; a test's die with it.
        self._closer = weakref.finalize(
            self, _close_fds, self._wake_r, self._wake_w, self.stop_r, self._stop_w
        )

    def close(self) -> None:
        """Close the wake-up pipe; the engine's pairs must be shut down first."""
        self._closer()

    @property
    def driving(self) -> bool:
        return self._driving

    def add(self, pair: Pair) -> None:
        with self.lock:
            self._pairs[pair.fileno] = pair

    def discard(self, pair: Pair) -> None:
        """Forget ``pair`` (holds the lock)."""
        if self._pairs.get(pair.fileno) is pair:
            del self._pairs[pair.fileno]

    def ring(self) -> None:
        """Wake the driver out of its poll (holds the lock)."""
        if self._driving and not self._rung:
            self._rung = True
            with contextlib.suppress(BlockingIOError):
                os.write(self._wake_w, b"x")

    def stop_c_step(self) -> None:
        """End a C step that holds the lock (a byte left over ends the next one early,
        which only hands its bytes to the Python path)."""
        with contextlib.suppress(OSError):  # full (steps are being stopped) or closed
            os.write(self._stop_w, b"x")

    def claim(self, pairs: list[Pair]) -> None:
        """Take ``pairs`` for a C step: the driver leaves their sockets alone until
        :meth:`release` (holds the lock; the caller checked they are quiet)."""
        if self._claims == 0:
            self._drain_stop()  # a stop for steps that ended already
        self._claims += 1
        for pair in pairs:
            pair.claimed = True

    def release(self, pairs: list[Pair]) -> None:
        """Give ``pairs`` back after their C step (holds the lock)."""
        for pair in pairs:
            pair.claimed = False
        self._claims -= 1
        if self._claims == 0:
            self._drain_stop()
        self.ring()  # anything posted on them meanwhile waits for the driver's poll
        self._cond.notify_all()

    def until_released(self, pair: Pair) -> None:
        """Wait until no C step holds ``pair`` (holds the lock; the caller wrote
        the stop byte, so the step ends within one poll)."""
        while pair.claimed:
            self._sleepers += 1
            try:
                self._cond.wait(0.05)
            finally:
                self._sleepers -= 1
            if pair.claimed:
                self.stop_c_step()

    def _drain_stop(self) -> None:
        with contextlib.suppress(OSError):  # empty (BlockingIOError) or closed
            os.read(self.stop_r, 64)

    def handed_over(self) -> None:
        """Ops of sleeping threads may have completed (holds the lock)."""
        if self._sleepers:
            self._cond.notify_all()

    def wait(self, work: SocketWork, deadline: float) -> None:
        """Until ``work`` completed or failed; fails its pair at ``deadline``."""
        with self.lock:
            while not work.is_completed():
                if not self._driving:
                    self._driving = True
                    break
                self._sleepers += 1
                try:
                    woke = self._cond.wait(max(0.0, remaining(deadline)))
                finally:
                    self._sleepers -= 1
                if not woke and not work.is_completed():
                    work.pair.fail_locked(_late(work))
            else:
                return
        try:
            self._drive(work, deadline)
        finally:
            with self.lock:
                self._driving = False
                if self._sleepers:
                    self._cond.notify_all()

    def _drive(self, work: SocketWork, deadline: float) -> None:
        poller = select.poll()
        while True:
            with self.lock:
                if work.is_completed():
                    return
                left = remaining(deadline)
                if left <= 0:
                    work.pair.fail_locked(_late(work))
                    return
                watched = self._watch(poller)
            ready = poller.poll(max(1, int(left * 1000)))
            with self.lock:
                for fd, _ in watched:
                    poller.unregister(fd)
                self._serve(ready)

    def _watch(self, poller: select.poll) -> list[tuple[int, int]]:
        """Register every live pair's socket (and the wake-up pipe). Holds the lock."""
        watched = [(self._wake_r, select.POLLIN)]
        for fd, pair in self._pairs.items():
            if pair.error is None and not pair.claimed:
                # A parked pair's socket stays readable: polled for input it would
                # wake the driver at once, again and again. Hang-ups still show.
                events = 0 if pair.parked else _IN
                watched.append((fd, events | (select.POLLOUT if pair.has_output else 0)))
        for fd, events in watched:
            poller.register(fd, events)
        return watched

    def _serve(self, ready: list[tuple[int, int]]) -> None:
        """Read and write what the ready sockets allow. Holds the lock."""
        for fd, events in ready:
            if fd == self._wake_r:
                with contextlib.suppress(BlockingIOError):
                    os.read(self._wake_r, 64)
                self._rung = False
                continue
            pair = self._pairs.get(fd)
            if pair is None or pair.error is not None or pair.claimed:
                continue  # a C step took it since the poll began
            if events & select.POLLOUT:
                pair.write_some()
            if events & _GONE:
                pair.unpark()  # the failure behind the parked message must be seen
            if events & (_IN | _GONE):
                pair.read_some()
        self.handed_over()


def _close_fds(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


def _late(work: SocketWork) -> str:
    what = "send" if work.sending else "receive"
    return f"a {what} of {work.view.nbytes} B did not complete within its deadline"


_ENGINES: dict[str, Engine] = {}
_ENGINES_LOCK = threading.Lock()


def engine(name: str) -> Engine:
    """The process's engine called ``name`` (one per kind of link: data, control)."""
    with _ENGINES_LOCK:
        found = _ENGINES.get(name)
        if found is None:
            found = _ENGINES[name] = Engine()
        return found
