"""Object collectives' latency: the resilient group against gloo, through torch's API.

    python benchmarks/objects.py --ranks 4
    python benchmarks/objects.py --ranks 2 --iters 100 --rounds 7

Starts ``--ranks`` processes on this machine. Each calls
``dist.init_process_group("resilient")`` (one loopback rail per rank,
``127.0.1.<rank+1>``) and makes a gloo group of every rank with
``dist.new_group(backend="gloo")``, bound to the same address. Then, per op, the
two groups take turns over ``--rounds`` rounds of ``--iters`` back-to-back calls
of ``dist.broadcast_object_list``, ``all_gather_object``, ``gather_object`` and
``scatter_object_list`` on a small object (a config-like dict of about
``--object-bytes`` pickled bytes): what long jobs send for configs and checkpoint
metadata. Each of these is two collectives underneath (sizes, then bytes), so the
figure is a latency. A round's time per call is the slowest rank's; the figure is
the median over rounds, and the ratio resilient / gloo per op (bar: within 2x).
Prints a table, then one JSON line (last line of output).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from typing import Any

from _common import CpuMeter, load_line, print_conditions, print_table, rail_address, run_ranks

NAMES = ("resilient", "gloo")
OPS = ("broadcast_object_list", "all_gather_object", "gather_object", "scatter_object_list")
BAR = 2.0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4, help="processes (default 4)")
    p.add_argument("--iters", type=int, default=200, help="calls per round (default 200)")
    p.add_argument("--rounds", type=int, default=5, help="rounds per group and op (default 5)")
    p.add_argument("--warmup", type=int, default=20, help="untimed calls first (default 20)")
    p.add_argument(
        "--object-bytes", type=int, default=256, help="about this many pickled bytes (default 256)"
    )
    p.add_argument("--timeout", type=float, default=600.0, help="whole-run bound (s)")
    args = p.parse_args(argv)
    if args.ranks < 2 or args.iters < 1 or args.rounds < 1 or args.warmup < 0:
        p.error("need --ranks >= 2, --iters >= 1, --rounds >= 1 and --warmup >= 0")
    return args


def _payload(rank: int, nbytes: int) -> dict[str, Any]:
    """A config-like object of about ``nbytes`` pickled bytes, different per rank."""
    return {"rank": rank, "step": 1000 + rank, "lr": 0.1, "note": "x" * max(0, nbytes - 80)}


def _one_call(op: str, group: Any, rank: int, world: int, obj: dict[str, Any]) -> Any:
    """One object collective of ``op`` on ``group``; returns what this rank got."""
    import torch.distributed as dist

    if op == "broadcast_object_list":
        objs = [obj if rank == 0 else None]
        dist.broadcast_object_list(objs, src=0, group=group)
        return objs[0]
    if op == "all_gather_object":
        out: list[Any] = [None] * world
        dist.all_gather_object(out, obj, group=group)
        return out
    if op == "gather_object":
        got: list[Any] | None = [None] * world if rank == 0 else None
        dist.gather_object(obj, got, dst=0, group=group)
        return got
    mine: list[Any] = [None]
    dist.scatter_object_list(mine, [obj] * world if rank == 0 else None, src=0, group=group)
    return mine[0]


def _round(
    op: str, group: Any, rank: int, world: int, obj: dict[str, Any], n: int
) -> tuple[float, float]:
    """Seconds per call over ``n`` back-to-back calls (this rank's view), and this
    process's CPU seconds per call (every thread: ours and gloo's I/O threads)."""
    start, cpu = time.perf_counter(), time.process_time()
    for _ in range(n):
        _one_call(op, group, rank, world, obj)
    return (time.perf_counter() - start) / n, (time.process_time() - cpu) / n


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace) -> dict[str, Any]:
    import resilient  # noqa: F401  (registers the backend)

    os.environ["RESILIENT_RAILS"] = rail_address(rank, 0)
    os.environ["GLOO_SOCKET_IFNAME"] = "lo"
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group(
        "resilient", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world
    )
    groups = {"resilient": dist.group.WORLD, "gloo": dist.new_group(backend="gloo")}
    obj = _payload(rank, args.object_bytes)
    rounds: dict[str, dict[str, list[float]]] = {op: {n: [] for n in NAMES} for op in OPS}
    cpu: dict[str, dict[str, list[float]]] = {op: {n: [] for n in NAMES} for op in OPS}
    correct = True
    try:
        for op in OPS:
            got = {n: _one_call(op, groups[n], rank, world, obj) for n in NAMES}
            correct = correct and got["resilient"] == got["gloo"]
            for name in NAMES:
                _round(op, groups[name], rank, world, obj, args.warmup)
            for r in range(args.rounds):
                # Alternate which goes first, so neither always follows the other's tail.
                for name in NAMES if r % 2 == 0 else NAMES[::-1]:
                    dist.barrier(group=groups["gloo"])
                    wall, used = _round(op, groups[name], rank, world, obj, args.iters)
                    rounds[op][name].append(wall)
                    cpu[op][name].append(used)
    finally:
        dist.destroy_process_group()
    return {"rounds": rounds, "cpu": cpu, "correct": correct}


def summary_of(args: argparse.Namespace, results: list[dict[str, Any]]) -> dict[str, Any]:
    per_op: dict[str, Any] = {}
    for op in OPS:
        us, cpu_us = {}, {}
        for name in NAMES:
            slowest = [
                max(rs) for rs in zip(*(r["rounds"][op][name] for r in results), strict=True)
            ]
            us[name] = statistics.median(slowest) * 1e6
            # CPU of all ranks together per call: what the cores had to give it.
            summed = [sum(cs) for cs in zip(*(r["cpu"][op][name] for r in results), strict=True)]
            cpu_us[name] = statistics.median(summed) * 1e6
        per_op[op] = {
            "resilient_us": round(us["resilient"], 1),
            "gloo_us": round(us["gloo"], 1),
            "ratio": round(us["resilient"] / us["gloo"], 3),
            "cpu_us_all_ranks": {n: round(v, 1) for n, v in cpu_us.items()},
        }
    worst = max(v["ratio"] for v in per_op.values())
    return {
        "bench": "objects",
        "ranks": args.ranks,
        "iters": args.iters,
        "rounds": args.rounds,
        "object_bytes": args.object_bytes,
        "ops": per_op,
        "worst_ratio": worst,
        "within_bar": worst <= BAR,
        "correct": all(r["correct"] for r in results),
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    loads, meter = [load_line()], CpuMeter()
    results = run_ranks(rank_main, args.ranks, (args,), args.timeout)
    loads.append(load_line())
    summary = summary_of(args, results)
    summary["load"], summary["cpu"] = loads, meter.report()
    print(
        f"object collectives, {args.ranks} ranks, ~{args.object_bytes} B objects; "
        f"median over {args.rounds} rounds of {args.iters} calls (slowest rank)"
    )
    print_conditions(summary)
    print_table(
        ["op", "resilient (us)", "gloo (us)", "resilient / gloo", "CPU us/call, all ranks"],
        [
            [
                op,
                f"{v['resilient_us']:.1f}",
                f"{v['gloo_us']:.1f}",
                f"{v['ratio']:.2f}x",
                " / ".join(f"{v['cpu_us_all_ranks'][n]:.0f}" for n in NAMES),
            ]
            for op, v in summary["ops"].items()
        ],
    )
    print(f"worst ratio {summary['worst_ratio']:.2f}x (bar {BAR}x); results equal to gloo's: "
          f"{summary['correct']}")  # fmt: skip
    print(json.dumps(summary), flush=True)
    return 0 if summary["correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
