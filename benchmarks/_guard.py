"""Clean exits for the benchmarks that build a netns testbed (``failover.py``, ``degraded.py``).

Everything those scripts create in the kernel lives in the chaos testbed: network
namespaces named ``rsl-<id>-*`` (the tbf qdiscs of the ``throttle`` injector and the
NIC states of ``nic-down`` live inside them and go with them) and one root-namespace
veth ``rsl<id>m``; neither script adds iptables rules. The testbed writes an owner
file with its builder's pid, and :func:`chaos.testbed.sweep_leftovers` deletes the
``rsl-`` testbeds whose owner is gone. What this module adds:

* :class:`SignalGuard`: SIGINT raises KeyboardInterrupt, SIGTERM and SIGHUP raise
  SystemExit(128 + signum) in the main thread, so the scripts' ``finally`` blocks run
  (the ranks are reaped, the testbed is taken down); inside :meth:`SignalGuard.shielded`
  a signal is held until the block ends, so that cleanup itself is never cut short.
* :func:`sweep_own_leftovers`: at start, removes the testbeds of earlier runs whose
  process died (SIGKILL, a crash); live testbeds of other runs are left alone.
* :func:`netns_left`: which of a testbed's namespaces still exist (after cleanup: none).
"""

from __future__ import annotations

import contextlib
import signal
import subprocess
from collections.abc import Iterator, Sequence
from types import FrameType
from typing import Any

__all__ = ["SignalGuard", "interrupt_for", "netns_left", "sweep_own_leftovers"]

SIGNALS: tuple[signal.Signals, ...] = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)


def interrupt_for(signum: int) -> BaseException:
    """What a signal raises: KeyboardInterrupt for SIGINT, else SystemExit(128 + signum)."""
    if signum == signal.SIGINT:
        return KeyboardInterrupt()
    return SystemExit(128 + signum)


class SignalGuard:
    """Turns SIGINT/SIGTERM/SIGHUP into exceptions; holds them during cleanup."""

    def __init__(self) -> None:
        self.received: int | None = None  # the first signal seen, for the report
        self._shield_depth = 0
        self._held: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> SignalGuard:
        for sig in SIGNALS:
            self._previous[sig] = signal.signal(sig, self._handler)
        return self

    def uninstall(self) -> None:
        for sig, old in self._previous.items():
            signal.signal(sig, old)
        self._previous.clear()

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


def sweep_own_leftovers() -> int:
    """Delete ``rsl-*`` testbeds whose builder died (namespaces, their qdiscs, the root veth).

    Returns how many namespaces went. Testbeds whose builder still runs (another
    engineer's chaos run, say) are not touched: the owner file's pid decides.
    """
    from chaos.testbed import sweep_leftovers

    return sweep_leftovers()


def netns_left(names: Sequence[str]) -> list[str]:
    """Those of ``names`` that ``ip netns list`` still shows."""
    try:
        out = subprocess.run(
            ["ip", "netns", "list"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return list(names)  # cannot tell: say so
    present = {line.split()[0] for line in out.splitlines() if line.strip()}
    return [n for n in names if n in present]
