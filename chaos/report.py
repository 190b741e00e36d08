"""The chaos report: what was injected, what the library saw and did, what held.

:func:`build_report` turns the raw facts of a run (fault firing times, the ranks'
progress samples, the launcher's exit code, the recovery event log, the fault-free
reference) into a JSON-able dict; :func:`render` (:mod:`chaos.report_text`) prints
it for people. Every expectation of the scenario becomes one row with the measured
value; a value that could not be measured (no event log yet, no reference) fails
the expectation and says why, it never passes by default. A fault's detection is
attributed by :mod:`chaos.attribution`, its recovery time measured by
:mod:`chaos.recovery_time`.
"""

from __future__ import annotations

import statistics
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Final

from chaos import _fast_path
from chaos._progress_watch import RankTrack
from chaos.attribution import DETECT_KINDS, attribute, event_summary, unrelated_summary
from chaos.recovery_time import recovery_time
from chaos.report_text import render
from chaos.scenario import NODE_KINDS, Scenario

__all__ = ["DETECT_KINDS", "FaultRecord", "RunFacts", "build_report", "render"]

# 2: a fault's ``recovery_s`` is the time from the fault to training again (one
# number; it was the list of the library's spans, now ``library_recovery_s``), and
# its detection names what it hit (``detection``, ``unrelated``).
REPORT_VERSION: Final = 2
ACTION_KINDS: Final = frozenset(
    {
        "link.rerouted",
        "link.repaired",
        "state.restored",
        "step.replayed",
        "epoch.changed",
        "recovery.started",
        "recovery.finished",
        "straggler.confirmed",
        "rank.joined",
    }
)
# Steps skipped at the start when measuring step times (warm-up, link setup).
_WARMUP_STEPS: Final = 2
# Links are built on first use and a call's first steps start its threads: counts
# are compared from here on.
_RESOURCE_WARMUP_STEPS: Final = 20


@dataclass(kw_only=True, slots=True)
class FaultRecord:
    """One fault of the scenario and what happened to it during the run."""

    index: int
    kind: str
    params: dict[str, Any]
    at_step: int | None
    at_s: float | None
    duration_s: float | None
    max_detect_ms: float | None = None  # this fault's own bound (else the scenario's)
    fired_s: float | None = None
    fired_step: int | None = None
    stopped_s: float | None = None
    error: str | None = None
    detail: dict[str, Any] = field(default_factory=dict)


@dataclass(kw_only=True, slots=True)
class RunFacts:
    """Raw facts of one run; times are seconds since the job started (``t0``)."""

    t0: float
    duration_s: float
    exit_code: int | None
    timed_out: bool
    faults: list[FaultRecord]
    progress: dict[int, RankTrack]
    events: list[dict[str, Any]]
    reference: dict[str, Any] | None
    out_dir: str | None = None
    # etcd keys the run left outside its jobs' prefixes (read before etcd stops).
    stray_keys: list[str] = field(default_factory=list)


def _ms_per_step(
    samples: Sequence[tuple[float, int, int]], lo: float, hi: float, *, bracket: bool = False
) -> float | None:
    """Mean time per step (ms) between the first and last sample in ``[lo, hi]``.

    With ``bracket`` the last sample before ``lo`` and the first after ``hi`` are
    included, so a window in which the job stalled (no sample inside) still
    measures the stall instead of nothing.
    """
    usable = [(ts, step) for ts, step, _ in samples if step >= _WARMUP_STEPS]
    window = [(ts, step) for ts, step in usable if lo <= ts <= hi]
    if bracket:
        before = [x for x in usable if x[0] < lo][-1:]
        after = [x for x in usable if x[0] > hi][:1]
        window = before + window + after
    if len(window) < 2 or window[-1][1] <= window[0][1]:
        return None
    (t1, s1), (t2, s2) = window[0], window[-1]
    return (t2 - t1) * 1e3 / (s2 - s1)


def step_times(facts: RunFacts) -> dict[str, float | None]:
    """Median over ranks of ms/step before the first fault and while faults were active."""
    fired = [f.fired_s for f in facts.faults if f.fired_s is not None]
    first = facts.t0 + min(fired) if fired else facts.t0 + facts.duration_s
    ends = [
        f.stopped_s if f.stopped_s is not None else facts.duration_s
        for f in facts.faults
        if f.fired_s is not None
    ]
    last = facts.t0 + (max(ends) if ends else facts.duration_s)

    def med(lo: float, hi: float, bracket: bool = False) -> float | None:
        vals = [
            v
            for t in facts.progress.values()
            if (v := _ms_per_step(t.samples, lo, hi, bracket=bracket))
        ]
        return statistics.median(vals) if vals else None

    before = med(facts.t0, first)
    during = med(first, last, bracket=True) if fired else None
    slowdown = during / before if before and during else None
    return {"before_ms": before, "during_ms": during, "slowdown": slowdown}


def steps_replayed(progress: Mapping[int, RankTrack]) -> int:
    """Steps done twice: when a rank comes back (new incarnation) at a step it already did."""
    total = 0
    for track in progress.values():
        best: dict[int, int] = {}
        prev_inc: int | None = None
        for _, step, inc in track.samples:
            if prev_inc is not None and inc != prev_inc:
                done_before = max((s for i, s in best.items() if i < inc), default=-1)
                total += max(0, done_before - step + 1)
            best[inc] = max(best.get(inc, -1), step)
            prev_inc = inc
    return total


def replayed_by_survivors(events: Sequence[Mapping[str, Any]]) -> int:
    """Steps the running ranks redid after recoveries: per new epoch, the most any
    rank reported in ``step.replayed`` (``replayed``), summed over epochs."""
    worst: dict[int, int] = {}
    for e in events:
        if e.get("kind") == "step.replayed":
            epoch = int(e.get("epoch", 0))
            worst[epoch] = max(worst.get(epoch, 0), int(e.get("replayed", 1)))
    return sum(worst.values())


def _window_end(fault: FaultRecord, faults: Sequence[FaultRecord]) -> float | None:
    """Where a fault's detections and actions stop counting: when it was undone;
    for one without a duration (kill, hang), when the next fault that events can
    name fired, if any (an etcd fault, which none names, claims no event)."""
    if fault.duration_s is not None or fault.fired_s is None:
        return fault.stopped_s
    later = [
        g.fired_s for g in faults
        if g.fired_s is not None and g.fired_s > fault.fired_s and DETECT_KINDS.get(g.kind)
    ]  # fmt: skip
    return min(later, default=None)


def _events_for(fault: FaultRecord, facts: RunFacts, until: float | None) -> dict[str, Any]:
    """A fault's detection (:mod:`chaos.attribution`), the actions logged in its
    window, its recovery time (:mod:`chaos.recovery_time`) and, beside it, the
    library's own longest ``recovery.finished`` span in the window."""
    if fault.fired_s is None:
        return {}
    start = facts.t0 + fault.fired_s
    stop = facts.t0 + until if until is not None else float("inf")
    after = [e for e in facts.events if start <= float(e.get("ts", 0.0)) < stop]
    att = attribute(fault.kind, fault.params, after, start=start, stop=stop)
    detect = att.detection
    spans = [
        float(e["duration_ms"]) / 1e3
        for e in after
        if e.get("kind") == "recovery.finished" and e.get("duration_ms") is not None
    ]
    training = set(facts.progress) - _left(facts)
    recovery = recovery_time(facts.progress, start, sorted(training))
    return {
        "detected": detect.get("kind") if detect else None,
        "detect_ms": (float(detect["ts"]) - start) * 1e3 if detect else None,
        "detect_steps": _steps_from(facts, fault, float(detect["ts"])) if detect else None,
        "detection": event_summary(detect, start) if detect else None,
        "unrelated": unrelated_summary(att, start),
        "actions": sorted({str(e.get("kind")) for e in after if e.get("kind") in ACTION_KINDS}),
        "recovery_s": recovery.seconds,
        "recovery_step": recovery.step,
        "library_recovery_s": max(spans, default=None),
    }


def _final_hashes(progress: Mapping[int, RankTrack]) -> dict[int, str | None]:
    return {r: t.last.get("params_sha256") if t.done else None for r, t in progress.items()}


def _final_stats(progress: Mapping[int, RankTrack]) -> dict[int, list[float] | None]:
    return {r: t.last.get("params_stats") if t.done else None for r, t in progress.items()}


def left_out(events: Sequence[Mapping[str, Any]], node_lost: Iterable[int] = ()) -> set[int]:
    """Ranks the job shrank without: those the launcher left out after a loss, and
    of ``node_lost`` (the ranks of nodes a fault killed or cut off, whose agent
    could say nothing) those outside the newest epoch's members."""
    left = {int(e["rank"]) for e in events if e.get("kind") == "rank.lost" and e.get("left")}
    epochs = [e for e in events if e.get("kind") == "epoch.changed" and "members" in e]
    if epochs:
        newest = max(epochs, key=lambda e: int(e.get("epoch", 0)))
        left |= set(node_lost) - {int(r) for r in newest["members"]}
    return left


def _left(facts: RunFacts) -> set[int]:
    lost = [
        int(r) for f in facts.faults
        if f.kind in NODE_KINDS and f.fired_s is not None for r in f.params.get("ranks", ())
    ]  # fmt: skip
    return left_out(facts.events, lost)


def _completes(facts: RunFacts, steps: int, nproc: int) -> bool:
    """Every rank (but those the job shrank without) finished all steps, exit 0."""
    left = _left(facts)
    done = [
        r for r, t in facts.progress.items() if t.done and t.step >= steps - 1 and r not in left
    ]
    return facts.exit_code == 0 and not facts.timed_out and len(done) == nproc - len(left)


def _row(name: str, expected: Any, measured: Any, passed: bool, note: str = "") -> dict[str, Any]:
    return {
        "name": name,
        "expected": expected,
        "measured": measured,
        "passed": passed,
        "note": note,
    }


def _check(scenario: Scenario, facts: RunFacts, summary: dict[str, Any]) -> list[dict[str, Any]]:
    exp = scenario.expect
    rows = [
        _row(
            "completes", exp.completes, summary["completes"], summary["completes"] == exp.completes
        )
    ]
    if exp.max_steps_replayed is not None:
        n = summary["steps_replayed"]
        rows.append(
            _row(
                "max_steps_replayed",
                exp.max_steps_replayed,
                n,
                summary["completes"] and n <= exp.max_steps_replayed,
                "" if summary["completes"] else "the job did not complete",
            )
        )
    left = set(summary["left_out"])
    hashes = [h for r, h in summary["params_sha256"].items() if r not in left]
    expected = scenario.job.nproc - len(left)
    equal = len(hashes) == expected and None not in hashes and len(set(hashes)) == 1
    if exp.params_equal_across_ranks is not None:
        rows.append(
            _row(
                "params_equal_across_ranks",
                exp.params_equal_across_ranks,
                equal,
                equal == exp.params_equal_across_ranks,
            )
        )
    if exp.params_equal_fault_free is not None:
        ref = (facts.reference or {}).get("params_sha256")
        same = equal and ref is not None and hashes[0] == ref
        note = "" if ref else "no fault-free reference result"
        rows.append(
            _row(
                "params_equal_fault_free",
                exp.params_equal_fault_free,
                same,
                same == exp.params_equal_fault_free,
                note,
            )
        )
    if exp.params_close_fault_free is not None:
        rows.append(_close_row(exp.params_close_fault_free, facts, summary, left))
    rows.extend(_timing_rows(scenario, summary))
    fast = summary["fast_path"]
    passed, note = _fast_path.verdict(fast, exp.min_fast_path_share)
    share = fast["outside_faults"]["share"]
    rows.append(_row("min_fast_path_share", exp.min_fast_path_share, share, passed, note))
    return rows


def _fault_windows(facts: RunFacts) -> list[tuple[float, float]]:
    """Each fired fault's window in absolute time, from firing to :func:`_window_end`
    (the end of the run where it has none)."""
    out = []
    for f in facts.faults:
        if f.fired_s is not None:
            end = _window_end(f, facts.faults)
            out.append((facts.t0 + f.fired_s, facts.t0 + end if end is not None else float("inf")))
    return out


def _close_row(
    tol: float, facts: RunFacts, summary: dict[str, Any], left: set[int]
) -> dict[str, Any]:
    """Every finishing rank's per-tensor parameter norms (L1, L2) within ``tol``
    (relative) of the fault-free run's; measured: the largest relative difference."""
    ref = (facts.reference or {}).get("params_stats")
    stats = [s for r, s in summary["params_stats"].items() if r not in left]
    worst: float | None = None
    note = ""
    if not ref:
        note = "no fault-free reference result"
    elif not stats or any(s is None or len(s) != len(ref) for s in stats):
        note = "a rank reported no parameter statistics"
    else:
        worst = max(
            abs(a - b) / max(abs(b), 1e-12) for s in stats for a, b in zip(s, ref, strict=True)
        )
    passed = worst is not None and worst <= tol
    return _row("params_close_fault_free", tol, worst, passed, note)


def _timing_rows(scenario: Scenario, summary: dict[str, Any]) -> list[dict[str, Any]]:
    exp, rows = scenario.expect, []
    no_log = "" if summary["events"] else "no recovery event log: the library reported nothing"
    if exp.max_slowdown is not None:
        slow = summary["step_ms"]["slowdown"]
        ok, why = slow is not None and slow <= exp.max_slowdown, "too few step samples"
        rows.append(
            _row("max_slowdown", exp.max_slowdown, slow, ok, "" if slow is not None else why)
        )
    fired = [f for f in summary["faults"] if f.get("fired_s") is not None]
    if exp.max_detect_steps is not None:
        steps = [f.get("detect_steps") for f in fired]
        worst = None if not steps or None in steps else max(steps)
        ok = worst is not None and worst <= exp.max_detect_steps
        note = no_log or _undetected_note(fired) or ("no fault fired" if not fired else "")
        rows.append(_row("max_detect_steps", exp.max_detect_steps, worst, ok, note))
    own = [f for f in fired if f.get("max_detect_ms") is not None]
    if exp.max_detect_ms is not None and (len(own) < len(fired) or not fired):
        shared = [f for f in fired if f.get("max_detect_ms") is None]
        lat = [f["detect_ms"] for f in shared]
        worst = None if not lat or None in lat else max(lat)
        rows.append(
            _row(
                "max_detect_ms",
                exp.max_detect_ms,
                worst,
                worst is not None and worst <= exp.max_detect_ms,
                no_log or _undetected_note(shared),
            )
        )
    for f in own:
        bound, ms = f["max_detect_ms"], f["detect_ms"]
        name = f"fault[{f['index']}].max_detect_ms"
        note = no_log or _undetected_note([f])
        rows.append(_row(name, bound, ms, ms is not None and ms <= bound, note))
    if exp.max_recovery_s is not None:
        rows.append(_recovery_row(exp.max_recovery_s, fired))
    if exp.straggler_confirmed_within_steps is not None:
        rows.append(_straggler_row(scenario, summary, no_log))
    return rows


def _undetected_note(faults: Sequence[Mapping[str, Any]]) -> str:
    """Why faults count as undetected where events of a fitting kind were logged:
    none of them named what the fault hit (:mod:`chaos.attribution`)."""
    parts = [
        f"fault[{f['index']}]: {n} event(s) of a fitting kind named other ranks or links"
        for f in faults
        if f.get("detect_ms") is None and (n := (f.get("unrelated") or {}).get("count"))
    ]
    return "; ".join(parts)


def _recovery_row(bound: float, fired: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """The longest fault-to-training-again time over the fired faults; a fault the
    job never trained past (or none fired) leaves nothing to measure."""
    times = [float(f["recovery_s"]) for f in fired if f.get("recovery_s") is not None]
    missing = [f["index"] for f in fired if f.get("recovery_s") is None]
    worst = max(times) if times and not missing else None
    note = ""
    if not fired:
        note = "no fault fired"
    elif missing:
        note = f"no step finished by every rank after fault(s) {missing}"
    return _row("max_recovery_s", bound, worst, worst is not None and worst <= bound, note)


def _straggler_row(scenario: Scenario, summary: dict[str, Any], note: str) -> dict[str, Any]:
    limit = scenario.expect.straggler_confirmed_within_steps
    confirmed = summary.get("straggler_confirmed_after_steps")
    ok = confirmed is not None and limit is not None and confirmed <= limit
    return _row("straggler_confirmed_within_steps", limit, confirmed, ok, note)


def build_report(scenario: Scenario, facts: RunFacts, *, source: str = "") -> dict[str, Any]:
    """The report of one run as a JSON-able dict (see the module docstring)."""
    faults = []
    for f in facts.faults:
        entry = asdict(f)
        entry.update(_events_for(f, facts, _window_end(f, facts.faults)))
        faults.append(entry)
    completed = {r: t.step + 1 for r, t in sorted(facts.progress.items())}
    summary: dict[str, Any] = {
        "completes": _completes(facts, scenario.job.steps, scenario.job.nproc),
        "steps_replayed": max(steps_replayed(facts.progress), replayed_by_survivors(facts.events)),
        "params_sha256": _final_hashes(facts.progress),
        "params_stats": _final_stats(facts.progress),
        "left_out": sorted(_left(facts)),
        "step_ms": step_times(facts),
        "events": len(facts.events),
        "faults": faults,
        "straggler_confirmed_after_steps": _straggler_confirmed(facts),
        "fast_path": _fast_path.fast_path(
            facts.progress, _fault_windows(facts), rails=scenario.job.rails
        ),
    }
    rows = _check(scenario, facts, summary)
    return {
        "report_version": REPORT_VERSION,
        "scenario": scenario.name,
        "source": source,
        "topology": scenario.job.topology,
        "passed": all(r["passed"] for r in rows),
        "exit_code": facts.exit_code,
        "timed_out": facts.timed_out,
        "duration_s": round(facts.duration_s, 3),
        "steps": {
            "target": scenario.job.steps,
            "completed": completed,
            "replayed": summary["steps_replayed"],
            "left_out": summary["left_out"],
        },
        "step_ms": summary["step_ms"],
        "fast_path": summary["fast_path"],
        "params_sha256": summary["params_sha256"],
        "reference": facts.reference,
        "faults": faults,
        "events": len(facts.events),
        "expectations": rows,
        "resources": resource_growth(facts.progress),
        "etcd_stray_keys": facts.stray_keys,
        "out_dir": facts.out_dir,
    }


def resource_growth(progress: dict[int, RankTrack]) -> dict[str, dict[str, list[int]]]:
    """Per rank, its newest incarnation's open fds and threads ``[first, last]``
    from the records after the warm-up steps (a leak grows between the two)."""
    out: dict[str, dict[str, list[int]]] = {}
    for rank, track in sorted(progress.items()):
        if not track.resources:
            continue
        newest = track.resources[-1][1]
        rows = [r for r in track.resources if r[1] == newest and r[2] >= _RESOURCE_WARMUP_STEPS]
        if len(rows) >= 2:
            out[str(rank)] = {
                "fds": [rows[0][3], rows[-1][3]],
                "threads": [rows[0][4], rows[-1][4]],
            }
    return out


def _straggler_confirmed(facts: RunFacts) -> int | None:
    """Training steps from the first fault to the first ``straggler.confirmed`` event
    naming the rank that fault slowed down (any rank when the fault names none)."""
    fired = [f for f in facts.faults if f.fired_s is not None and f.fired_step is not None]
    if not fired:
        return None
    start = facts.t0 + float(fired[0].fired_s or 0.0)
    slowed = fired[0].params.get("rank")
    confirmed = [
        e for e in facts.events
        if e.get("kind") == "straggler.confirmed" and float(e["ts"]) >= start
        and (slowed is None or e.get("rank") == slowed)
    ]  # fmt: skip
    return _steps_from(facts, fired[0], float(confirmed[0]["ts"])) if confirmed else None


def _steps_from(facts: RunFacts, fault: FaultRecord, when: float) -> int:
    """Steps from the one ``fault`` fired at to the furthest any rank had reached at
    ``when`` (absolute), from the progress samples."""
    reached = [s for t in facts.progress.values() for ts, s, _ in t.samples if ts <= when]
    return max(reached, default=0) - int(fault.fired_step or 0)
