"""Signals as exceptions, held while kernel state is being removed.

A process that builds kernel state (a testbed's namespaces, a qdisc on ``lo``) must
reach its ``finally`` blocks on SIGTERM and SIGHUP too, not only on SIGINT: Python's
default for those two ends the process at once and leaves everything behind.
:class:`SignalGuard` turns SIGINT into KeyboardInterrupt and SIGTERM/SIGHUP into
SystemExit(128 + signum) in the main thread; inside :func:`shielded` (the removal
code of :class:`~chaos.testbed.NetnsTestbed` uses it) a signal is held until the
block ends, so that the cleanup itself is never cut short.
"""

from __future__ import annotations

import contextlib
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

__all__ = ["SIGNALS", "SignalGuard", "interrupt_for", "shielded"]

SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)

# The installed guard, so that library code can shield its cleanup without being
# handed the guard; None when no guard is installed (then a shield does nothing).
_active: SignalGuard | None = None


def interrupt_for(signum: int) -> BaseException:
    """What a signal raises: KeyboardInterrupt for SIGINT, else SystemExit(128 + signum)."""
    if signum == signal.SIGINT:
        return KeyboardInterrupt()
    return SystemExit(128 + signum)


class SignalGuard:
    """Turns SIGINT/SIGTERM/SIGHUP into exceptions; holds them during cleanup.

    ``install`` does nothing outside the main thread (Python lets no other thread set
    handlers), so a caller run from a worker thread keeps the handlers it has.
    """

    def __init__(self) -> None:
        self.received: int | None = None  # the first signal seen, for the report
        self._shield_depth = 0
        self._held: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> SignalGuard:
        global _active
        if threading.current_thread() is not threading.main_thread():
            return self
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handler)
        _active = self
        return self

    def uninstall(self) -> None:
        global _active
        for sig, old in self._previous.items():
            signal.signal(sig, old)
        self._previous.clear()
        if _active is self:
            _active = None

    def _handler(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum
        if self._shield_depth:
            self._held = self._held or signum
            return
        raise interrupt_for(signum)

    @contextlib.contextmanager
    def shielded(self) -> Iterator[None]:
        """Run the block to its end whatever signal comes; raise that signal after it."""
        self._shield_depth += 1
        try:
            yield
        finally:
            self._shield_depth -= 1
            held, self._held = self._held, None
            if held is not None and not self._shield_depth:
                raise interrupt_for(held)

    @property
    def reason(self) -> str | None:
        """``"interrupted by SIGTERM"`` and so on, or None if no signal came."""
        if self.received is None:
            return None
        return f"interrupted by {signal.Signals(self.received).name}"


@contextlib.contextmanager
def shielded() -> Iterator[None]:
    """The installed guard's :meth:`SignalGuard.shielded`; a no-op when none is installed.

    Also a no-op outside the main thread: handlers run in the main thread, and a held
    signal must be raised there, not in the thread that happened to clean up.
    """
    guard = _active
    if guard is None or threading.current_thread() is not threading.main_thread():
        yield
        return
    with guard.shielded():
        yield
