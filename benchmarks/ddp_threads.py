"""Where a DDP step's CPU goes, thread by thread: the resilient process group against gloo.

    python benchmarks/ddp_threads.py --ranks 4 --steps 50 --rounds 4 [--perf]

On 4 ranks sharing 2 cores a DDP step is CPU-bound, so its time follows the CPU
every thread of every rank spends on it (docs/BENCHMARKS.md). Each rank builds the
examples/train_ddp.py model twice (as benchmarks/ddp_step.py does), then runs
``--rounds`` blocks of ``--steps`` steps, alternating the backend block by block.
Around each block it reads every thread's CPU time (``/proc/self/task/*/schedstat``)
and context switches (``/proc/self/task/*/status``), and it times the training
thread's part of each ``allreduce`` call of the resilient group (thread CPU time).
With ``--perf`` every rank also samples each block with ``perf record`` and splits
each thread's CPU by where its samples fell (benchmarks/_perf.py): the Python
interpreter, the kernel, torch, the C library, other.
Prints per-thread CPU and context switches per rank and step, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys
import tempfile
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
from _perf import CLASSES, PerfSampler, perf_missing, samples_by_thread
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


def thread_names() -> dict[int, str]:
    """This process's threads by id: their Python name, else the kernel's (a rank's
    own suffix dropped, so that names match across ranks)."""
    names = {t.native_id: t.name for t in threading.enumerate()}
    out: dict[int, str] = {}
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/comm") as f:
                comm = f.read().strip()
        except OSError:
            continue  # the thread ended meanwhile
        out[int(tid)] = re.sub(r"-\d+$", "", names.get(int(tid), comm))
    return out


def thread_times() -> dict[str, tuple[int, int]]:
    """CPU ns and context switches per thread name of this process."""
    out: dict[str, tuple[int, int]] = {}
    for tid, name in thread_names().items():
        try:
            with open(f"/proc/self/task/{tid}/schedstat") as f:
                ns = int(f.read().split()[0])
            with open(f"/proc/self/task/{tid}/status") as f:
                switches = sum(int(n) for n in _SWITCHES.findall(f.read()))
        except (OSError, ValueError):
            continue  # the thread ended meanwhile
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


def rank_main(
    rank: int, world: int, port: int, plan: Plan, rounds: int, perf: tuple[str, int] | None
) -> dict[str, Any]:
    """``perf``: (folder, rate) to sample each block with ``perf record``, or None."""
    import torch

    from resilient.process_group import ResilientProcessGroup

    torch.set_num_threads(1)
    caller = CallerMeter(ResilientProcessGroup)
    example = load_example()
    store = tcp_store(rank, world, port, plan.timeout_s)
    groups = make_groups(rank, store, plan)
    used: dict[str, dict[str, list[int]]] = {n: {} for n in NAMES}
    samples: dict[str, dict[str, dict[str, int]]] = {n: {} for n in NAMES}
    wall = {n: 0.0 for n in NAMES}
    sampler = PerfSampler(perf[1]) if perf is not None else None
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
                path = f"{perf[0]}/rank{rank}-block{r}-{name}.data" if perf is not None else ""
                if sampler is not None:
                    sampler.start(path)  # before the barrier: every rank samples the block
                try:
                    control_barrier(control, plan.timeout_s)
                    before, start = thread_times(), time.perf_counter()
                    for _ in range(plan.steps):
                        trainers[name].step()
                    control_barrier(control, plan.timeout_s)  # every rank's DDP work done
                    wall[name] += time.perf_counter() - start
                    after = thread_times()
                finally:
                    if sampler is not None:
                        sampler.stop()
                for thread, (ns, cs) in after.items():
                    was = before.get(thread, (0, 0))
                    acc = used[name].setdefault(thread, [0, 0])
                    acc[0] += ns - was[0]
                    acc[1] += cs - was[1]
                if sampler is not None:
                    add_samples(samples[name], samples_by_thread(path, thread_names()))
                    os.remove(path)
        # Reading perf's files took each rank its own time: none may close its groups
        # (rank 0 hosts the store) while another still uses them.
        control_barrier(control, plan.timeout_s)
        del trainers
    finally:
        if sampler is not None:
            sampler.stop()
        close_groups(groups)
    return {
        "used": used,
        "wall": wall,
        "caller_us": caller.ns / max(1, caller.calls) / 1e3,
        "samples": samples,
    }


def add_samples(into: dict[str, dict[str, int]], more: dict[str, dict[str, int]]) -> None:
    for thread, per in more.items():
        acc = into.setdefault(thread, dict.fromkeys(CLASSES, 0))
        for cls, n in per.items():
            acc[cls] += n


def split_of(cpu_ms: float, counts: dict[str, int] | None) -> dict[str, float] | None:
    """``cpu_ms`` shared out by the thread's samples per class (None without samples)."""
    total = sum(counts.values()) if counts else 0
    if not counts or total == 0:
        return None
    return {cls: round(cpu_ms * n / total, 3) for cls, n in counts.items()}


def summary_of(
    plan: Plan, rounds: int, results: list[dict[str, Any]], loads: list[str]
) -> dict[str, Any]:
    steps = plan.steps * rounds * plan.world  # rank-steps
    threads: dict[str, dict[str, dict[str, Any]]] = {}
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
        merged_samples: dict[str, dict[str, int]] = {}
        for r in results:
            add_samples(merged_samples, r["samples"][name])
        for t, v in threads[name].items():
            split = split_of(v["cpu_ms"], merged_samples.get(t))
            if split is not None:
                v["split_ms"] = split
    cpu = {n: round(sum(v["cpu_ms"] for v in threads[n].values()), 3) for n in NAMES}
    split_total = {
        n: {
            cls: round(sum(v["split_ms"][cls] for v in threads[n].values() if "split_ms" in v), 3)
            for cls in CLASSES
        }
        for n in NAMES
        if any("split_ms" in v for v in threads[n].values())
    }
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
        "split_ms_per_rank_step": split_total,
        "load": loads,
    }


def print_report(s: dict[str, Any]) -> None:
    print(
        f"DDP steps, {s['ranks']} ranks, {s['rounds']} blocks of {s['steps']} steps per "
        f"backend, alternating; CPU and context switches per rank and step"
    )
    print_conditions(s)
    split = s["split_ms_per_rank_step"]
    for name in NAMES:
        rows = []
        for t, v in s["threads"][name].items():
            parts = v.get("split_ms", {})
            rows.append(
                [t, f"{v['cpu_ms']:.3f}", f"{v['switches']:.1f}"]
                + ([f"{parts.get(c, 0.0):.3f}" for c in CLASSES] if split else [])
            )
        rows.append(
            ["all threads", f"{s['cpu_ms_per_rank_step'][name]:.3f}", ""]
            + ([f"{split[name][c]:.3f}" for c in CLASSES] if name in split else [])
        )
        print(f"\n{name}: {s['step_ms'][name]:.2f} ms per step (whole blocks, slowest rank)")
        print_table(["thread", "CPU ms", "switches"] + (list(CLASSES) if split else []), rows)
    print(
        f"\nCPU resilient/gloo {s['cpu_ratio']:.3f}, step time {s['step_ratio']:.3f}; the "
        f"training thread's part of one resilient allreduce: "
        f"{', '.join(f'{u:.0f}' for u in s['caller_us_per_allreduce'])} us of CPU (per rank)"
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_step_flags(p, "steps per block (default 50)")
    p.add_argument("--rounds", type=int, default=4, help="blocks per backend (default 4)")
    p.add_argument(
        "--perf",
        action="store_true",
        help="also sample every block with Linux perf and split each thread's CPU by "
        "where it ran: the Python interpreter, the kernel, torch, the C library, other",
    )
    p.add_argument("--perf-freq", type=int, default=999, help="perf samples a second (default 999)")
    args = p.parse_args(argv)
    if args.rounds < 1 or args.perf_freq < 1:
        raise SystemExit("need --rounds >= 1 and --perf-freq >= 1")
    if not os.path.exists("/proc/self/task"):
        raise SystemExit("ddp_threads needs Linux's /proc/self/task")
    if args.perf and (why := perf_missing()) is not None:
        raise SystemExit(why)
    plan = plan_of(args)
    timeout_s = args.timeout or 300.0 + 2 * (args.steps * args.rounds + args.warmup) * 2.0
    loads, meter = [load_line()], CpuMeter()
    folder = tempfile.mkdtemp(prefix="ddp-perf-") if args.perf else None
    try:
        perf = (folder, args.perf_freq) if folder is not None else None
        results = run_ranks(rank_main, plan.world, (plan, args.rounds, perf), timeout_s)
    finally:
        if folder is not None:
            shutil.rmtree(folder, ignore_errors=True)
    loads.append(load_line())
    summary = summary_of(plan, args.rounds, results, loads)
    summary["cpu"] = meter.report()
    print_report(summary)
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
