"""The fast-path share (rail passes moved in C) in the chaos report, on hand-made tracks."""

from __future__ import annotations

from typing import Any

import pytest

from chaos._fast_path import tally
from chaos._progress_watch import RankTrack
from chaos.report import FaultRecord, RunFacts, build_report, render
from chaos.scenario import ScenarioError, parse

T0 = 1_000.0
INF = float("inf")


def _scenario(expect: str = "min_fast_path_share = 0.9", *, rails: int = 2) -> Any:
    return parse(
        f"""
[job]
script = "train.py"
nproc = 2
steps = 100
rails = {rails}
[[fault]]
kind = "nic-down"
rank = 1
rail = 0
at_step = 20
duration_s = 2.0
[expect]
{expect}
""",
        source="t.toml",
    )


def _track(python_at: set[int], *, c_built: bool = True, pid: int = 7) -> RankTrack:
    """100 steps, step s reported at T0 + 0.05 s + 0.025; two rail passes per step,
    both in C but at the steps in ``python_at``, where both went to Python. With
    the fault's window (T0 + 1.0 .. 3.0), steps 20..60 count as during it (their
    intervals since the record before overlap it), 0..19 and 61..99 outside."""
    samples, passes, c, py = [], [], 0, 0
    for step in range(100):
        ts = T0 + 0.05 * step + 0.025
        if step in python_at:
            py += 2
        else:
            c += 2
        samples.append((ts, step, 0))
        passes.append((ts, 0, pid, c, py))
    last = {"step": 99, "done": True, "params_sha256": "a", "c_built": c_built}
    return RankTrack(samples=samples, last=last, passes=passes)


def _facts(
    progress: dict[int, RankTrack], *, fired_s: float = 1.0, stop_s: float = 3.0
) -> RunFacts:
    fault = FaultRecord(
        index=0, kind="nic-down", params={"rank": 1, "rail": 0}, at_step=20, at_s=None,
        duration_s=2.0, fired_s=fired_s, fired_step=20, stopped_s=stop_s,
    )  # fmt: skip
    return RunFacts(
        t0=T0, duration_s=6.0, exit_code=0, timed_out=False, faults=[fault],
        progress=progress, events=[], reference=None,
    )  # fmt: skip


def _row(report: dict[str, Any]) -> dict[str, Any]:
    rows: list[dict[str, Any]] = report["expectations"]
    (row,) = [r for r in rows if r["name"] == "min_fast_path_share"]
    return row


@pytest.mark.timeout(10)
def test_intervals_overlapping_a_window_count_as_during_the_fault() -> None:
    # Cumulative (c, python) at ts 1, 2, 3, 4; window [2.5, 3.5] covers the 3rd and 4th.
    passes = [(1.0, 0, 1, 4, 0), (2.0, 0, 1, 8, 1), (3.0, 0, 1, 9, 5), (4.0, 0, 1, 9, 9)]
    outside, during = tally(passes, [(2.5, 3.5)])
    assert (outside.c, outside.python) == (8, 1)  # from the start, and 1 -> 2
    assert (during.c, during.python) == (1, 8)
    assert outside.share == pytest.approx(8 / 9)
    # A window until the end of the run (a kill with no later fault).
    outside, during = tally(passes, [(2.5, INF)])
    assert (outside.c, during.c) == (8, 1)
    # Without a pass, there is no share.
    assert tally([], [(0.0, INF)])[0].share is None


@pytest.mark.timeout(10)
def test_a_replacement_counts_from_zero_and_from_the_record_before_it() -> None:
    old = [(1.0, 0, 11, 10, 0), (2.0, 0, 11, 20, 0)]
    # The replacement (incarnation 1) reports 3 C passes first: since 2.0, across the
    # kill's window [2.5, inf): during the fault, whatever its counts.
    new = [(5.0, 1, 12, 3, 1), (6.0, 1, 12, 13, 1)]
    outside, during = tally(old + new, [(2.5, INF)])
    assert (outside.c, outside.python) == (20, 0)
    assert (during.c, during.python) == (13, 1)
    # A window that ended before the replacement's second record: its first
    # interval (2.0 .. 5.0) overlaps it, the next does not.
    outside, during = tally(old + new, [(2.5, 4.0)])
    assert (outside.c, during.c, during.python) == (30, 3, 1)
    # Same incarnation, another pid, or counts going down: a new process, from zero.
    restarted = [(1.0, 0, 11, 10, 0), (2.0, 0, 13, 4, 0)]
    assert tally(restarted, [])[0].c == 14


@pytest.mark.timeout(10)
def test_python_passes_inside_the_fault_window_do_not_count_against_the_bound() -> None:
    tracks = {r: _track(set(range(20, 61))) for r in range(2)}
    report = build_report(_scenario(), _facts(tracks))
    row = _row(report)
    assert row["expected"] == 0.9 and row["passed"] is True
    assert row["measured"] == pytest.approx(1.0)
    fast = report["fast_path"]
    assert fast["during_faults"]["python_passes"] == 2 * 2 * 41
    assert fast["per_rank"][1]["outside_faults"]["share"] == pytest.approx(1.0)
    assert "fast path" in render(report) and "min_fast_path_share" in render(report)


@pytest.mark.timeout(10)
def test_python_passes_outside_the_faults_fail_the_bound_and_name_the_lowest_rank() -> None:
    # Rank 1 moved 10 of its 59 steps outside the window in Python, rank 0 none.
    tracks = {0: _track(set()), 1: _track(set(range(61, 71)))}
    report = build_report(_scenario(), _facts(tracks))
    row = _row(report)
    # Outside the window: 2 ranks x 59 steps x 2 passes; 20 of them in Python.
    assert row["measured"] == pytest.approx(216 / 236)
    assert row["passed"] is True
    assert "lowest rank 1: 83.1%" in row["note"]
    tracks = {r: _track(set(range(61, 76))) for r in range(2)}
    report = build_report(_scenario(), _facts(tracks))
    assert _row(report)["measured"] == pytest.approx(176 / 236)
    assert _row(report)["passed"] is False and report["passed"] is False
    assert report["fast_path"]["per_rank"][0]["outside_faults"]["python_passes"] == 30
    # A scenario may set its own bound, or only report the share (0).
    assert _row(build_report(_scenario("min_fast_path_share = 0.7"), _facts(tracks)))["passed"]
    only = _row(build_report(_scenario("min_fast_path_share = 0"), _facts(tracks)))
    assert only["passed"] is True and only["measured"] == pytest.approx(176 / 236)
    assert "report only" in only["note"]


@pytest.mark.timeout(10)
def test_one_rail_or_no_c_module_reports_the_share_without_checking_it() -> None:
    tracks = {r: _track(set(range(60, 99))) for r in range(2)}
    one_rail = _row(build_report(_scenario(rails=1), _facts(tracks)))
    assert one_rail["passed"] is True and one_rail["measured"] is not None
    assert "2+ rails" in one_rail["note"]
    plain = {r: _track(set(range(100)), c_built=False) for r in range(2)}
    no_c = _row(build_report(_scenario(), _facts(plain)))
    assert no_c["passed"] is True and no_c["measured"] == 0.0
    assert "not built" in no_c["note"]


@pytest.mark.timeout(10)
def test_no_pass_counts_fail_on_two_rails_with_a_reason() -> None:
    tracks = {r: _track(set()) for r in range(2)}
    for t in tracks.values():
        t.passes.clear()
        del t.last["c_built"]
    report = build_report(_scenario(), _facts(tracks))
    row = _row(report)
    assert row["passed"] is False and row["measured"] is None and "no rank" in row["note"]
    assert "fast path" not in render(report)
    assert _row(build_report(_scenario(rails=1), _facts(tracks)))["passed"] is True
    # Every step inside a fault window: nothing to measure the bound on.
    tracks = {r: _track(set()) for r in range(2)}
    row = _row(build_report(_scenario(), _facts(tracks, fired_s=0.0, stop_s=10.0)))
    assert row["passed"] is False and "outside the fault windows" in row["note"]


@pytest.mark.timeout(10)
def test_the_bound_is_a_fraction() -> None:
    # Report only unless a scenario sets a bound (the straggler-aware schedule
    # still runs in Python: a loaded host's 2-rail run stays below 0.9).
    assert _scenario("").expect.min_fast_path_share == 0.0
    assert _scenario().expect.min_fast_path_share == 0.9
    assert _scenario("min_fast_path_share = 1").expect.min_fast_path_share == 1.0
    for bad, why in (("1.5", "a fraction in [0, 1]"), ("-0.1", "a fraction"), ('"x"', "float")):
        with pytest.raises(ScenarioError) as err:
            _scenario(f"min_fast_path_share = {bad}")
        assert err.value.key == "expect.min_fast_path_share" and why in err.value.problem
