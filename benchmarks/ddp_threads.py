"""Where a DDP step's CPU goes, thread by thread: the resilient process group against gloo.

    python benchmarks/ddp_threads.py --ranks 4 --steps 50 --rounds 4

On 4 ranks sharing 2 cores a DDP step is CPU-bound, so its time follows the CPU
every thread of every rank spends on it (docs/BENCHMARKS.md). Each rank builds the
examples/train_ddp.py model twice (as benchmarks/ddp_step.py does), then runs
``--rounds`` blocks of ``--steps`` steps, alternating the backend block by block.
Around each block it reads every thread's CPU time (``/proc/self/task/*/schedstat``)
and context switches (``/proc/self/task/*/status``), and it times the training
thread's part of each ``allreduce`` call of the resilient group (thread CPU time).
Prints per-thread CPU and context switches per rank and step, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import threading
import time
from typing import Any

from _common import (
    CpuMeter,
    control_barrier,
    load_line,
    print_conditions,
    print_table,
    run_ranks,
    tcp_store,
)
from ddp_step import (
    NAMES,
    Plan,
    Trainer,
    add_step_flags,
    close_groups,
    load_example,
    make_groups,
    plan_of,
)

_SWITCHES = re.compile(r"^(?:non)?voluntary_ctxt_switches:\s+(\d+)", re.M)


def thread_times() -> dict[str, tuple[int, int]]:
    """CPU ns and context switches per thread name of this process (a rank's own
    suffix dropped, so that names match across ranks)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[str, tuple[int, int]] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
            with open(f"/proc/self/task/{tid}/status") as f:
                switches = sum(int(n) for n in _SWITCHES.findall(f.read()))
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except (OSError, ValueError):
            continue  # the thread ended meanwhile
        name = re.sub(r"-\d+$", "", names.get(int(tid), comm))
        cpu, cs = out.get(name, (0, 0))
        out[name] = (cpu + ns, cs + switches)
    return out


class CallerMeter:
    """Thread CPU of the caller's part of each ``allreduce`` of a process group class."""

    def __init__(self, cls: Any) -> None:
        self.ns, self.calls = 0, 0
        original = cls.allreduce

        def timed(pg: Any, *args: Any, **kwargs: Any) -> Any:
            start = time.thread_time_ns()
            try:
                return original(pg, *args, **kwargs)
            finally:
                self.ns += time.thread_time_ns() - start
                self.calls += 1

        cls.allreduce = timed


def rank_main(rank: int, world: int, port: int, plan: Plan, rounds: int) -> dict[str, Any]:
    import torch

    from resilient.process_group import ResilientProcessGroup

    torch.set_num_threads(1)
    caller = CallerMeter(ResilientProcessGroup)
    example = load_example()
    store = tcp_store(rank, world, port, plan.timeout_s)
    groups = make_groups(rank, store, plan)
    used: dict[str, dict[str, list[int]]] = {n: {} for n in NAMES}
    wall = {n: 0.0 for n in NAMES}
    try:
        trainers = {n: Trainer(example, groups[n], plan, rank) for n in NAMES}
        control = groups["control"]
        for _ in range(plan.warmup):
            for name in NAMES:
                control_barrier(control, plan.timeout_s)
                trainers[name].step()
        caller.ns = caller.calls = 0
        for r in range(rounds):
            for name in NAMES if r % 2 == 0 else NAMES[::-1]:
                control_barrier(control, plan.timeout_s)
                before, start = thread_times(), time.perf_counter()
                for _ in range(plan.steps):
                    trainers[name].step()
                control_barrier(control, plan.timeout_s)  # every rank's DDP work done
                wall[name] += time.perf_counter() - start
                for thread, (ns, cs) in thread_times().items():
                    was = before.get(thread, (0, 0))
                    acc = used[name].setdefault(thread, [0, 0])
                    acc[0] += ns - was[0]
                    acc[1] += cs - was[1]
        del trainers
    finally:
        close_groups(groups)
    return {"used": used, "wall": wall, "caller_us": caller.ns / max(1, caller.calls) / 1e3}


def summary_of(
    plan: Plan, rounds: int, results: list[dict[str, Any]], loads: list[str]
) -> dict[str, Any]:
    steps = plan.steps * rounds * plan.world  # rank-steps
    threads: dict[str, dict[str, dict[str, float]]] = {}
    for name in NAMES:
        merged: dict[str, list[int]] = {}
        for r in results:
            for thread, (ns, cs) in r["used"][name].items():
                acc = merged.setdefault(thread, [0, 0])
                acc[0] += ns
                acc[1] += cs
        threads[name] = {
            t: {"cpu_ms": round(ns / steps / 1e6, 3), "switches": round(cs / steps, 1)}
            for t, (ns, cs) in sorted(merged.items(), key=lambda kv: -kv[1][0])
            if ns / steps >= 5_000  # 5 us per step: leave out the idle
        }
    cpu = {n: round(sum(v["cpu_ms"] for v in threads[n].values()), 3) for n in NAMES}
    step_ms = {
        n: round(max(r["wall"][n] for r in results) / (plan.steps * rounds) * 1e3, 2) for n in NAMES
    }
    return {
        "bench": "ddp_threads",
        "ranks": plan.world,
        "steps": plan.steps,
        "rounds": rounds,
        "width": plan.width,
        "batch": plan.batch,
        "rails": plan.rails,
        "check_mismatch": plan.check_mismatch,
        "data_transport": plan.data_transport,
        "step_ms": step_ms,
        "step_ratio": round(step_ms["resilient"] / step_ms["gloo"], 3),
        "cpu_ms_per_rank_step": cpu,
        "cpu_ratio": round(cpu["resilient"] / cpu["gloo"], 3),
        "caller_us_per_allreduce": [round(r["caller_us"], 1) for r in results],
        "threads": threads,
        "load": loads,
    }


def print_report(s: dict[str, Any]) -> None:
    print(
        f"DDP steps, {s['ranks']} ranks, {s['rounds']} blocks of {s['steps']} steps per "
        f"backend, alternating; CPU and context switches per rank and step"
    )
    print_conditions(s)
    for name in NAMES:
        rows = [
            [t, f"{v['cpu_ms']:.3f}", f"{v['switches']:.1f}"] for t, v in s["threads"][name].items()
        ]
        rows.append(["all threads", f"{s['cpu_ms_per_rank_step'][name]:.3f}", ""])
        print(f"\n{name}: {s['step_ms'][name]:.2f} ms per step (whole blocks, slowest rank)")
        print_table(["thread", "CPU ms", "switches"], rows)
    print(
        f"\nCPU resilient/gloo {s['cpu_ratio']:.3f}, step time {s['step_ratio']:.3f}; the "
        f"training thread's part of one resilient allreduce: "
        f"{', '.join(f'{u:.0f}' for u in s['caller_us_per_allreduce'])} us of CPU (per rank)"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_step_flags(p, "steps per block (default 50)")
    p.add_argument("--rounds", type=int, default=4, help="blocks per backend (default 4)")
    args = p.parse_args(argv)
    if args.rounds < 1:
        raise SystemExit("need --rounds >= 1")
    if not os.path.exists("/proc/self/task"):
        raise SystemExit("ddp_threads needs Linux's /proc/self/task")
    plan = plan_of(args)
    timeout_s = args.timeout or 300.0 + 2 * (args.steps * args.rounds + args.warmup) * 2.0
    loads, meter = [load_line()], CpuMeter()
    results = run_ranks(rank_main, plan.world, (plan, args.rounds), timeout_s)
    loads.append(load_line())
    summary = summary_of(plan, args.rounds, results, loads)
    summary["cpu"] = meter.report()
    print_report(summary)
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
