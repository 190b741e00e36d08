"""The pure arithmetic of benchmarks/failover.py and benchmarks/degraded.py
(benchmarks/_verdicts.py) and the signal guard of benchmarks/_guard.py."""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from _guard import SignalGuard, interrupt_for
from _verdicts import (
    FaultPlacement,
    degraded_bounds,
    failover_reasons,
    op_stats,
    place_fault,
)


def test_op_stats_compares_the_fault_op_with_ops_before_and_after() -> None:
    # op 0 builds the links (left out); fault op 3; before: 10, 12; after: 30, 32
    s = op_stats([99.0, 10.0, 12.0, 50.0, 30.0, 32.0], 3)
    assert s.fault_op_ms == 50.0
    assert s.median_before_ms == 11.0
    assert s.median_after_ms == 31.0
    assert s.median_around_ms == 21.0  # median of 10, 12, 30, 32
    assert s.extra_ms == 29.0
    assert s.as_json()["extra_ms"] == 29.0


def test_op_stats_when_the_stream_stopped_at_the_fault_op() -> None:
    s = op_stats([99.0, 10.0, 12.0], 3)
    assert s.fault_op_ms is None and s.extra_ms is None
    assert s.median_after_ms is None and s.median_before_ms == 11.0


@pytest.mark.parametrize(
    ("down", "pos"),
    [
        ((9.0, 9.5), "before"),
        ((9.5, 10.5), "across-start"),
        ((10.2, 10.3), "inside"),
        ((10.8, 11.2), "across-end"),
        ((11.5, 11.6), "after"),
    ],
)
def test_place_fault(down: tuple[float, float], pos: str) -> None:
    # Ranks start at 9.9 and 10.0 and finish at 11.0 and 11.1: the common window is 10..11.
    p = place_fault(down[0], down[1], [9.9, 10.0], [11.0, 11.1])
    assert p.position == pos
    assert p.inside == (pos == "inside")
    assert p.op_window_ms == pytest.approx(1000.0)
    assert p.down_at_ms == pytest.approx((down[0] - 10.0) * 1e3)


def test_place_fault_not_injected_or_op_missing() -> None:
    assert place_fault(None, None, [1.0], [2.0]).position == "not-injected"
    assert place_fault(1.0, 1.1, [1.0], []).position == "op-missing"


def _inside() -> FaultPlacement:
    return place_fault(10.2, 10.3, [10.0], [11.0])


def test_failover_reasons_ok() -> None:
    assert (
        failover_reasons(
            injected=True, placement=_inside(), failovers_total=4, failovers_in_fault_op=4,
            ops_failed=0,
        )
        == []
    )  # fmt: skip


def test_failover_reasons_fail_without_a_failover_or_outside_the_op() -> None:
    none = failover_reasons(
        injected=True, placement=_inside(), failovers_total=0, failovers_in_fault_op=0,
        ops_failed=0,
    )  # fmt: skip
    assert len(none) == 1 and "no failover happened" in none[0]
    elsewhere = failover_reasons(
        injected=True, placement=_inside(), failovers_total=3, failovers_in_fault_op=0,
        ops_failed=0,
    )  # fmt: skip
    assert len(elsewhere) == 1 and "no failover in the faulted op" in elsewhere[0]
    late = failover_reasons(
        injected=True, placement=place_fault(11.5, 11.6, [10.0], [11.0]), failovers_total=2,
        failovers_in_fault_op=0, ops_failed=1,
    )  # fmt: skip
    assert len(late) == 3 and "outside the faulted op (after" in late[0]
    assert failover_reasons(
        injected=False, placement=place_fault(None, None, [], []), failovers_total=0,
        failovers_in_fault_op=0, ops_failed=0,
    )[0] == "the NIC was never taken down"  # fmt: skip


@pytest.mark.parametrize("b", [0.5, 0.25])
def test_degraded_bound_is_the_configured_rate_bound(b: float) -> None:
    nbytes = 4 << 20
    floor = nbytes / (b * 400e6 / 8) * 1e3  # 4 MiB at b * 400 Mbit/s
    # T_healthy below the floor: the floor is the bound, whatever was measured.
    out = degraded_bounds(nbytes=nbytes, rate_mbit=400.0, b=b, healthy_ms=50.0, nic_both_ms=500.0)
    assert out["slow_nic_floor_ms"] == pytest.approx(floor)
    assert out["bound_ms"] == pytest.approx(floor)
    assert out["measured_bound_ms"] == 500.0
    # T_healthy above it: the healthy ring is the bound.
    high = degraded_bounds(nbytes=nbytes, rate_mbit=400.0, b=b, healthy_ms=1e4, nic_both_ms=1.0)
    assert high["bound_ms"] == 1e4


def test_degraded_bounds_reject_a_bad_b() -> None:
    with pytest.raises(ValueError):
        degraded_bounds(nbytes=1, rate_mbit=1.0, b=0.0, healthy_ms=1.0, nic_both_ms=1.0)


def test_interrupt_for() -> None:
    assert isinstance(interrupt_for(signal.SIGINT), KeyboardInterrupt)
    e = interrupt_for(signal.SIGTERM)
    assert isinstance(e, SystemExit) and e.code == 128 + signal.SIGTERM


def test_signal_guard_raises_and_holds_during_cleanup() -> None:
    guard = SignalGuard().install()
    try:
        with pytest.raises(SystemExit):
            os.kill(os.getpid(), signal.SIGTERM)
        assert guard.reason == "interrupted by SIGTERM"
        ran_to_end = False
        with pytest.raises(KeyboardInterrupt), guard.shielded():
            os.kill(os.getpid(), signal.SIGINT)
            ran_to_end = True  # the signal did not cut the block short
        assert ran_to_end
    finally:
        guard.uninstall()
