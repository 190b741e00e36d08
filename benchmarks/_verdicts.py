"""The pure arithmetic of ``failover.py`` and ``degraded.py``: what a run's numbers say.

No torch, no testbed: tests/benchmarks/ checks these functions on made-up numbers.
"""

from __future__ import annotations

import statistics
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "FaultPlacement",
    "OpStats",
    "degraded_bounds",
    "failover_reasons",
    "op_stats",
    "place_fault",
]


# -- failover.py -------------------------------------------------------------------------
@dataclass(frozen=True, slots=True)
class OpStats:
    """The faulted op against the ops around it (ms, slowest rank per op)."""

    fault_op_ms: float | None
    median_before_ms: float | None  # ops 1 .. F-1 (op 0 builds the links)
    median_after_ms: float | None  # ops F+1 ..
    median_around_ms: float | None  # ops 1 .. F-1 and F+1 .. together
    extra_ms: float | None  # fault_op_ms - median_around_ms

    def as_json(self) -> dict[str, float | None]:
        return {k: None if v is None else round(v, 1) for k, v in self._items()}

    def _items(self) -> list[tuple[str, float | None]]:
        return [
            ("fault_op_ms", self.fault_op_ms),
            ("median_before_ms", self.median_before_ms),
            ("median_after_ms", self.median_after_ms),
            ("median_around_ms", self.median_around_ms),
            ("extra_ms", self.extra_ms),
        ]


def _median(xs: Sequence[float]) -> float | None:
    return statistics.median(xs) if xs else None


def op_stats(per_op_ms: Sequence[float], fault_op: int) -> OpStats:
    """``per_op_ms[i]``: op i's time; ops after a failed one are simply missing."""
    before = list(per_op_ms[1:fault_op])
    after = list(per_op_ms[fault_op + 1 :])
    fault = per_op_ms[fault_op] if len(per_op_ms) > fault_op else None
    around = _median(before + after)
    return OpStats(
        fault_op_ms=fault,
        median_before_ms=_median(before),
        median_after_ms=_median(after),
        median_around_ms=around,
        extra_ms=None if fault is None or around is None else fault - around,
    )


@dataclass(frozen=True, slots=True)
class FaultPlacement:
    """Where ``ip link set ... down`` ran relative to the faulted op.

    The op window is from the moment the LAST rank started the op to the moment the
    FIRST rank finished it: inside it every rank was in the op. The NIC went down
    at some instant between ``down_start`` (the injector called ``ip link``) and
    ``down_end`` (``ip link`` returned); only when both lie in the window is it sure
    that the fault landed inside the op on every rank.
    """

    position: str  # inside, before, after, across-start, across-end, not-injected, op-missing
    down_at_ms: float | None  # down_start - op start
    down_done_at_ms: float | None  # down_end - op start
    op_window_ms: float | None  # op end - op start

    @property
    def inside(self) -> bool:
        return self.position == "inside"

    def as_json(self) -> dict[str, Any]:
        def r(v: float | None) -> float | None:
            return None if v is None else round(v, 1)

        return {
            "position": self.position,
            "down_at_ms": r(self.down_at_ms),
            "down_done_at_ms": r(self.down_done_at_ms),
            "op_window_ms": r(self.op_window_ms),
        }


def place_fault(
    down_start: float | None,
    down_end: float | None,
    op_starts: Sequence[float],
    op_ends: Sequence[float],
) -> FaultPlacement:
    """Place the fault (wall-clock seconds) against the op's per-rank start and end times."""
    if down_start is None or down_end is None:
        return FaultPlacement("not-injected", None, None, None)
    if not op_starts or not op_ends:
        return FaultPlacement("op-missing", None, None, None)
    start, end = max(op_starts), min(op_ends)

    def ms(t: float) -> float:
        return (t - start) * 1e3

    if down_end < start:
        pos = "before"
    elif down_start > end:
        pos = "after"
    elif down_start < start:
        pos = "across-start"
    elif down_end > end:
        pos = "across-end"
    else:
        pos = "inside"
    return FaultPlacement(pos, ms(down_start), ms(down_end), ms(end))


def failover_reasons(
    *,
    injected: bool,
    placement: FaultPlacement,
    failovers_total: int,
    failovers_in_fault_op: int,
    ops_failed: int,
) -> list[str]:
    """Why the run proves nothing (empty: it proves what it claims)."""
    reasons: list[str] = []
    if not injected:
        reasons.append("the NIC was never taken down")
    elif not placement.inside:
        p = placement.as_json()
        reasons.append(
            f"the NIC went down outside the faulted op ({p['position']}: ip link ran "
            f"{p['down_at_ms']} to {p['down_done_at_ms']} ms after the op started "
            f"on every rank; the op's common window was {p['op_window_ms']} ms)"
        )
    if failovers_total == 0:
        reasons.append("no failover happened (the engine's failovers list is empty on every rank)")
    elif failovers_in_fault_op == 0:
        reasons.append(
            f"no failover in the faulted op ({failovers_total} in other ops): its time "
            "is not the cost of failing over"
        )
    if ops_failed:
        reasons.append(f"{ops_failed} op(s) failed or returned other bits")
    return reasons


# -- degraded.py -------------------------------------------------------------------------
def degraded_bounds(
    *, nbytes: int, rate_mbit: float, b: float, healthy_ms: float, nic_both_ms: float
) -> dict[str, float]:
    """The lower bounds of the degraded all_reduce, in ms.

    ``bound_ms`` (the headline) is DESIGN.md's ``max(T_healthy, N / (b B))`` at the
    configured rate B (``rate_mbit``) of a healthy NIC: ``slow_nic_floor_ms`` is
    N / (b B). ``measured_bound_ms`` puts the measured time of the slow NIC moving
    N out and N in at once in place of N / (b B); it is shown beside the headline,
    never instead of it.
    """
    if not 0 < b <= 1 or rate_mbit <= 0 or nbytes <= 0:
        raise ValueError("need 0 < b <= 1, rate_mbit > 0 and nbytes > 0")
    floor_ms = nbytes / (b * rate_mbit * 1e6 / 8) * 1e3
    return {
        "slow_nic_floor_ms": floor_ms,
        "bound_ms": max(healthy_ms, floor_ms),
        "measured_bound_ms": max(healthy_ms, nic_both_ms),
    }
