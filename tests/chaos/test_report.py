"""The chaos report's arithmetic and verdicts, on hand-made run facts."""

from __future__ import annotations

from typing import Any

import pytest

from chaos._progress_watch import RankTrack
from chaos.report import (
    FaultRecord,
    RunFacts,
    build_report,
    render,
    replayed_by_survivors,
    steps_replayed,
)
from chaos.scenario import parse

T0 = 1_000.0


def _scenario(expect: str, steps: int = 100, nproc: int = 2) -> Any:
    return parse(
        f"""
[job]
script = "train.py"
nproc = {nproc}
steps = {steps}
rails = 2
[[fault]]
kind = "throttle"
rank = 1
rail = 0
rate_mbit = 100
at_step = 20
duration_s = 2.0
[expect]
{expect}
""",
        source="t.toml",
    )


def _track(ms_before: float, ms_during: float, *, fault_s: float, end_step: int) -> RankTrack:
    """A rank that steps every ms_before until fault_s, then every ms_during until
    fault_s+2; two rail passes per step, both moved in C."""
    samples, t, step = [], T0, 0
    passes: list[tuple[float, int, int, int, int]] = []
    while step < end_step:
        in_fault = fault_s <= t - T0 < fault_s + 2.0
        t += (ms_during if in_fault else ms_before) / 1e3
        samples.append((t, step, 0))
        passes.append((t, 0, 100, 2 * (step + 1), 0))
        step += 1
    last = {"step": end_step - 1, "done": True, "params_sha256": "abc", "c_built": True}
    return RankTrack(samples=samples, last=last, passes=passes)


def _facts(progress: dict[int, RankTrack], *, exit_code: int = 0, **kw: Any) -> RunFacts:
    fault = FaultRecord(
        index=0, kind="throttle", params={"rank": 1, "rail": 0, "rate_mbit": 100.0},
        at_step=20, at_s=None, duration_s=2.0, fired_s=1.0, fired_step=20, stopped_s=3.0,
    )  # fmt: skip
    return RunFacts(
        t0=T0, duration_s=10.0, exit_code=exit_code, timed_out=False, faults=[fault],
        progress=progress, events=kw.get("events", []), reference=kw.get("reference"),
    )  # fmt: skip


@pytest.mark.timeout(10)
def test_slowdown_is_measured_from_step_rates() -> None:
    tracks = {r: _track(20.0, 60.0, fault_s=1.0, end_step=100) for r in range(2)}
    report = build_report(_scenario("max_slowdown = 1.5"), _facts(tracks))
    sm = report["step_ms"]
    assert sm["before_ms"] == pytest.approx(20.0, rel=0.05)
    assert sm["during_ms"] == pytest.approx(60.0, rel=0.1)
    assert sm["slowdown"] == pytest.approx(3.0, rel=0.1)
    (row,) = [r for r in report["expectations"] if r["name"] == "max_slowdown"]
    assert row["passed"] is False
    assert report["passed"] is False
    assert "max_slowdown" in render(report)


@pytest.mark.timeout(10)
def test_a_clean_run_passes_what_it_measured() -> None:
    tracks = {r: _track(20.0, 21.0, fault_s=1.0, end_step=100) for r in range(2)}
    text = "completes = true\nmax_steps_replayed = 0\nparams_equal_across_ranks = true\n"
    text += "max_slowdown = 1.2\nparams_equal_fault_free = true"
    report = build_report(_scenario(text), _facts(tracks, reference={"params_sha256": "abc"}))
    assert [r["name"] for r in report["expectations"] if not r["passed"]] == []
    assert report["passed"] is True


@pytest.mark.timeout(10)
def test_a_failed_job_fails_completes_and_equality() -> None:
    tracks = {r: _track(20.0, 20.0, fault_s=1.0, end_step=100) for r in range(2)}
    tracks[1].last = {"step": 40}  # never finished
    report = build_report(
        _scenario("params_equal_across_ranks = true"), _facts(tracks, exit_code=1)
    )
    verdict = {r["name"]: r["passed"] for r in report["expectations"]}
    assert verdict == {
        "completes": False,
        "params_equal_across_ranks": False,
        "min_fast_path_share": True,  # every pass in C
    }


@pytest.mark.timeout(10)
def test_unmeasurable_expectations_fail_with_a_reason() -> None:
    tracks = {r: _track(20.0, 20.0, fault_s=1.0, end_step=100) for r in range(2)}
    text = "max_detect_ms = 100.0\nmax_recovery_s = 5.0\nparams_equal_fault_free = true"
    report = build_report(_scenario(text), _facts(tracks))
    rows = {r["name"]: r for r in report["expectations"]}
    for name in ("max_detect_ms", "max_recovery_s", "params_equal_fault_free"):
        assert rows[name]["passed"] is False
        assert rows[name]["note"]


@pytest.mark.timeout(10)
def test_detection_and_recovery_come_from_the_event_log() -> None:
    tracks = {r: _track(20.0, 20.0, fault_s=1.0, end_step=100) for r in range(2)}
    events = [
        {"ts": T0 + 1.05, "kind": "link.down", "rank": 0},
        {"ts": T0 + 1.2, "kind": "link.rerouted", "rank": 0},
        {"ts": T0 + 1.5, "kind": "recovery.finished", "duration_ms": 450.0},
        {"ts": T0 + 9.0, "kind": "link.down"},  # after the fault was undone: not counted
    ]
    text = "max_detect_ms = 100.0\nmax_recovery_s = 1.0"
    report = build_report(_scenario(text), _facts(tracks, events=events))
    (fault,) = report["faults"]
    assert fault["detected"] == "link.down"
    assert fault["detect_ms"] == pytest.approx(50.0, abs=1.0)
    assert fault["actions"] == ["link.rerouted", "recovery.finished"]
    assert fault["recovery_s"] == [pytest.approx(0.45)]
    assert report["passed"] is True


@pytest.mark.timeout(10)
def test_steps_replayed_counts_work_redone_by_a_new_incarnation() -> None:
    samples = [(T0 + i, i, 0) for i in range(10)]  # steps 0..9 by incarnation 0
    samples += [(T0 + 20 + i, 8 + i, 1) for i in range(5)]  # back at step 8: 8 and 9 redone
    assert steps_replayed({0: RankTrack(samples=samples)}) == 2
    fresh = [(T0 + 20 + i, i, 1) for i in range(5)]  # restarted from scratch
    assert steps_replayed({0: RankTrack(samples=samples[:10] + fresh)}) == 10
    assert steps_replayed({0: RankTrack(samples=samples[:10])}) == 0


@pytest.mark.timeout(10)
def test_a_stall_during_the_fault_is_measured_not_skipped() -> None:
    # Steps every 20 ms, then nothing for the whole 2 s fault, then every 20 ms again.
    samples, t = [], T0
    for step in range(100):
        t += 2.0 if step == 50 else 0.02
        samples.append((t, step, 0))
    fault_start = samples[49][0] + 0.01 - T0
    track = RankTrack(samples=samples, last={"step": 99, "done": True, "params_sha256": "a"})
    facts = _facts({0: track, 1: track})
    facts.faults[0].fired_s, facts.faults[0].stopped_s = fault_start, fault_start + 1.9
    sm = build_report(_scenario("max_slowdown = 2.0"), facts)["step_ms"]
    assert sm["during_ms"] is not None and sm["during_ms"] > 1000.0
    assert sm["slowdown"] > 50


@pytest.mark.timeout(10)
def test_a_kill_counts_the_recovery_that_ends_after_it_fired() -> None:
    # A kill is over the moment it fires: its window runs to the next fault (none).
    tracks = {r: _track(20.0, 20.0, fault_s=1.0, end_step=100) for r in range(2)}
    facts = _facts(tracks, events=[
        {"ts": T0 + 1.02, "kind": "rank.lost", "rank": 0},
        {"ts": T0 + 4.5, "kind": "recovery.finished", "duration_ms": 3400.0},
    ])  # fmt: skip
    kill = FaultRecord(
        index=0, kind="kill", params={"rank": 1}, at_step=20, at_s=None, duration_s=None,
        fired_s=1.0, fired_step=20, stopped_s=1.0,
    )  # fmt: skip
    facts.faults[:] = [kill]
    report = build_report(_scenario("max_recovery_s = 5.0"), facts)
    (fault,) = report["faults"]
    assert fault["detected"] == "rank.lost"
    assert fault["recovery_s"] == [pytest.approx(3.4)]


@pytest.mark.timeout(10)
def test_steps_the_survivors_replayed_count_once_per_recovery() -> None:
    events = [
        {"kind": "step.replayed", "epoch": 1, "replayed": 1},
        {"kind": "step.replayed", "epoch": 1, "replayed": 2},
        {"kind": "step.replayed", "epoch": 2, "replayed": 1},
    ]
    assert replayed_by_survivors(events) == 3


@pytest.mark.timeout(10)
def test_a_fault_with_its_own_detection_bound_gets_its_own_row() -> None:
    tracks = {r: _track(20.0, 20.0, fault_s=1.0, end_step=100) for r in range(2)}
    events = [{"ts": T0 + 1.8, "kind": "link.degraded", "rank": 0}]  # 800 ms after firing
    facts = _facts(tracks, events=events)
    facts.faults[0].max_detect_ms = 1000.0
    report = build_report(_scenario("max_detect_ms = 100.0"), facts)
    rows = {r["name"]: r for r in report["expectations"]}
    # The scenario-wide bound covers no fault here, so only the fault's own row counts.
    assert "max_detect_ms" not in rows
    assert rows["fault[0].max_detect_ms"]["passed"] is True
    assert rows["fault[0].max_detect_ms"]["measured"] == pytest.approx(800.0, abs=1.0)
    facts.faults[0].max_detect_ms = 500.0
    assert build_report(_scenario("max_detect_ms = 100.0"), facts)["passed"] is False


@pytest.mark.timeout(10)
def test_ranks_the_launcher_left_out_do_not_count_against_completion() -> None:
    tracks = {r: _track(20.0, 20.0, fault_s=1.0, end_step=100) for r in range(3)}
    tracks[2] = _track(20.0, 20.0, fault_s=1.0, end_step=40)
    tracks[2].last["done"] = False
    left = [{"ts": T0 + 1.1, "kind": "rank.lost", "rank": 2, "left": True}]
    report = build_report(
        _scenario("completes = true\nparams_equal_across_ranks = true", nproc=3),
        _facts(tracks, events=left),
    )
    assert report["passed"] is True and report["steps"]["left_out"] == [2]
    # Without the launcher's word, a rank that stopped early fails the run.
    report = build_report(_scenario("completes = true", nproc=3), _facts(tracks, events=[]))
    assert report["passed"] is False


@pytest.mark.timeout(10)
def test_params_close_fault_free_passes_within_the_tolerance_and_fails_beyond_it() -> None:
    ref = {"params_sha256": "other", "params_stats": [100.0, 10.0, 4.0, 2.0]}

    def verdict(stats: list[list[float] | None]) -> dict[str, Any]:
        tracks = {r: _track(20.0, 20.0, fault_s=1.0, end_step=100) for r in range(2)}
        for r, s in enumerate(stats):
            tracks[r].last["params_stats"] = s
        report = build_report(
            _scenario("params_close_fault_free = 1e-3"), _facts(tracks, reference=ref)
        )
        (row,) = [r for r in report["expectations"] if r["name"] == "params_close_fault_free"]
        return row

    close = verdict([[100.01, 10.0, 4.0, 2.0], [100.0, 10.0, 4.0, 2.0001]])
    assert close["passed"] is True
    assert close["measured"] == pytest.approx(1e-4)
    far = verdict([[100.0, 10.0, 4.0, 2.0], [100.0, 10.0, 4.1, 2.0]])
    assert far["passed"] is False
    assert far["measured"] == pytest.approx(0.025)
    missing = verdict([[100.0, 10.0, 4.0, 2.0], None])
    assert missing["passed"] is False and missing["note"]
