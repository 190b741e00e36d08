"""All-to-all (all_to_all_single, equal splits): the resilient process group against gloo.

    python benchmarks/alltoall.py --ranks 4 --size-mb 16
    python benchmarks/alltoall.py --ranks 4 --size-mb 16 --rails 2

Starts ``--ranks`` processes on this machine. Each builds a ``ResilientProcessGroup``
over ``--rails`` loopback rails (rank r, rail k on ``127.0.<k+1>.<r+1>``) and one gloo
group on rail 0's address. ``--size-mb`` is each rank's float32 input (and output);
every rank sends one ``1/ranks`` block of it to every rank. Every iteration runs both
once, in alternating order, each op started after a barrier; an op's time is the
slowest rank's. Equal splits let the resilient calls run elided (no signature
exchange; every ``elide_every``-th call keeps it): the JSON's ``calls`` says how
many of rank 0's did. Prints a table, then one JSON line (last line of output).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from _common import (
    DATA_TRANSPORT,
    CpuMeter,
    control_barrier,
    gloo_group,
    load_line,
    max_over_ranks,
    print_conditions,
    print_table,
    rail_address,
    run_ranks,
    summarise,
    tcp_store,
)

MB = 1 << 20
NAMES = ("resilient", "gloo")


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything a rank needs to know, decided once by the parent."""

    world: int
    size_mb: float
    rails: int
    iters: int
    warmup: int
    op_timeout_s: float
    check_mismatch: bool = True
    native_io: bool = True
    data_transport: str = DATA_TRANSPORT
    seed: int = 1234

    @property
    def numel(self) -> int:
        """Elements per rank, a multiple of the world (equal splits)."""
        n = int(self.size_mb * MB) // 4
        return n - n % self.world


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4, help="processes (default 4)")
    p.add_argument("--size-mb", type=float, default=16.0, help="float32 input per rank, MiB")
    p.add_argument("--rails", type=int, default=1, help="rails (NICs) per rank")
    p.add_argument("--iters", type=int, default=10, help="timed iterations (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations first (default 2)")
    p.add_argument(
        "--no-check-mismatch", action="store_true", help="resilient: skip the signature check"
    )
    p.add_argument("--no-native-io", action="store_true", help="resilient without its C steps")
    p.add_argument("--timeout", type=float, default=None, help="whole-run limit in seconds")
    return p.parse_args(argv)


def make_plan(args: argparse.Namespace) -> Plan:
    if args.ranks < 2 or args.rails < 1 or args.size_mb <= 0:
        raise SystemExit("need --ranks >= 2, --rails >= 1 and --size-mb > 0")
    if args.iters < 1 or args.warmup < 0:
        raise SystemExit("need --iters >= 1 and --warmup >= 0")
    return Plan(
        world=args.ranks,
        size_mb=args.size_mb,
        rails=args.rails,
        iters=args.iters,
        warmup=args.warmup,
        op_timeout_s=60.0 + args.size_mb * 0.05,
        check_mismatch=not args.no_check_mismatch,
        native_io=not args.no_native_io,
    )


# -- rank side -------------------------------------------------------------------------
class Comms:
    """The process groups of one rank: resilient, gloo on rail 0, a control group."""

    def __init__(self, rank: int, store: Any, plan: Plan) -> None:
        from resilient.config import DataPlaneConfig
        from resilient.process_group import ResilientProcessGroup

        addrs = [rail_address(rank, r) for r in range(plan.rails)]
        w, t = plan.world, plan.op_timeout_s
        self.timeout = timedelta(seconds=t)
        self.control = gloo_group(store, "bench/control", rank, w, ["127.0.0.1"], t)
        self.gloo = gloo_group(store, "bench/rail0", rank, w, [addrs[0]], t)
        config = DataPlaneConfig(
            connect_timeout_s=t,
            op_timeout_floor_s=t,
            check_mismatch=plan.check_mismatch,
            native_io=plan.native_io,
            data_transport=plan.data_transport,
        )
        self.resilient = ResilientProcessGroup(
            rank=rank, world_size=w, rails=addrs, store=store, config=config
        )

    def all_to_all(self, name: str, out: Any, inp: Any) -> None:
        pg = self.resilient if name == "resilient" else self.gloo
        pg.alltoall_base(out, inp, [], []).wait(self.timeout)

    def barrier(self) -> None:
        control_barrier(self.control, self.timeout.total_seconds())

    def close(self) -> None:
        self.resilient.shutdown()
        self.gloo.shutdown()
        self.control.shutdown()


def rank_main(rank: int, world: int, port: int, plan: Plan) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    store = tcp_store(rank, world, port, plan.op_timeout_s)
    comms = Comms(rank, store, plan)
    times: dict[str, list[float]] = {n: [] for n in NAMES}
    try:
        src = torch.randn(plan.numel, generator=torch.Generator().manual_seed(plan.seed + rank))
        outs = {n: torch.empty_like(src) for n in NAMES}
        for name in NAMES:  # both once, untimed: the results must be equal
            comms.barrier()
            comms.all_to_all(name, outs[name], src)
        equal = bool(torch.equal(outs["resilient"], outs["gloo"]))
        for it in range(plan.warmup + plan.iters):
            for name in NAMES if it % 2 == 0 else NAMES[::-1]:
                comms.barrier()
                start = time.perf_counter()
                comms.all_to_all(name, outs[name], src)
                if it >= plan.warmup:
                    times[name].append((time.perf_counter() - start) * 1e3)
        checks = comms.resilient.epochs.checks
        calls = {
            "exchanged": checks.exchanges if checks else 0,
            "elided": checks.elided if checks else 0,
            "fell_back": checks.fallbacks if checks else 0,
        }
    finally:
        comms.close()
    return {"times": times, "equal": equal, "calls": calls}


# -- parent side -----------------------------------------------------------------------
def summary_of(plan: Plan, results: list[dict[str, Any]], loads: list[str]) -> dict[str, Any]:
    per_iter = max_over_ranks([r["times"] for r in results])
    stats = {name: summarise(v) for name, v in per_iter.items()}
    res, gloo = stats["resilient"]["median"], stats["gloo"]["median"]
    return {
        "bench": "alltoall",
        "op": "all_to_all_single",
        "ranks": plan.world,
        "size_mb": plan.size_mb,
        "rails": plan.rails,
        "iters": plan.iters,
        "warmup": plan.warmup,
        "resilient_ms": round(res, 2),
        "gloo_ms": round(gloo, 2),
        "ratio": round(res / gloo, 3),
        "min_max_ms": {n: [round(s["min"], 2), round(s["max"], 2)] for n, s in stats.items()},
        "samples_ms": {n: [round(v, 1) for v in vs] for n, vs in per_iter.items()},
        "correct": all(r["equal"] for r in results),
        "calls": results[0]["calls"],
        "threads_per_rank": 1,
        "load": loads,
        "check_mismatch": plan.check_mismatch,
        "native_io": plan.native_io,
        "data_transport": plan.data_transport,
    }


def print_report(s: dict[str, Any]) -> None:
    print(
        f"all_to_all_single of {s['size_mb']} MiB float32 per rank, {s['ranks']} ranks, "
        f"{s['rails']} rail(s); median of {s['iters']} iterations (max over ranks)"
    )
    print_conditions(s)
    rows = [
        [name, f"{s[name + '_ms']:.1f}", f"{lo:.1f}", f"{hi:.1f}"]
        for name, (lo, hi) in s["min_max_ms"].items()
    ]
    print_table(["config", "median ms", "min ms", "max ms"], rows)
    c = s["calls"]
    print(
        f"resilient calls of rank 0: {c['exchanged']} exchanged, {c['elided']} elided "
        f"({c['fell_back']} fell back)"
    )
    print(f"resilient / gloo: {s['ratio']:.3f}; results equal to gloo's: {s['correct']}")


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = make_plan(args)
    ops = (plan.iters + plan.warmup + 1) * len(NAMES)
    timeout_s = args.timeout or 300.0 + ops * 5.0
    loads, meter = [load_line()], CpuMeter()
    results = run_ranks(rank_main, plan.world, (plan,), timeout_s)
    loads.append(load_line())
    summary = summary_of(plan, results, loads)
    summary["cpu"] = meter.report()
    print_report(summary)
    print(json.dumps(summary), flush=True)
    return 0 if summary["correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
