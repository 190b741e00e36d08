"""Straggler detection: which rank is slow, robustly, with hysteresis.

In synchronous training every rank's *step* takes the same wall time (the fast ones
wait in the collectives), so the detector is fed a per-rank cost per sample where
longer means slower: in :mod:`resilient.detect.stragglers`, the time a rank is active
while its peers wait for it, or how much longer its wall time is than the time it
could actually run.

For each rank and step it computes two scores over a sliding window:

* relative: the median cost of its peers / its own (1.0 = like the others,
  0.77 = 30 % slower);
* individual: its own best recent cost / its current one (catches a rank that
  got slower even when all are slow).

A rank is *suspected* when its relative score is below ``1 - margin`` and below the
peers' spread (median absolute deviation, scaled) on that step; *confirmed* after
``confirm_steps`` suspect steps out of the last ``confirm_window``; *cleared* after
``clear_steps`` normal steps in a row. Noise of a few percent never confirms; a
rank 30 % slower is confirmed within ``confirm_window`` steps. The verdict says
``compute`` (its cost is high) or ``link`` (its cost is normal but its links
measure slow).
"""

from __future__ import annotations

import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

from resilient.errors import ConfigError

__all__ = ["StragglerConfig", "StragglerDetector", "Transition"]

_MAD_SCALE: Final = 1.4826  # MAD -> standard deviation for normal noise


@dataclass(frozen=True, kw_only=True, slots=True)
class StragglerConfig:
    """Thresholds of :class:`StragglerDetector` (see the module docstring)."""

    window: int = 20
    recent: int = 5
    margin: float = 0.12
    mad_k: float = 4.0
    confirm_steps: int = 6
    confirm_window: int = 10
    clear_steps: int = 10
    link_margin: float = 0.5

    def __post_init__(self) -> None:
        if (
            self.window < 3
            or not 1 <= self.recent <= self.window
            or self.confirm_window < self.confirm_steps
            or self.confirm_steps < 1
        ):
            raise ConfigError(
                "StragglerConfig: need window >= 3, 1 <= recent <= window and "
                "1 <= confirm_steps <= confirm_window"
            )
        if not 0 < self.margin < 1 or self.mad_k <= 0 or self.clear_steps < 1:
            raise ConfigError("StragglerConfig: need 0 < margin < 1, mad_k > 0, clear_steps >= 1")


@dataclass(frozen=True, slots=True)
class Transition:
    """A change of one rank's state: kind is suspected, confirmed or cleared."""

    kind: str
    rank: int
    step: int
    relative: float
    individual: float
    cause: str


@dataclass(slots=True)
class _Rank:
    busy: deque[float] = field(default_factory=deque)
    flags: deque[bool] = field(default_factory=deque)
    state: str = "ok"  # ok, suspected, confirmed
    normal_run: int = 0
    relative: float = 1.0  # the last sample's relative score


class StragglerDetector:
    """Feeds on per-step busy times of every rank; returns state transitions."""

    def __init__(self, config: StragglerConfig | None = None) -> None:
        self.config = config or StragglerConfig()
        self._ranks: dict[int, _Rank] = {}

    def state(self, rank: int) -> str:
        r = self._ranks.get(rank)
        return r.state if r is not None else "ok"

    def relative(self, rank: int) -> float:
        """The rank's relative score in the last sample (1.0 before any)."""
        r = self._ranks.get(rank)
        return r.relative if r is not None else 1.0

    def observe(
        self,
        step: int,
        busy_s: Mapping[int, float],
        link_rates: Mapping[int, float] | None = None,
    ) -> list[Transition]:
        """Record one step (``busy_s[rank]``: its busy time) and return what changed.

        ``link_rates[rank]``, when given, is the rank's slowest measured link rate; a
        rank whose links are far slower than its peers' is a *link* straggler even
        though its busy time is normal.
        """
        if len(busy_s) < 2:
            return []
        cfg = self.config
        out: list[Transition] = []
        for rank, value in busy_s.items():
            r = self._ranks.setdefault(rank, _Rank())
            r.busy.append(value)
            if len(r.busy) > cfg.window:
                r.busy.popleft()
        for rank in busy_s:
            rel, ind, slow_compute = self._scores(rank, busy_s)
            slow_link = self._slow_link(rank, link_rates)
            t = self._update(rank, step, rel, ind, slow_compute or slow_link,
                             "compute" if slow_compute else "link")  # fmt: skip
            if t is not None:
                out.append(t)
        return out

    def _scores(self, rank: int, busy_s: Mapping[int, float]) -> tuple[float, float, bool]:
        cfg = self.config
        own = self._recent(rank)
        peers = [self._recent(p) for p in busy_s if p != rank]
        peer_med = statistics.median(peers)
        rel = peer_med / own if own > 0 else 1.0
        best = min(self._ranks[rank].busy)
        ind = best / busy_s[rank] if busy_s[rank] > 0 else 1.0
        mad = statistics.median(abs(p - peer_med) for p in peers) * _MAD_SCALE
        slow = rel < 1.0 - cfg.margin and own - peer_med > cfg.mad_k * mad
        return rel, ind, slow

    def _recent(self, rank: int) -> float:
        """Median of the rank's last few busy times: one spike moves it little."""
        busy = self._ranks[rank].busy
        return statistics.median(list(busy)[-self.config.recent :])

    def _slow_link(self, rank: int, link_rates: Mapping[int, float] | None) -> bool:
        if not link_rates or rank not in link_rates or len(link_rates) < 2:
            return False
        peers = [v for p, v in link_rates.items() if p != rank]
        return link_rates[rank] < self.config.link_margin * statistics.median(peers)

    def _update(
        self, rank: int, step: int, rel: float, ind: float, slow: bool, cause: str
    ) -> Transition | None:
        cfg, r = self.config, self._ranks[rank]
        r.relative = rel
        r.flags.append(slow)
        if len(r.flags) > cfg.confirm_window:
            r.flags.popleft()
        r.normal_run = 0 if slow else r.normal_run + 1
        new = r.state
        if r.state == "ok" and slow:
            new = "suspected"
        if r.state in ("ok", "suspected") and sum(r.flags) >= cfg.confirm_steps:
            new = "confirmed"
        if r.state == "suspected" and r.normal_run >= cfg.confirm_window:
            new = "ok"
        if r.state == "confirmed" and r.normal_run >= cfg.clear_steps:
            new = "ok"
        if new == r.state:
            return None
        old, r.state = r.state, new
        kind = "cleared" if new == "ok" else new
        if old == "suspected" and new == "ok":
            kind = "cleared"
        return Transition(kind, rank, step, round(rel, 4), round(ind, 4), cause)
