"""Straggler detection, run after run: how soon a slow rank is confirmed, and how
often a clean job confirms one anyway.

    python benchmarks/stragglers.py --scenario examples/scenarios/straggler-cpu.toml --runs 20
    python benchmarks/stragglers.py --clean --seeds 20 --steps 1000

``--scenario PATH --runs N`` runs the scenario N times through ``resilient chaos
PATH --json --quiet`` (root: the netns testbed; the fault-free reference is
cached after the first run) and gives, per run: whether its report passed and
which expectations failed, the steps from the fault to the first
``straggler.confirmed`` naming the slowed rank (the report's
``straggler_confirmed_within_steps`` row; for a scenario without one, a slow
link, the steps to the fault's detection, its ``max_detect_steps`` row), the
first event that named the fault (its kind, ms and steps after the fault), and
the step-time slowdown; then the spread of those steps and how many runs met the
scenario's own bound.

``--clean --seeds S --steps T`` runs the fault-free job of the straggler
scenarios (``examples/train_ddp.py --width 256``, 4 ranks x 2 rails on the netns
testbed, the detectors on as in every run) for seeds 0..S-1 (``--first-seed F``:
F..F+S-1), T steps each, from a
scenario with no fault (made here), and counts the ``straggler.suspected`` and
``straggler.confirmed`` verdicts in its event logs: every rank runs the same
detectors on the same exchange table and logs the same verdict, so a verdict is
counted once per (kind, rank, cause, call). Every confirmation there is false.

Each run has a time limit (``--timeout-s``); SIGINT or SIGTERM stops the run in
progress with SIGTERM (``resilient chaos`` then tears its testbed down; SIGKILL
after ``STOP_GRACE_S``) and ends with what was measured so far. Prints the load
before and after, one line per run, the table, then one JSON line last.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path
from typing import Any, Final

from _common import CpuMeter, load_line, print_conditions, print_table
from _guard import SignalGuard

from resilient.events import read_events

ROOT: Final = Path(__file__).resolve().parents[1]
# How long a stopped ``resilient chaos`` gets to take its testbed down.
STOP_GRACE_S: Final = 60.0
VERDICTS: Final = ("straggler.suspected", "straggler.confirmed")
# The expectation rows whose measured value is "steps after the fault", in order.
STEP_BOUNDS: Final = ("straggler_confirmed_within_steps", "max_detect_steps")
# SIGINT/SIGTERM/SIGHUP as exceptions while main() runs (installed there).
GUARD: Final = SignalGuard()

# The job of straggler.toml / straggler-cpu.toml, without a fault.
CLEAN_SCENARIO: Final = """\
name = "stragglers-clean-s{seed}"

[job]
script = "{script}"
args = ["--width", "256", "--quiet"]
nproc = 4
rails = 2
steps = {steps}
seed = {seed}
topology = "netns"
timeout_s = {timeout_s}

[expect]
completes = true
params_equal_across_ranks = true
"""


def _chaos(path: Path, out: Path, timeout_s: float) -> dict[str, Any]:
    """One ``resilient chaos`` run: its report (the JSON line last), or ``error``."""
    argv = [sys.executable, "-m", "resilient", "chaos", str(path), "--out", str(out)]
    proc = subprocess.Popen(
        [*argv, "--json", "--quiet"], cwd=ROOT, stdout=subprocess.PIPE,
        stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        _stop(proc)
        return {"error": f"timed out after {timeout_s:g} s"}
    except BaseException:  # SIGINT/SIGTERM (SignalGuard): let it tear its testbed down
        with GUARD.shielded():  # a second signal must not cut the teardown short
            _stop(proc)
        raise
    lines = stdout.strip().splitlines()
    try:
        return dict(json.loads(lines[-1]))
    except (IndexError, ValueError):
        return {"error": f"exit {proc.returncode}: {stderr[-500:]}"}


def _stop(proc: subprocess.Popen[str]) -> None:
    """SIGTERM, then SIGKILL after STOP_GRACE_S: ``resilient chaos`` cleans up on the first."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        proc.communicate(timeout=STOP_GRACE_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.communicate(timeout=10.0)


def _row(report: Mapping[str, Any], name: str) -> Mapping[str, Any]:
    return next((r for r in report.get("expectations", ()) if r.get("name") == name), {})


def measure_run(report: Mapping[str, Any]) -> dict[str, Any]:
    """One scenario run's figures (see the module docstring) from its report."""
    if "error" in report:
        return {"passed": False, "error": report["error"]}
    # The scenario's bound in steps: a straggler's confirmation, else (a slow link,
    # which makes no rank a straggler) the fault's detection.
    name = next((n for n in STEP_BOUNDS if _row(report, n)), STEP_BOUNDS[0])
    row = _row(report, name)
    fault = (report.get("faults") or [{}])[0]
    return {
        "passed": bool(report.get("passed")),
        "failed": [r["name"] for r in report.get("expectations", ()) if not r.get("passed")],
        "bound": name,
        "confirmed_after_steps": row.get("measured"),
        "bound_steps": row.get("expected"),
        "detected": fault.get("detected"),
        "detect_ms": None if fault.get("detect_ms") is None else round(fault["detect_ms"], 1),
        "detect_steps": fault.get("detect_steps"),
        "slowdown": (report.get("step_ms") or {}).get("slowdown"),
    }


def count_verdicts(events: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """The straggler verdicts of one job, each counted once (every rank logs it)."""
    seen: set[tuple[Any, ...]] = set()
    counts = dict.fromkeys(VERDICTS, 0)
    confirmed: list[dict[str, Any]] = []
    for e in events:
        kind = e.get("kind")
        key = (kind, e.get("epoch"), e.get("rank"), e.get("cause"), e.get("call"))
        if kind not in counts or key in seen:
            continue
        seen.add(key)
        counts[kind] += 1
        if kind == "straggler.confirmed":
            confirmed.append({k: e.get(k) for k in ("rank", "cause", "call", "relative")})
    return {"suspected": counts[VERDICTS[0]], "confirmed": counts[VERDICTS[1]],
            "confirmations": confirmed}  # fmt: skip


def _scenario_series(args: argparse.Namespace, tmp: Path, runs: list[dict[str, Any]]) -> None:
    """Run the scenario ``--runs`` times, adding each run's figures to ``runs``."""
    for n in range(args.runs):
        out = tmp / f"run-{n}"
        run = {
            "run": n + 1,
            "load": load_line(),
            **measure_run(_chaos(args.scenario, out, args.timeout_s)),
        }
        print(json.dumps(run), flush=True)
        runs.append(run)


def _clean_series(args: argparse.Namespace, tmp: Path, runs: list[dict[str, Any]]) -> None:
    """Run the fault-free job once per seed, adding each one's verdict counts to ``runs``."""
    script = ROOT / "examples" / "train_ddp.py"
    for seed in range(args.first_seed, args.first_seed + args.seeds):
        path = tmp / f"clean-s{seed}.toml"
        text = CLEAN_SCENARIO.format(seed=seed, steps=args.steps, script=script,
                                     timeout_s=args.timeout_s)  # fmt: skip
        path.write_text(text)
        out = tmp / f"clean-s{seed}"
        report = _chaos(path, out, args.timeout_s + STOP_GRACE_S)
        run: dict[str, Any] = {"seed": seed, "load": load_line()}
        if "error" in report:
            run.update(passed=False, error=report["error"])
        else:
            completed = (report.get("steps") or {}).get("completed") or {}
            run.update(
                passed=bool(report.get("passed")),
                steps=min(completed.values(), default=0),
            )
            run.update(count_verdicts(read_events(out / "run")))
        print(json.dumps(run), flush=True)
        runs.append(run)


def summarise_scenario(runs: list[dict[str, Any]]) -> dict[str, Any]:
    """Spread of the confirmation steps, and how many runs met the bound and passed."""
    steps = [r["confirmed_after_steps"] for r in runs if r.get("confirmed_after_steps") is not None]
    bound = next((r["bound_steps"] for r in runs if r.get("bound_steps") is not None), None)
    within = sum(1 for s in steps if bound is not None and s <= bound)
    return {
        "runs": len(runs),
        "passed": sum(1 for r in runs if r.get("passed")),
        "confirmed": len(steps),
        "within_bound": within if bound is not None else None,
        "bound_steps": bound,
        "steps_min": min(steps, default=None),
        "steps_median": statistics.median(steps) if steps else None,
        "steps_max": max(steps, default=None),
    }


def summarise_clean(runs: list[dict[str, Any]]) -> dict[str, Any]:
    return {
        "seeds": len(runs),
        "completed": sum(1 for r in runs if r.get("passed")),
        "steps": sum(int(r.get("steps") or 0) for r in runs),
        "suspected": sum(int(r.get("suspected") or 0) for r in runs),
        "confirmed": sum(int(r.get("confirmed") or 0) for r in runs),
    }


def _table(args: argparse.Namespace, runs: list[dict[str, Any]]) -> dict[str, Any]:
    if args.clean:
        print_table(["seed", "completed", "steps", "suspected", "confirmed", "load"],
                    [[str(r["seed"]), str(r.get("passed")), str(r.get("steps", "-")),
                      str(r.get("suspected", "-")), str(r.get("confirmed", "-")),
                      r["load"].split(" on ")[0]] for r in runs])  # fmt: skip
        return summarise_clean(runs)
    rows = [
        [str(r["run"]), str(r.get("passed")),
         f"{r.get('confirmed_after_steps')} ({r.get('bound', '-')})",
         f"{r.get('detected')} {r.get('detect_ms')} ms, {r.get('detect_steps')} steps",
         str(r.get("slowdown")), ",".join(r.get("failed", [])) or r.get("error", "-")]
        for r in runs
    ]  # fmt: skip
    print_table(["run", "passed", "steps (bound)", "detected", "slowdown", "failed"], rows)
    return summarise_scenario(runs)


def _args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenario", type=Path, help="a scenario with a straggler fault")
    p.add_argument("--runs", type=int, default=20, help="runs of --scenario (default 20)")
    p.add_argument("--clean", action="store_true", help="fault-free jobs, one per seed")
    p.add_argument("--seeds", type=int, default=20, help="--clean: how many seeds (default 20)")
    p.add_argument("--first-seed", type=int, default=0, help="--clean: the first seed (default 0)")
    p.add_argument("--steps", type=int, default=1000, help="--clean: steps per job")
    p.add_argument("--timeout-s", type=float, default=600.0, help="per run (default 600)")
    p.add_argument("--out", type=Path, default=None, help="keep each run's chaos output here")
    args = p.parse_args()
    if args.clean == (args.scenario is not None):
        p.error("give either --scenario PATH or --clean")
    if min(args.runs, args.seeds, args.steps) < 1 or args.timeout_s <= 0 or args.first_seed < 0:
        p.error("--runs, --seeds, --steps and --timeout-s must be positive, --first-seed >= 0")
    if os.geteuid() != 0:
        p.error("the netns testbed needs root")
    return args


def main() -> int:
    args = _args()
    load_before, meter = load_line(), CpuMeter()
    runs: list[dict[str, Any]] = []
    interrupted = None
    GUARD.install()
    try:
        with tempfile.TemporaryDirectory(prefix="stragglers-") as d:
            tmp = args.out or Path(d)
            tmp.mkdir(parents=True, exist_ok=True)
            (_clean_series if args.clean else _scenario_series)(args, tmp, runs)
    except (KeyboardInterrupt, SystemExit) as exc:  # the run in progress was stopped
        interrupted = type(exc).__name__
    finally:
        GUARD.uninstall()
    cond = {"load": [load_before, load_line()], "cpu": meter.report()}
    print_conditions(cond)
    summary = _table(args, runs)
    what = {"mode": "clean", "steps_per_seed": args.steps} if args.clean else {
        "mode": "scenario", "scenario": str(args.scenario)}  # fmt: skip
    print(json.dumps({**what, **cond, "interrupted": interrupted, "summary": summary,
                      "runs": runs}))  # fmt: skip
    if interrupted:
        return 130
    return 0 if all(r.get("passed") for r in runs) else 1


if __name__ == "__main__":
    sys.exit(main())
