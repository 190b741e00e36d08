"""How much of the wall time this process could not run: stopped, throttled, starved.

A process that is SIGSTOPped, CPU-throttled by its cgroup or starved by a noisy
neighbour is slow at everything, compute and communication alike, so its peers'
clocks show little: they block in the same collectives it blocks in. From inside,
though, it shows plainly: a thread that asks to sleep for a short period wakes up
late by however long the process could not run. :class:`StolenTime` keeps that
lateness as a running total (straggler detection compares it across ranks).
"""

from __future__ import annotations

import threading
import time
from typing import Final

__all__ = ["StolenTime"]

PERIOD_S: Final = 0.01
# The meter sleeps with time.sleep, not Event.wait: a wake-up costs what the process
# can least spare on a busy host (CPU), and Event.wait's condition and lock
# hand-overs made it ~95 us of CPU against ~57 us (this machine, 2026-12-04), 100
# times a second per rank. close() waits out at most one period.
# Late wake-ups below this are ordinary timer slack and GIL hand-over, not stolen.
_SLACK_S: Final = 0.002


class StolenTime:
    """Running total, in microseconds, of time the process was not running."""

    def __init__(self, name: str) -> None:
        self.total_us = 0  # written by the meter thread only
        self._halted = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._halted = True
        self._thread.join(timeout=1.0)

    def _run(self) -> None:
        before = time.monotonic()
        while not self._halted:
            time.sleep(PERIOD_S)
            now = time.monotonic()
            late = now - before - PERIOD_S
            if late > _SLACK_S:
                self.total_us += int(late * 1e6)
            before = now
