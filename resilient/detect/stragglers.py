"""Straggler detection fed by the signature exchange, reported as events.

Every exchange row carries the rank's clock (see :mod:`resilient.check.exchange`):
time spent waiting inside exchanges for the other ranks, time *stolen* (the process
could not run: stopped, CPU-throttled, starved) and the rest ("active"). All ranks
see every rank's clock in the same exchange table, so each runs the same
:class:`~resilient.detect.straggler_scores.StragglerDetector` and reaches the same verdicts
without any extra message; verdicts become ``straggler.suspected`` /
``straggler.confirmed`` / ``straggler.cleared`` events and warnings.

Two signals, two detectors, because they fail differently:

* **stalled**: a process that does not run is slow at everything, compute and
  communication alike, so its peers block in the same collectives it blocks in and
  their clocks barely differ. Its own stolen time gives it away: the detector sees
  ``elapsed / (elapsed - stolen)``, how much longer the rank takes than it would
  if it ran all the time (1.43 for a rank stopped 30 % of the time).
* **compute**: a rank whose compute is slow (a throttled GPU) keeps running but
  submits its collectives late, so the others wait for it in the exchange and its
  active time is the longest. Active time also carries every scheduling hiccup, so
  this detector judges longer samples.

One call is too short to judge (a rank descheduled for a moment is late once), so
samples span at least :data:`STALL_SAMPLE_S` / :data:`COMPUTE_SAMPLE_S` of wall
time and :data:`MIN_CALLS` calls.
"""

from __future__ import annotations

import logging
import statistics
import threading
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING, Final

from resilient import events
from resilient.detect.straggler_scores import StragglerConfig, StragglerDetector, Transition

if TYPE_CHECKING:
    from resilient.collectives.signature import Exchange

__all__ = ["Standing", "StragglerWatch", "Verdicts"]

logger = logging.getLogger(__name__)

STALL_SAMPLE_S: Final = 0.1
COMPUTE_SAMPLE_S: Final = 0.4
MIN_CALLS: Final = 2
# Stolen time is a strong signal (a healthy rank's is timer slack), so the stall
# detector asks for a wider gap and fewer, shorter-smoothed samples: a rank stopped
# 30 % of the time must be confirmed within 20 steps even on a loaded machine, where
# every sample is slower and the default (6 of 10 samples) took 13-14 steps.
# Samples span a whole 100 ms period, CFS quota throttling's default and the chaos
# "slow" fault's cycle: 50 ms samples came out stopped-through and clean in turn,
# their median of three flagged every other one, and 4 of 6 took 11-28 steps in
# the straggler scenario (28 failed its 20-step bound); with 100 ms samples and 3 of
# 5 it took 12-16. Three flagged samples still mean 300 ms of stolen time, more
# than the 200 ms of 4 of 6 at 50 ms (3 of 6 at 50 ms once confirmed a healthy rank
# starved for a few hundred ms in the link-flap scenario).
# With shorter steps (2026-12-04) the same detection time is more steps: the
# straggler scenario (width 256) took 19-24 of its 20. Each sample is now judged
# alone and 3 flagged of the last 4 confirm: the evidence the medians of three
# asked for (they confirmed on 3 flagged within 4 samples, a sample later), 11-17
# steps there and 9-12 in the 3-rank test at width 512. Two in a row at a 25 % gap
# was faster but missed one run in five there: a rank stopped 30 % of the time
# read 0.72-0.75 of its peers, at that gap's edge.
# That evidence holds on a crowded host because the meter counts a throttle from
# the cgroup's own account and ignores late wake-ups under 10 ms
# (resilient.detect.stolen_time): with every 2-19 ms lateness counted, a healthy
# rank of a host at load 10 read under 0.53 of its peers in 1 % of samples (under
# 0.71 in 5 %), and 3 of 4 confirmed one 5 times in 1,000 clean steps; without
# them, under 0.67-0.70 in 1 % (0.81-0.84 in 5 %).
STALL_CONFIG: Final = StragglerConfig(recent=1, margin=0.2, confirm_steps=3, confirm_window=4)
# Active time carries the host's scheduling: at load ~10 on 2 cores a healthy rank
# was active 1.14-1.16x its peers' median over 2 s (median of 5 samples) for long
# enough to be confirmed at the default 12 % margin, once in ~2,000 clean steps. A
# rank whose compute is 30 % slower reads 0.77, inside a 15 % margin still.
COMPUTE_CONFIG: Final = StragglerConfig(margin=0.15)

# An epoch's first calls are not judged: ranks still start up (links built on first
# use, threads started, a just-started rank's first steps) and, on a crowded host,
# take turns at the cores unevenly. 6 of the 11 healthy ranks confirmed in 16 runs
# of the straggler-cpu scenario at load 10-19 were confirmed by call 48; the
# scenarios' faults come after call 75.
WARMUP_CALLS: Final = 50

Clock = tuple[int, int, int]  # active, waited, stolen (us)


class _Sampler:
    """Cuts the stream of clocks into samples of at least ``span_s`` and MIN_CALLS."""

    def __init__(self, span_s: float) -> None:
        self.span_us = span_s * 1e6
        self._mark: list[Clock] = []
        self._calls = 0

    def take(self, clocks: list[Clock]) -> list[Clock] | None:
        """Per rank (active, waited, stolen) since the last sample, once one is due."""
        if len(self._mark) != len(clocks):  # first call, or the world changed
            self._mark, self._calls = clocks, 0
            return None
        self._calls += 1
        if self._calls < MIN_CALLS:
            return None
        mark = self._mark
        # The span first, the deltas only for a sample: this runs for every call.
        span = max(c[0] + c[1] - m[0] - m[1] for c, m in zip(clocks, mark, strict=True))
        if span < self.span_us:
            return None
        self._mark, self._calls = clocks, 0
        return [
            (a - a0, w - w0, s - s0) for (a, w, s), (a0, w0, s0) in zip(clocks, mark, strict=True)
        ]


@dataclass(slots=True)
class Standing:
    """A confirmed straggler, until it is cleared or the epoch ends.

    ``lost_s``: the seconds the job has lost to it so far (the time its peers
    waited for it, measured since it was first suspected), the evidence the
    policy weighs an eviction against; None where not measured (a link
    straggler). ``judged``: the last action the session recorded for it.
    """

    rank: int
    cause: str
    relative: float
    lost_s: float | None
    judged: str | None = None


class Verdicts:
    """The confirmed stragglers standing now: written by the thread that runs the
    detectors, judged at every step boundary (``recovery.Session``)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._standing: dict[tuple[int, str], Standing] = {}
        # The job-wide rank of each position in the current epoch (after a shrink
        # positions are renumbered); None: positions are ranks.
        self.members: tuple[int, ...] | None = None

    def _rank(self, pos: int) -> int:
        members = self.members
        return members[pos] if members else pos

    def add(self, pos: int, cause: str, relative: float, lost_s: float | None = None) -> None:
        """``pos`` was confirmed a straggler (or, already standing, measured again)."""
        rank = self._rank(pos)
        with self._lock:
            old = self._standing.get((rank, cause))
            judged = old.judged if old is not None else None
            self._standing[rank, cause] = Standing(rank, cause, relative, lost_s, judged)

    def clear(self, pos: int, cause: str) -> None:
        """``pos`` is no longer a straggler by ``cause``."""
        with self._lock:
            self._standing.pop((self._rank(pos), cause), None)

    def reset(self, members: tuple[int, ...] | None) -> None:
        """A new epoch: its detectors start afresh, and positions may be renumbered."""
        with self._lock:
            self._standing.clear()
            self.members = members

    def standing(self) -> list[Standing]:
        """A copy of every standing straggler, in the order they were confirmed."""
        with self._lock:
            return [replace(s) for s in self._standing.values()]

    def judged(self, rank: int, cause: str, action: str) -> None:
        """Remember the action last recorded for a standing straggler."""
        with self._lock:
            s = self._standing.get((rank, cause))
            if s is not None:
                s.judged = action


class StragglerWatch:
    """One rank's view of every rank's exchange clock; see the module docstring."""

    def __init__(self, rank: int, epoch: int = 0, sink: Verdicts | None = None) -> None:
        """``sink``: told of every confirmed straggler, of the time lost to it after
        each sample, and of its clearing, for the policy (see :class:`Verdicts`)."""
        self.rank, self.epoch = rank, epoch
        self.sink = sink
        self.stalled = StragglerDetector(STALL_CONFIG)
        self.compute = StragglerDetector(COMPUTE_CONFIG)
        self._stall_sampler = _Sampler(STALL_SAMPLE_S)
        self._compute_sampler = _Sampler(COMPUTE_SAMPLE_S)
        # Seconds lost to each rank not "ok" with a detector, since it was suspected.
        self._lost: dict[str, dict[int, float]] = {"stalled": {}, "compute": {}}

    def state(self, rank: int) -> str:
        """The worse of the two detectors' states for ``rank``."""
        states = (self.stalled.state(rank), self.compute.state(rank))
        return next((s for s in ("confirmed", "suspected") if s in states), "ok")

    def lost_s(self, rank: int, signal: str) -> float:
        """Seconds the job lost to ``rank`` by ``signal`` (stalled, compute) since it
        was suspected; 0 while it is not."""
        return self._lost[signal].get(rank, 0.0)

    def observe(self, exchange: Exchange) -> None:
        clocks = exchange.clocks
        if len(clocks) < 3 or exchange.seq < WARMUP_CALLS:
            return
        delta = self._stall_sampler.take(clocks)
        if delta is not None:
            slowdown = {r: (a + w) / max(a + w - s, 1) for r, (a, w, s) in enumerate(delta)}
            found = self.stalled.observe(exchange.seq, slowdown)
            # Its peers wait out the time it was stopped beyond their own stops.
            self._account(self.stalled, "stalled", [s for _, _, s in delta], found)
        delta = self._compute_sampler.take(clocks)
        if delta is not None:
            active = {r: max(a, 1) / 1e6 for r, (a, _, _) in enumerate(delta)}
            found = self.compute.observe(exchange.seq, active)
            # Its peers wait out the time it was active beyond their own.
            self._account(self.compute, "compute", [a for a, _, _ in delta], found)

    def _account(
        self, detector: StragglerDetector, signal: str, spent_us: list[int], found: list[Transition]
    ) -> None:
        """Add this sample's lost time to each rank the detector does not find "ok",
        then report the transitions, and each confirmed rank's new total."""
        lost = self._lost[signal]
        for r, own in enumerate(spent_us):
            if detector.state(r) == "ok":
                lost.pop(r, None)
                continue
            peers = statistics.median(v for p, v in enumerate(spent_us) if p != r)
            lost[r] = lost.get(r, 0.0) + max(own - peers, 0) / 1e6
        reported = set()
        for t in found:
            self._report(t, signal)
            reported.add(t.rank)
        if self.sink is None:
            return
        for r, seconds in lost.items():
            if r not in reported and detector.state(r) == "confirmed":
                self.sink.add(r, signal, detector.relative(r), seconds)

    def _report(self, t: Transition, signal: str) -> None:
        if self.sink is not None:
            if t.kind == "confirmed":
                self.sink.add(t.rank, signal, t.relative, self.lost_s(t.rank, signal))
            elif t.kind == "cleared":
                self.sink.clear(t.rank, signal)
        # A sample in which a rank's stolen time covered all of it (its meter saw it
        # stopped throughout, or the meter itself was held up as long) makes its
        # slowdown its whole span in us, and its relative score rounds to 0 (it is
        # kept to four decimals). Seen in CI as a ZeroDivisionError here that failed
        # every rank's call at once.
        times = f"{1 / t.relative:.2f}x" if t.relative > 0 else "over 20000x"
        what = (
            f"took {times} its peers' median time: it could not run part of the time "
            "(stopped, throttled or starved)"
            if signal == "stalled"
            else f"was active {times} its peers' median time while they waited for it"
        )
        events.emit(
            f"straggler.{t.kind}",
            epoch=self.epoch,
            rank=t.rank,
            reason=f"rank {t.rank} {what} (individual score {t.individual:.2f}, cause: {signal})",
            action="reported",
            call=t.step,
            relative=round(t.relative, 3),
            cause=signal,
        )
        logger.warning(
            "rank %d (epoch %d, call %d): rank %d straggler %s (relative %.2f, cause %s)",
            self.rank, self.epoch, t.step, t.rank, t.kind, t.relative, signal,
        )  # fmt: skip
