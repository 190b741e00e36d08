"""Recovery from a SIGKILLed rank: resilient (cold, primed, warm spare) against torchrun.

    python benchmarks/rank_recovery.py --ranks 4 --state-mb 100 --steps 30 --kill-at 14

Runs examples/train_ddp.py three times on this machine, each time SIGKILLing rank
``--victim`` right after rank 0 printed step ``--kill-at``:

* ``resilient run --max-restarts 1 --no-primed-restarts`` (cold replacement: a new
  process imports torch);
* ``resilient run --max-restarts 1`` (primed, the default: the replacement starts
  from the rank's primed process, which imported torch while the job ran);
* the same with ``--warm-spares`` (a standby that already imported torch, built the
  model and DDP and ran the warm-up passes);
* ``torchrun --max-restarts 1`` with gloo, checkpointing every ``--ckpt-every``
  steps and resuming from the checkpoint (every worker restarts);
* ``resilient run --max-restarts 1 --min-ranks P-1`` with ``RESILIENT_POLICY=cost``
  (``--with-shrink``): the survivors shrink at once and train on while the cold
  replacement starts, then grow back when it asks to join (``grown_s``: from the
  kill until the epoch with every rank again). Not bitwise equal to a fault-free
  run: three ranks do four ranks' data for a few steps.

The model's width is chosen so that its parameters hold ``--state-mb`` MB (the
state a replacement must receive). Measured per run, from the kill:

* ``back_s``: until rank 0 finished a step again (every rank of the group took
  part in it: DDP steps are collective; in the shrink run, the three survivors);
* ``caught_up_s``: until rank 0 finished the step after the last one it had
  printed before the kill (a restart from a checkpoint first redoes steps);
* ``unblocked_s`` (resilient): until the last survivor caught the lost peer
  (``recovery.started`` in the event log);
* ``replayed``: steps done twice (resilient: ``step.replayed``; torchrun: the
  steps after its last checkpoint);
* ``restarted``: processes started again.

With ``--repeat N`` each resilient launch runs N times (the kill lands at another
point of a step each time, so single runs move by a few tenths of a second) and
the JSON line adds ``median``: per launch, the median of each timing.

Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import psutil
from _common import print_table

from resilient.events import read_events

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "examples" / "train_ddp.py"
_STEP = re.compile(r"step\s+(\d+) loss")


@dataclass
class Run:
    """One launch: rank 0's step lines with their arrival times, and the kill."""

    name: str
    lines: list[tuple[float, int]] = field(default_factory=list)
    killed_at: float | None = None
    killed_step: int | None = None
    exit_code: int | None = None
    output: list[str] = field(default_factory=list)


def _width(state_mb: float) -> int:
    # Parameters of build_model(w): 2 w^2 + 16 w + 2 w + 16 float32 values.
    return max(64, int(math.sqrt(state_mb * 1e6 / 4 / 2)))


def _rank_pid(root: int, rank: int) -> int | None:
    """The pid of the training process with RANK=rank under ``root``."""
    for proc in psutil.Process(root).children(recursive=True):
        try:
            env, cmd = proc.environ(), " ".join(proc.cmdline())
            # Not a warm spare (its cmdline names the script too, after _standby).
            if env.get("RANK") == str(rank) and "train_ddp.py" in cmd and "_standby" not in cmd:
                return int(proc.pid)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return None


def _watch(run: Run, proc: subprocess.Popen[str], args: argparse.Namespace) -> None:
    """Read the launcher's output; kill the victim once rank 0 printed --kill-at."""
    assert proc.stdout is not None
    for line in proc.stdout:
        now = time.monotonic()
        run.output.append(line)
        m = _STEP.search(line)
        if m is None:
            continue
        step = int(m.group(1))
        run.lines.append((now, step))
        if run.killed_at is None and step >= args.kill_at:
            pid = _rank_pid(proc.pid, args.victim)
            if pid is not None:
                os.kill(pid, signal.SIGKILL)
                run.killed_at, run.killed_step = time.monotonic(), step


def _launch(name: str, argv: list[str], env: dict[str, str], args: argparse.Namespace) -> Run:
    run = Run(name)
    proc = subprocess.Popen(
        argv, cwd=ROOT, env={**os.environ, **env}, stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip
    reader = threading.Thread(target=_watch, args=(run, proc, args), daemon=True)
    reader.start()
    try:
        run.exit_code = proc.wait(timeout=args.timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        run.exit_code = proc.wait()
    finally:
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # nothing of the run outlives it
    reader.join(10)
    if run.exit_code != 0:
        tail = "".join(run.output[-40:])
        print(f"--- {name}: exit {run.exit_code}; last output:\n{tail}", file=sys.stderr)
    return run


def _summary(run: Run, ranks: int) -> dict[str, Any]:
    """What rank 0's output shows: when training came back, and steps done again."""
    if run.killed_at is None:
        return {
            "name": run.name,
            "exit_code": run.exit_code,
            "error": "the victim was never killed",
        }
    after = [(t, s) for t, s in run.lines if t > run.killed_at]
    steps = [s for _, s in run.lines]
    # A restart from a checkpoint prints earlier step numbers again.
    redo = next(
        (steps[i - 1] - steps[i] + 1 for i in range(1, len(steps)) if steps[i] <= steps[i - 1]), 0
    )
    return {
        "name": run.name,
        "exit_code": run.exit_code,
        "killed_after_step": run.killed_step,
        "back_s": round(after[0][0] - run.killed_at, 3) if after else None,
        "first_step_after": after[0][1] if after else None,
        # Back where it was: the step after the one before the kill is done.
        "caught_up_s": next(
            (round(t - run.killed_at, 3) for t, s in after if s > (run.killed_step or 0)), None
        ),
        "steps_done": max(steps, default=-1) + 1,
        "replayed": redo,
        "restarted": ranks,
    }


def _with_events(out: dict[str, Any], events: list[dict[str, Any]], kill_wall: float) -> None:
    """Resilient runs: survivors' detection and the restore, from the event log."""
    # Survivors log recovery.started with the step they were in; the launcher without.
    # Each survivor's first one after the kill (a later grow logs another).
    first: dict[int, float] = {}
    for e in events:
        if e["kind"] == "recovery.started" and e.get("step") is not None:
            ts = float(e["ts"])
            if ts >= kill_wall:
                first[int(e["rank"])] = min(first.get(int(e["rank"]), ts), ts)
    out["unblocked_s"] = round(max(first.values()) - kill_wall, 3) if first else None
    out["replayed"] = max(
        (int(e.get("replayed", 0)) for e in events if e["kind"] == "step.replayed"), default=0
    )
    restored = [e for e in events if e["kind"] == "state.restored"]
    out["state_bytes"] = int(restored[0]["reason"].split()[0]) if restored else None
    out["restore_ms"] = restored[0]["duration_ms"] if restored else None
    out["restarted"] = 1


def _medians(results: list[dict[str, Any]]) -> dict[str, dict[str, float | None]]:
    """Per launch name, the median of each timing over its repeats."""
    out: dict[str, dict[str, float | None]] = {}
    for name in dict.fromkeys(r["name"] for r in results):
        runs = [r for r in results if r["name"] == name]
        out[name] = {}
        for key in ("back_s", "caught_up_s", "unblocked_s", "restore_ms"):
            values = sorted(r[key] for r in runs if r.get(key) is not None)
            out[name][key] = round(statistics.median(values), 3) if values else None
    return out


def _resilient(
    args: argparse.Namespace,
    width: int,
    name: str,
    tmp: Path,
    *,
    repeat: int = 1,
) -> dict[str, Any]:
    """One launch; ``name``: cold, primed, warm or shrink."""
    warm, shrink = name == "warm", name == "shrink"
    run_dir = tmp / (name if repeat == 1 else f"{name}-{repeat}")
    # A kept --out dir from an earlier run: its event logs would be read with ours.
    shutil.rmtree(run_dir, ignore_errors=True)
    argv = [
        sys.executable, "-m", "resilient", "run", "--nproc", str(args.ranks),
        "--max-restarts", "1", "--run-dir", str(run_dir), "--log-dir", str(run_dir / "logs"),
        *(["--warm-spares"] if warm else []),
        *(["--no-primed-restarts"] if name in ("cold", "shrink") else []),
        *(["--min-ranks", str(args.ranks - 1), "--shrink-after", "30"] if shrink else []),
        str(SCRIPT), "--steps", str(args.steps), "--width", str(width),
    ]  # fmt: skip
    env = {"RESILIENT_POLICY": "cost"} if shrink else {}
    label = {"shrink": "resilient cold, shrink+grow", "warm": "resilient warm spare",
             "primed": "resilient primed"}  # fmt: skip
    wall0, mono0 = time.time(), time.monotonic()
    run = _launch(label.get(name, "resilient cold"), argv, env, args)
    out = _summary(run, args.ranks)
    if run.killed_at is not None:
        kill_wall = wall0 + (run.killed_at - mono0)
        events = read_events(run_dir)
        _with_events(out, events, kill_wall)
        if shrink:
            grown = [
                float(e["ts"]) for e in events
                if e["kind"] == "epoch.changed" and float(e["ts"]) > kill_wall
                and len(e.get("members") or []) == args.ranks
            ]  # fmt: skip
            out["grown_s"] = round(min(grown) - kill_wall, 3) if grown else None
    return out


def _torchrun(args: argparse.Namespace, width: int, tmp: Path) -> dict[str, Any]:
    from resilient.procs import free_port

    # An earlier run's checkpoint would make this one resume from it at the start.
    shutil.rmtree(tmp / "ckpt", ignore_errors=True)
    argv = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", str(args.ranks),
        "--max-restarts", "1", "--master-port", str(free_port()),
        str(SCRIPT), "--backend", "gloo", "--steps", str(args.steps), "--width", str(width),
        "--checkpoint-dir", str(tmp / "ckpt"), "--checkpoint-every", str(args.ckpt_every),
    ]  # fmt: skip
    run = _launch("torchrun + checkpoint", argv, {"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}, args)
    return _summary(run, args.ranks)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--state-mb", type=float, default=100.0, help="model parameters, MB")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--kill-at", type=int, default=14, help="kill after rank 0 printed this step")
    p.add_argument("--victim", type=int, default=2)
    p.add_argument("--ckpt-every", type=int, default=10, help="torchrun's checkpoint interval")
    p.add_argument("--timeout-s", type=float, default=600.0)
    p.add_argument("--skip-torchrun", action="store_true")
    p.add_argument("--skip-warm", action="store_true")
    p.add_argument("--skip-cold", action="store_true")
    p.add_argument("--skip-primed", action="store_true")
    p.add_argument(
        "--with-shrink", action="store_true", help="also the shrink-then-grow run (policy cost)"
    )
    p.add_argument("--out", default=None, help="keep run dirs (event logs) here")
    p.add_argument(
        "--repeat",
        type=int,
        default=1,
        help="run each resilient launch N times (the kill lands at another point of a "
        "step each time; the JSON adds each one's median); torchrun runs once",
    )
    args = p.parse_args()
    if args.repeat < 1:
        p.error(f"--repeat {args.repeat}: must be >= 1")
    width = _width(args.state_mb)
    with tempfile.TemporaryDirectory(prefix="recovery-bench-") as d:
        tmp = Path(args.out or d)
        results: list[dict[str, Any]] = []
        for n in range(1, args.repeat + 1):
            for name, skip in (
                ("cold", args.skip_cold),
                ("primed", args.skip_primed),
                ("warm", args.skip_warm),
                ("shrink", not args.with_shrink),
            ):
                if not skip:
                    results.append(_resilient(args, width, name, tmp, repeat=n))
        if not args.skip_torchrun:
            results.append(_torchrun(args, width, tmp))
    rows = [
        [r["name"], str(r.get("back_s")), str(r.get("caught_up_s")), str(r.get("unblocked_s", "-")),
         str(r.get("grown_s", "-")), str(r.get("replayed")), str(r.get("restarted")),
         str(r.get("exit_code"))]
        for r in results
    ]  # fmt: skip
    print(f"width {width}: {2 * width * width * 4 / 1e6:.0f} MB of parameters, "
          f"{args.ranks} ranks, kill rank {args.victim} after step {args.kill_at}")  # fmt: skip
    print_table(
        ["run", "back_s", "caught_up_s", "unblocked_s", "grown_s", "replayed", "restarted", "exit"],
        rows,
    )
    print(json.dumps({
        "ranks": args.ranks, "state_mb": round(2 * width * width * 4 / 1e6, 1), "width": width,
        "steps": args.steps, "kill_at": args.kill_at, "ckpt_every": args.ckpt_every,
        "runs": results, "median": _medians(results),
    }))  # fmt: skip
    return 0 if all(r.get("exit_code") == 0 for r in results) else 1


if __name__ == "__main__":
    sys.exit(main())
