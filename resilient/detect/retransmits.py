"""Packet loss per rail, from the kernel's retransmission counters.

A lossy rail can measure a fair average rate and still stall a call every now and
then for a retransmission timeout (200 ms and up, doubling), which the whole
collective waits for. So the rate a rank proposes for a rail (see
:mod:`resilient.detect.rail_weights`) is scaled by :meth:`RailLoss.factor`: once the rail's
links retransmitted at least :data:`LOSS_FLOOR` of their segments since the last
reading, the factor falls linearly to :data:`MIN_FACTOR` at :data:`LOSS_FULL` (a
rail proposed that low gets no share outside probes), and stays there for
:data:`HOLD_S` after the last lossy reading. Probes keep measuring the rail, so
it comes back once its links stop losing packets.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Final

__all__ = ["HOLD_S", "LOSS_FLOOR", "LOSS_FULL", "MIN_FACTOR", "RailLoss"]

READ_EVERY_S: Final = 0.1
LOSS_FLOOR: Final = 0.002
LOSS_FULL: Final = 0.02
MIN_FACTOR: Final = 1 / 32
HOLD_S: Final = 2.0
_MIN_SEGMENTS: Final = 20  # fewer segments since the last reading say nothing

Counters = Mapping[int, tuple[int, int]]  # rail -> (retransmitted, segments out)


class RailLoss:
    """Tracks each rail's retransmission share; ``read()`` gives running totals."""

    def __init__(self, read: Callable[[], Counters]) -> None:
        self._read = read
        self._last: dict[int, tuple[int, int]] = {}
        self._penalty: dict[int, tuple[float, float]] = {}  # rail -> (factor, until)
        self._next = 0.0

    def factor(self, rail: int, now: float | None = None) -> float:
        """What to multiply ``rail``'s measured rate by before proposing it."""
        now = time.monotonic() if now is None else now
        if now >= self._next:
            self._next = now + READ_EVERY_S
            self.update(self._read(), now)
        factor, until = self._penalty.get(rail, (1.0, 0.0))
        return factor if now < until else 1.0

    def update(self, counters: Counters, now: float) -> None:
        for rail, (retrans, segs) in counters.items():
            before = self._last.get(rail)
            self._last[rail] = (retrans, segs)
            if before is None or segs - before[1] < _MIN_SEGMENTS:
                continue
            loss = max(0, retrans - before[0]) / (segs - before[1])
            if loss >= LOSS_FLOOR:
                share = min(1.0, (loss - LOSS_FLOOR) / (LOSS_FULL - LOSS_FLOOR))
                self._penalty[rail] = (1.0 - share * (1.0 - MIN_FACTOR), now + HOLD_S)
