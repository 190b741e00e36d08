"""Straggler detection fed by the signature exchange, reported as events.

Every call's exchange carries how long each rank computed before it (its busy
time). All ranks see the same numbers, so each runs the same
:class:`~recovery.straggler.StragglerDetector` and reaches the same verdicts
without any extra message; verdicts become ``straggler.suspected`` /
``straggler.confirmed`` / ``straggler.cleared`` events and warnings.

One call's busy time is noisy (back-to-back buckets have almost none, and a rank
that the OS descheduled for a moment looks busy), so busy times are summed over
:data:`CALLS_PER_SAMPLE` calls, about one training step or more, before the
detector sees them; windows where every rank was idle are skipped.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Final

from recovery import events
from recovery.straggler import StragglerDetector

if TYPE_CHECKING:
    from resilient._signature import Exchange

__all__ = ["StragglerWatch"]

logger = logging.getLogger(__name__)

CALLS_PER_SAMPLE: Final = 8
# Below this (summed over a sample) the busy time is scheduling noise, not compute.
_MIN_BUSY_US: Final = 5000


class StragglerWatch:
    """One rank's view of every rank's busy times; see the module docstring."""

    def __init__(self, rank: int, epoch: int = 0) -> None:
        self.rank, self.epoch = rank, epoch
        self.detector = StragglerDetector()
        self._sums: list[int] = []
        self._calls = 0

    def observe(self, exchange: Exchange) -> None:
        busy = exchange.busy_us
        if len(busy) < 3:
            return
        if len(self._sums) != len(busy):
            self._sums = [0] * len(busy)
        self._sums = [a + b for a, b in zip(self._sums, busy, strict=True)]
        self._calls += 1
        if self._calls < CALLS_PER_SAMPLE:
            return
        sums, self._sums, self._calls = self._sums, [0] * len(busy), 0
        if max(sums) < _MIN_BUSY_US:
            return
        transitions = self.detector.observe(
            exchange.seq, {r: us / 1e6 for r, us in enumerate(sums)}
        )
        for t in transitions:
            events.emit(
                f"straggler.{t.kind}",
                epoch=self.epoch,
                rank=t.rank,
                reason=(
                    f"rank {t.rank} busy {1 / t.relative:.2f}x the median of its peers "
                    f"(individual score {t.individual:.2f}, cause: {t.cause})"
                ),
                action="reported",
                call=t.step,
            )
            logger.warning(
                "rank %d (epoch %d, call %d): rank %d straggler %s (relative %.2f, %s)",
                self.rank, self.epoch, t.step, t.rank, t.kind, t.relative, t.cause,
            )  # fmt: skip
