"""The chaos report's arithmetic and verdicts, on hand-made run facts."""

from __future__ import annotations

import json
from typing import Any, cast

import pytest

from chaos._progress_watch import ProgressWatch, RankTrack
from chaos.attribution import (
    Attribution,
    Target,
    attribute,
    fault_target,
    names_target,
    unrelated_summary,
)
from chaos.recovery_time import recovery_time
from chaos.report import (
    FaultRecord,
    RunFacts,
    build_report,
    render,
    replayed_by_survivors,
    steps_replayed,
)
from chaos.scenario import parse
from resilient.progress import StepReporter

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
    tracks[1] = _track(20.0, 20.0, fault_s=1.0, end_step=30)  # stopped before the fault
    text = "max_detect_ms = 100.0\nmax_recovery_s = 5.0\nparams_equal_fault_free = true"
    report = build_report(_scenario(text), _facts(tracks))
    rows = {r["name"]: r for r in report["expectations"]}
    for name in ("max_detect_ms", "max_recovery_s", "params_equal_fault_free"):
        assert rows[name]["passed"] is False
        assert rows[name]["note"]
    assert report["faults"][0]["recovery_s"] is None


@pytest.mark.timeout(10)
def test_detection_and_recovery_come_from_the_event_log_and_the_steps() -> None:
    tracks = {r: _track(20.0, 20.0, fault_s=1.0, end_step=100) for r in range(2)}
    events = [
        {"ts": T0 + 1.05, "kind": "link.down", "rank": 0, "links": [[0, 1, 0]]},
        {"ts": T0 + 1.2, "kind": "link.rerouted", "rank": 0},
        {"ts": T0 + 1.5, "kind": "recovery.finished", "duration_ms": 450.0},
        {"ts": T0 + 9.0, "kind": "link.down", "links": [[0, 1, 0]]},  # after the fault: not counted
    ]
    text = "max_detect_ms = 100.0\nmax_recovery_s = 1.0"
    report = build_report(_scenario(text), _facts(tracks, events=events))
    (fault,) = report["faults"]
    assert fault["detected"] == "link.down"
    assert fault["detect_ms"] == pytest.approx(50.0, abs=1.0)
    assert fault["detection"]["rank"] == 0 and fault["unrelated"]["count"] == 0
    assert fault["actions"] == ["link.rerouted", "recovery.finished"]
    # Both ranks step every 20 ms: the next step after the fault ends it; the
    # library's own span (here a made-up 450 ms) is shown beside it.
    assert fault["recovery_s"] == pytest.approx(0.02, abs=0.021)
    assert fault["library_recovery_s"] == pytest.approx(0.45)
    assert report["passed"] is True
    assert "library span 0.45 s" in render(report)


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
        {"ts": T0 + 1.02, "kind": "rank.lost", "rank": 1},
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
    assert fault["library_recovery_s"] == pytest.approx(3.4)


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
    # 800 ms after firing: rank 1's rail 0 fell under half its share.
    events = [{"ts": T0 + 1.8, "kind": "link.degraded", "rank": 1, "links": [[1, -1, 0]]}]
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


# Attribution: which event detected a fault (chaos.attribution), on synthetic logs.


def _ev(ts: float, kind: str, rank: int, *links: list[int], **extra: Any) -> dict[str, Any]:
    return {"ts": T0 + ts, "kind": kind, "rank": rank, "links": list(links), **extra}


def _detect(kind: str, params: dict[str, Any], events: list[dict[str, Any]]) -> Attribution:
    return attribute(kind, params, events, start=T0 + 1.0, stop=T0 + 5.0)


@pytest.mark.timeout(10)
def test_an_earlier_event_that_names_another_link_is_unrelated_not_the_detection() -> None:
    nic = {"rank": 1, "rail": 0}
    events = [
        _ev(0.5, "link.down", 0, [0, 1, 0]),  # before the fault fired: not considered
        _ev(1.01, "link.down", 2, [2, 3, 0]),  # another pair on the same rail
        _ev(1.02, "nic.down", 0, [0, -1, 0]),  # another host's NIC
        _ev(1.03, "link.down", 0, [0, 1, 1]),  # the right pair, the other rail
        _ev(1.04, "link.rerouted", 0, [0, 1, 0]),  # names it, but not a detection kind
        _ev(1.2, "link.down", 0, [0, 1, 0]),
    ]
    att = _detect("nic-down", nic, events)
    assert att.detection is events[-1]
    assert [e["ts"] for e in att.unrelated] == [T0 + 1.01, T0 + 1.02, T0 + 1.03]
    summary = unrelated_summary(att, T0 + 1.0)
    assert summary["count"] == 3 and len(summary["first"]) == 3
    assert summary["first"][0] == {
        "kind": "link.down", "rank": 2, "links": [[2, 3, 0]], "after_ms": pytest.approx(10.0),
    }  # fmt: skip


@pytest.mark.timeout(10)
def test_the_report_takes_the_named_event_and_lists_the_unrelated_one() -> None:
    tracks = {r: _track(20.0, 20.0, fault_s=1.0, end_step=100) for r in range(2)}
    events = [
        _ev(1.01, "link.degraded", 0, [0, -1, 1]),  # rank 0's rail 1: not the throttled one
        _ev(1.4, "link.degraded", 1, [1, -1, 0]),
    ]
    report = build_report(_scenario("max_detect_ms = 100.0"), _facts(tracks, events=events))
    (fault,) = report["faults"]
    assert fault["detect_ms"] == pytest.approx(400.0, abs=1.0)
    assert fault["unrelated"]["count"] == 1
    assert report["passed"] is False  # the unrelated event at 10 ms does not count
    text = render(report)
    assert "detected link.degraded (rank 1) after 400 ms (1 unrelated)" in text
    # Without the named event the fault goes undetected, and the note says why.
    report = build_report(_scenario("max_detect_ms = 100.0"), _facts(tracks, events=events[:1]))
    (row,) = [r for r in report["expectations"] if r["name"] == "max_detect_ms"]
    assert row["measured"] is None and "named other ranks or links" in row["note"]


@pytest.mark.timeout(10)
def test_a_link_named_in_the_reverse_direction_counts() -> None:
    cut = {"rank": 1, "peer": 2, "rail": 0}
    events = [_ev(1.1, "link.down", 3, [3, 2, 0]), _ev(1.3, "link.down", 2, [2, 1, 0])]
    att = _detect("partition", cut, events)
    assert att.detection is events[1] and att.unrelated == [events[0]]
    forward = [_ev(1.2, "link.degraded", 1, [1, 2, 0])]
    assert _detect("partition", cut, forward).detection is forward[0]


@pytest.mark.timeout(10)
def test_a_rail_wide_event_of_either_end_counts_for_a_link_fault_on_that_rail() -> None:
    cut = {"rank": 1, "peer": 2, "rail": 1}
    wide = _ev(1.1, "link.degraded", 2, [2, -1, 1])  # rank 2's whole rail 1
    assert _detect("partition", cut, [wide]).detection is wide
    other_rail = _ev(1.1, "nic.down", 1, [1, -1, 0])
    third_rank = _ev(1.1, "nic.down", 3, [3, -1, 1])
    att = _detect("partition", cut, [other_rail, third_rank])
    assert att.detection is None and len(att.unrelated) == 2
    # Every rail (-1) includes the faulted one: rank 1 found slow on all its links.
    every = _ev(1.1, "link.degraded", 0, [1, -1, -1])
    assert _detect("throttle", {"rank": 1, "rail": 1, "rate_mbit": 10.0}, [every]).detection
    # A NIC fault hits every link of the rank on the rail: a peer's link to it counts.
    peer_side = _ev(1.1, "link.down", 3, [3, 1, 1])
    assert _detect("nic-down", {"rank": 1, "rail": 1}, [peer_side]).detection is peer_side


@pytest.mark.timeout(10)
def test_a_kill_or_hang_is_detected_by_events_that_name_the_rank() -> None:
    kill = {"rank": 2}
    other = _ev(1.01, "link.down", 0, [0, 3, 1])  # another rank's link broke first
    launcher = _ev(1.05, "rank.lost", 2)  # the launcher writes it about the lost rank
    att = _detect("kill", kill, [other, launcher])
    assert att.detection is launcher and att.unrelated == [other]
    survivor = _ev(1.03, "link.down", 1, [1, 2, 0])  # a survivor's link to rank 2
    assert _detect("kill", kill, [other, survivor, launcher]).detection is survivor
    # A rank that is only the writer of a rail-wide event (peer -1) is not named.
    assert _detect("kill", kill, [_ev(1.02, "link.down", 0, [0, -1, 0])]).detection is None
    suspected = _ev(1.5, "straggler.suspected", 2)  # ``rank``: the straggler
    wrong = _ev(1.2, "straggler.suspected", 3)
    att = _detect("hang", kill, [wrong, suspected])
    assert att.detection is suspected and att.unrelated == [wrong]


@pytest.mark.timeout(10)
def test_fault_targets() -> None:
    assert fault_target("kill", {"rank": 2}) == Target(2)
    assert fault_target("slow", {"rank": 1, "factor": 0.5}) == Target(1)
    assert fault_target("nic-down", {"rank": 1, "rail": 0}) == Target(1, (1, -1, 0))
    assert fault_target("partition", {"rank": 1, "peer": 3, "rail": 1}) == Target(1, (1, 3, 1))
    assert fault_target("etcd-kill", {"member": 0}) is None
    assert not names_target({"links": [["x", 1]]}, Target(1, (1, -1, 0)))  # malformed
    assert names_target({"straggler": 3, "kind": "policy.decision"}, Target(3))


# Recovery time: from the fault to the first step past it on every rank.


def _commits(*pairs: tuple[float, int], inc: int = 0) -> list[tuple[float, int, int]]:
    return [(T0 + ts, step, inc) for ts, step in pairs]


@pytest.mark.timeout(10)
def test_recovery_runs_from_the_fault_to_every_rank_past_the_interrupted_step() -> None:
    # Step 40 done by all before the kill at t=1.0; rank 2's replacement (incarnation
    # 1) restores step 40 and replays it at 3.0 (not progress), then does 41 at 3.4;
    # the survivors redo step 41 at 3.3.
    survivor = _commits((0.9, 39), (0.95, 40), (3.3, 41), (3.35, 42))
    progress = {
        0: RankTrack(commits=survivor),
        1: RankTrack(commits=survivor),
        2: RankTrack(commits=_commits((0.9, 39), (0.96, 40)) + _commits(
            (3.0, 40), (3.4, 41), (3.45, 42), inc=1
        )),
    }  # fmt: skip
    rec = recovery_time(progress, T0 + 1.0, [0, 1, 2])
    assert rec.step == 41 and rec.seconds == pytest.approx(2.4)
    # A rank the job shrank without is not waited for; its steps still set S.
    rec = recovery_time(progress, T0 + 1.0, [0, 1])
    assert rec.seconds == pytest.approx(2.3)
    # A rank that never gets past the interrupted step: nothing to measure.
    progress[1] = RankTrack(commits=_commits((0.95, 40)))
    assert recovery_time(progress, T0 + 1.0, [0, 1, 2]).seconds is None
    # No commits at all: samples stand in (hand-made tracks, older records).
    assert recovery_time({0: RankTrack(samples=survivor)}, T0 + 1.0, [0]).seconds == (
        pytest.approx(2.3)
    )


@pytest.mark.timeout(10)
def test_max_recovery_s_checks_the_time_from_the_fault_not_the_library_span() -> None:
    tracks = {r: _track(20.0, 20.0, fault_s=1.0, end_step=100) for r in range(2)}
    for track in tracks.values():  # nothing finished from the fault until t=7.0
        track.samples = [(ts + (6.0 if ts > T0 + 1.0 else 0.0), s, i) for ts, s, i in track.samples]
    events = [{"ts": T0 + 6.5, "kind": "recovery.finished", "duration_ms": 1000.0}]
    facts = _facts(tracks, events=events)
    facts.faults[:] = [
        FaultRecord(
            index=0, kind="kill", params={"rank": 1}, at_step=20, at_s=None, duration_s=None,
            fired_s=1.0, fired_step=20, stopped_s=1.0,
        )
    ]  # fmt: skip
    report = build_report(_scenario("max_recovery_s = 5.0"), facts)
    (fault,) = report["faults"]
    assert fault["library_recovery_s"] == pytest.approx(1.0)
    assert fault["recovery_s"] == pytest.approx(6.0, abs=0.05)
    (row,) = [r for r in report["expectations"] if r["name"] == "max_recovery_s"]
    assert row["passed"] is False and row["measured"] == fault["recovery_s"]


@pytest.mark.timeout(10)
def test_the_watch_reads_step_commits_from_the_records() -> None:
    watch = ProgressWatch.__new__(ProgressWatch)  # no etcd: only the parsing is under test
    watch.ranks = {}
    record = {"rank": 0, "incarnation": 1, "step": 5, "ts": T0 + 5.0}
    watch._record(json.dumps({**record, "commits": [[4, T0 + 4.0], [5, T0 + 5.0]]}).encode())
    # The next record repeats step 5 and adds 6 and 7 (the record of 6 was missed).
    listed = [[5, T0 + 5.0], [6, T0 + 6.0], [7, T0 + 7.0]]
    watch._record(json.dumps({**record, "step": 7, "ts": T0 + 7.0, "commits": listed}).encode())
    watch._record(json.dumps({**record, "step": 8, "ts": T0 + 8.0}).encode())  # older writer
    assert watch.ranks[0].commits == [(T0 + t, t, 1) for t in (4, 5, 6, 7, 8)]
    assert [s for _, s, _ in watch.ranks[0].samples] == [5, 7, 8]


@pytest.mark.timeout(10)
def test_each_progress_record_carries_the_newest_commit_times() -> None:
    class Client:
        def __init__(self) -> None:
            self.puts: list[dict[str, Any]] = []

        def put(self, key: str, value: str) -> None:
            self.puts.append(json.loads(value))

        def close(self) -> None:
            pass

    client = Client()
    reporter = StepReporter(cast(Any, client), job="j", rank=0, min_interval_s=60.0)
    for step in range(20):
        reporter.step(step)
    reporter.finish()
    final = client.puts[-1]
    assert [s for s, _ in final["commits"]] == list(range(4, 20))  # the newest 16
    times = [t for _, t in final["commits"]]
    assert times == sorted(times) and final["commits"][-1][0] == final["step"] == 19


@pytest.mark.timeout(10)
def test_a_detection_bound_in_steps_counts_the_steps_from_the_fault() -> None:
    # A step every 20 ms: the fault fired at 1.0 s with step 49 done, rank 1's rail 0
    # was reported degraded 200 ms later, when the ranks had reached step 59.
    tracks = {r: _track(20.0, 20.0, fault_s=1.0, end_step=100) for r in range(2)}
    events = [{"ts": T0 + 1.2, "kind": "link.degraded", "rank": 1, "links": [[1, -1, 0]]}]
    facts = _facts(tracks, events=events)
    facts.faults[0].fired_step = 49
    report = build_report(_scenario("max_detect_steps = 20"), facts)
    (row,) = [r for r in report["expectations"] if r["name"] == "max_detect_steps"]
    assert report["faults"][0]["detect_steps"] == 10
    assert (row["measured"], row["passed"]) == (10, True)
    assert build_report(_scenario("max_detect_steps = 9"), facts)["passed"] is False
    # Another rank's trouble is no detection of this fault: unmeasured, failed, said why.
    facts.events[:] = [{**events[0], "rank": 0, "links": [[0, -1, 1]]}]
    report = build_report(_scenario("max_detect_steps = 20"), facts)
    (row,) = [r for r in report["expectations"] if r["name"] == "max_detect_steps"]
    assert (row["measured"], row["passed"]) == (None, False)
    assert "named other ranks or links" in row["note"]
