"""Each rail's speed, learned from how long its share of the collectives took.

The engine times every rail's share of a call cut across several rails; the smoothed
rates are what this rank proposes for the learned rail weights
(:mod:`resilient.detect.rail_weights`).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Final

__all__ = ["RailRates"]

# A rail's share of a collective must be at least this big to say how fast it is.
_MIN_MEASURED_BYTES: Final = 48 << 10
_RATE_ALPHA: Final = 0.25
_WARMUP_CALLS: Final = 3


class RailRates:
    """The measured speed of each rail (bytes/s, smoothed; 0 = not measured yet)."""

    def __init__(self, rails: int) -> None:
        self.rates: tuple[float, ...] = (0.0,) * rails
        self._measured = [0] * rails

    def learn(self, nbytes: Sequence[int], times: Sequence[float]) -> None:
        """Fold in one call: ``nbytes[rail]`` moved in ``times[rail]`` seconds."""
        rates = list(self.rates)
        for rail, (size, secs) in enumerate(zip(nbytes, times, strict=True)):
            # Tiny shares measure latency, not bandwidth; they keep the old estimate.
            if size < _MIN_MEASURED_BYTES or secs <= 0:
                continue
            self._measured[rail] += 1
            if self._measured[rail] <= _WARMUP_CALLS:
                continue  # first calls pay for page faults and thread start-up
            # Smoothed in time per byte, not in bytes per second: a call that stalled
            # (a TCP retransmission on a lossy rail) weighs as much as the time it
            # cost, where an average of rates would barely notice it.
            cost = secs / size
            old = rates[rail]
            if old > 0:
                cost = (1 - _RATE_ALPHA) / old + _RATE_ALPHA * cost
            rates[rail] = 1.0 / cost
        self.rates = tuple(rates)
