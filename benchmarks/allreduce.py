"""All-reduce: the resilient process group against raw gloo, in one run.

    python benchmarks/allreduce.py --ranks 4 --size-mb 64 --rails 1
    sudo python benchmarks/allreduce.py --ranks 4 --size-mb 16 --rails 2 --rail-rate-mbit 200,200

Starts ``--ranks`` processes on this machine. Each builds a ``ResilientProcessGroup``
over ``--rails`` loopback rails (rank r, rail k on ``127.0.<k+1>.<r+1>``), one gloo
group per rail (bound to that rail's address) and, with several rails, one gloo group
with every rail as a device. Every iteration runs each configuration once, in a
rotating order, each op started after a barrier; an op's time is the slowest rank's.
Prints a table, then one JSON line (last line of output). See docs/BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import subprocess
import sys
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from _common import (
    DATA_TRANSPORT,
    ELIDE_EVERY,
    CpuMeter,
    TcShaper,
    add_common_flags,
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
SHAPING = "tc htb on lo: per (rank, rail) address, a dst /32 class and a src /32 class"


@dataclass(frozen=True, slots=True)
class Plan:
    """Everything a rank needs to know, decided once by the parent."""

    world: int
    size_mb: float
    rails: int
    rates_mbit: tuple[float, ...] | None
    weights: tuple[float, ...] | None
    iters: int
    warmup: int
    op_timeout_s: float
    sub_chunk_bytes: int = 1 << 20
    check_mismatch: bool = True
    native_io: bool = True
    elide_every: int = ELIDE_EVERY
    data_transport: str = DATA_TRANSPORT
    topology: str = "auto"
    seed: int = 1234
    names: tuple[str, ...] = field(default=())

    @property
    def numel(self) -> int:
        return int(self.size_mb * MB) // 4


def _floats(text: str | None, what: str, count: int) -> tuple[float, ...] | None:
    if text is None:
        return None
    try:
        values = tuple(float(v) for v in text.split(","))
    except ValueError:
        raise SystemExit(f"{what}={text!r}: expected comma-separated numbers") from None
    if len(values) != count or any(v < 0 for v in values) or sum(values) <= 0:
        raise SystemExit(f"{what}={text!r}: need {count} non-negative values, one > 0")
    return values


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4, help="processes (default 4)")
    p.add_argument("--size-mb", type=float, default=64.0, help="float32 tensor size in MiB")
    p.add_argument("--rails", type=int, default=1, help="rails (NICs) per rank")
    p.add_argument("--rail-rate-mbit", default=None, help="per-rail rate limit r1,r2,.. (root)")
    p.add_argument("--weights", default=None, help="resilient rail weights w1,w2,..")
    p.add_argument("--iters", type=int, default=10, help="timed iterations (default 10)")
    p.add_argument("--warmup", type=int, default=2, help="untimed iterations first (default 2)")
    p.add_argument("--sub-chunk-kb", type=int, default=None, help="resilient pipelining grain")
    add_common_flags(p)
    return p.parse_args(argv)


def config_names(rails: int) -> tuple[str, ...]:
    multi = ("multi_device",) if rails > 1 else ()
    return ("resilient", *(f"rail{r}" for r in range(rails)), *multi)


def estimate_op_s(world: int, size_mb: float, rates: tuple[float, ...] | None) -> float:
    """Rough time of one single-rail ring all_reduce (for timeouts only)."""
    if not rates:
        return size_mb * 0.005  # ~0.2 GB/s: pessimistic for loopback
    moved_mb = 2 * (world - 1) / world * size_mb * MB / 1e6
    return moved_mb / (min(r for r in rates if r > 0) / 8)


def make_plan(args: argparse.Namespace) -> Plan:
    if args.ranks < 2 or args.rails < 1 or args.size_mb <= 0:
        raise SystemExit("need --ranks >= 2, --rails >= 1 and --size-mb > 0")
    if args.iters < 1 or args.warmup < 0:
        raise SystemExit("need --iters >= 1 and --warmup >= 0")
    rates = _floats(args.rail_rate_mbit, "--rail-rate-mbit", args.rails)
    if rates is not None and min(rates) <= 0:
        raise SystemExit("--rail-rate-mbit: every rate must be > 0")
    weights = _floats(args.weights, "--weights", args.rails)
    est = estimate_op_s(args.ranks, args.size_mb, rates)
    return Plan(
        world=args.ranks,
        size_mb=args.size_mb,
        rails=args.rails,
        rates_mbit=rates,
        weights=weights,
        iters=args.iters,
        warmup=args.warmup,
        op_timeout_s=60.0 + 10 * est,
        sub_chunk_bytes=args.sub_chunk_kb * 1024 if args.sub_chunk_kb else 1 << 20,
        check_mismatch=not args.no_check_mismatch,
        native_io=not args.no_native_io,
        elide_every=args.elide_every,
        data_transport=args.data_transport,
        topology=args.topology,
        names=config_names(args.rails),
    )


# -- rank side -------------------------------------------------------------------------
def make_input(rank: int, numel: int, seed: int) -> Any:
    import torch

    return torch.randn(numel, generator=torch.Generator().manual_seed(seed + rank))


def reference_sum(world: int, numel: int, seed: int) -> Any:
    ref = make_input(0, numel, seed)
    for r in range(1, world):
        ref += make_input(r, numel, seed)
    return ref


class Comms:
    """The process groups of one rank: resilient, gloo per rail, gloo multi-device."""

    def __init__(self, rank: int, store: Any, plan: Plan) -> None:
        from resilient.config import DataPlaneConfig
        from resilient.process_group import ResilientProcessGroup

        addrs = [rail_address(rank, r) for r in range(plan.rails)]
        w, t = plan.world, plan.op_timeout_s
        self.timeout = timedelta(seconds=t)
        self.control = gloo_group(store, "bench/control", rank, w, ["127.0.0.1"], t)
        self.gloo: dict[str, Any] = {
            f"rail{r}": gloo_group(store, f"bench/rail{r}", rank, w, [a], t)
            for r, a in enumerate(addrs)
        }
        if plan.rails > 1:
            self.gloo["multi_device"] = gloo_group(store, "bench/multi", rank, w, addrs, t)
        config = DataPlaneConfig(
            rail_weights=plan.weights,
            connect_timeout_s=t,
            op_timeout_floor_s=t,
            sub_chunk_bytes=plan.sub_chunk_bytes,
            check_mismatch=plan.check_mismatch,
            native_io=plan.native_io,
            elide_every=plan.elide_every,
            topology=plan.topology,
            data_transport=plan.data_transport,
        )
        self.resilient = ResilientProcessGroup(
            rank=rank, world_size=w, rails=addrs, store=store, config=config
        )

    def allreduce(self, name: str, tensor: Any) -> None:
        pg = self.resilient if name == "resilient" else self.gloo[name]
        pg.allreduce([tensor]).wait(self.timeout)

    def barrier(self) -> None:
        control_barrier(self.control, self.timeout.total_seconds())

    def close(self) -> None:
        self.resilient.shutdown()
        groups = [*self.gloo.values(), self.control]
        self.gloo.clear()
        del self.control
        for g in groups:
            g.shutdown()


def verify(comms: Comms, plan: Plan, src: Any) -> dict[str, Any]:
    """Run every configuration once on fresh inputs; compare with the reference sum."""
    import torch

    ref = reference_sum(plan.world, plan.numel, plan.seed)
    out: dict[str, Any] = {"allclose": {}}
    for name in plan.names:
        t = src.clone()
        comms.barrier()
        comms.allreduce(name, t)
        out["allclose"][name] = bool(torch.allclose(t, ref, rtol=1e-5, atol=1e-5))
        if name == "resilient":
            out["sha256"] = hashlib.sha256(t.numpy().tobytes()).hexdigest()
    return out


def timed_loop(comms: Comms, plan: Plan, src: Any) -> dict[str, list[float]]:
    """Warm-up, then timed iterations; configurations interleaved in a rotating order."""
    times: dict[str, list[float]] = {n: [] for n in plan.names}
    t = src.clone()
    for it in range(plan.warmup + plan.iters):
        shift = it % len(plan.names)
        for name in plan.names[shift:] + plan.names[:shift]:
            t.copy_(src)
            comms.barrier()
            start = time.perf_counter()
            comms.allreduce(name, t)
            elapsed_ms = (time.perf_counter() - start) * 1e3
            if it >= plan.warmup:
                times[name].append(elapsed_ms)
    return times


def rank_main(rank: int, world: int, port: int, plan: Plan) -> dict[str, Any]:
    import torch

    torch.set_num_threads(1)
    store = tcp_store(rank, world, port, plan.op_timeout_s)
    comms = Comms(rank, store, plan)
    try:
        src = make_input(rank, plan.numel, plan.seed)
        checks = verify(comms, plan, src)
        times = timed_loop(comms, plan, src)
    finally:
        comms.close()
    return {"times": times, **checks}


# -- parent side -----------------------------------------------------------------------
def ideal_ms(plan: Plan, gloo_ms: dict[str, float]) -> float:
    """Fastest single-rail gloo time scaled by its rail's share of the total rate."""
    rates = plan.rates_mbit or tuple(1.0 for _ in range(plan.rails))
    best = min(range(plan.rails), key=lambda r: gloo_ms[f"rail{r}"])
    return gloo_ms[f"rail{best}"] * rates[best] / sum(rates)


def summary_of(plan: Plan, results: list[dict[str, Any]], loads: list[str]) -> dict[str, Any]:
    per_iter = max_over_ranks([r["times"] for r in results])
    stats = {name: summarise(v) for name, v in per_iter.items()}
    med = {name: s["median"] for name, s in stats.items()}
    gloo_ms = {n: v for n, v in med.items() if n != "resilient"}
    best = min(gloo_ms, key=lambda n: gloo_ms[n])
    ideal = ideal_ms(plan, gloo_ms)
    res = med["resilient"]
    return {
        "bench": "allreduce",
        "ranks": plan.world,
        "size_mb": plan.size_mb,
        "rails": plan.rails,
        "rail_rate_mbit": list(plan.rates_mbit) if plan.rates_mbit else None,
        "weights": list(plan.weights) if plan.weights else None,
        "iters": plan.iters,
        "warmup": plan.warmup,
        "resilient_ms": round(res, 2),
        "gloo_ms": {n: round(v, 2) for n, v in gloo_ms.items()},
        "best_gloo": best,
        "best_gloo_ms": round(gloo_ms[best], 2),
        "speedup": round(gloo_ms[best] / res, 3),
        "ideal_ms": round(ideal, 2),
        "over_ideal": round(res / ideal, 3),
        "algbw_gbps": {n: round(plan.size_mb * MB / v / 1e6, 3) for n, v in med.items()},
        "min_max_ms": {n: [round(s["min"], 2), round(s["max"], 2)] for n, s in stats.items()},
        "samples_ms": {n: [round(v, 1) for v in vs] for n, vs in per_iter.items()},
        "correct": all(all(r["allclose"].values()) for r in results),
        "allclose": results[0]["allclose"],
        "bitwise_identical": len({r["sha256"] for r in results}) == 1,
        "threads_per_rank": 1,
        "load": loads,
    }


def print_report(s: dict[str, Any]) -> None:
    rates = s["rail_rate_mbit"]
    print(
        f"all_reduce of {s['size_mb']} MiB float32, {s['ranks']} ranks, {s['rails']} rail(s), "
        f"rates {rates or 'unlimited'} mbit, weights {s['weights'] or 'equal'}; "
        f"median of {s['iters']} iterations (max over ranks), 1 torch thread per rank"
    )
    print_conditions(s)
    rows = [
        [
            name,
            f"{s['resilient_ms'] if name == 'resilient' else s['gloo_ms'][name]:.1f}",
            f"{lo:.1f}",
            f"{hi:.1f}",
            f"{s['algbw_gbps'][name]:.3f}",
        ]
        for name, (lo, hi) in s["min_max_ms"].items()
    ]
    print_table(["config", "median ms", "min ms", "max ms", "algbw GB/s"], rows)
    print(
        f"speedup vs best gloo ({s['best_gloo']}): {s['speedup']:.3f}; "
        f"ideal {s['ideal_ms']:.1f} ms, resilient/ideal {s['over_ideal']:.3f}; "
        f"correct {s['correct']}, bitwise identical across ranks {s['bitwise_identical']}"
    )


def lo_qdisc_warning() -> None:
    """Warn when lo already carries a qdisc we did not install (it would skew timings)."""
    with contextlib.suppress(OSError, subprocess.SubprocessError):
        out = subprocess.run(
            ["tc", "qdisc", "show", "dev", "lo"],
            capture_output=True,
            text=True,
            timeout=10,
            check=False,
        ).stdout
        if out and "noqueue" not in out.split("\n", 1)[0]:
            print(f"warning: lo has a qdisc already: {out.strip()}", file=sys.stderr)


def run(plan: Plan, timeout_s: float) -> list[dict[str, Any]]:
    """Run the ranks, under shaping when rates are given; always unshape afterwards."""
    shaper: TcShaper | None = None
    if plan.rates_mbit:
        TcShaper.check_available()
        shaper = TcShaper()
        shaper.remove_on_exit()
    else:
        lo_qdisc_warning()
    try:
        if shaper is not None and plan.rates_mbit is not None:
            shaper.install(
                {
                    rail_address(rank, rail): plan.rates_mbit[rail]
                    for rank in range(plan.world)
                    for rail in range(plan.rails)
                }
            )
        return run_ranks(rank_main, plan.world, (plan,), timeout_s)
    finally:
        if shaper is not None:
            shaper.remove()


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = make_plan(args)
    est = estimate_op_s(plan.world, plan.size_mb, plan.rates_mbit)
    ops = (plan.iters + plan.warmup + 1) * len(plan.names)
    timeout_s = args.timeout or 300.0 + ops * (5 * est + 2)
    loads, meter = [load_line()], CpuMeter()
    results = run(plan, timeout_s)
    loads.append(load_line())
    summary = summary_of(plan, results, loads)
    summary["cpu"] = meter.report()
    summary["op_timeout_s"] = round(plan.op_timeout_s, 1)
    summary["shaping"] = SHAPING if plan.rates_mbit else None
    summary["sub_chunk_bytes"] = plan.sub_chunk_bytes
    summary["check_mismatch"] = plan.check_mismatch
    summary["native_io"] = plan.native_io
    summary["elide_every"] = plan.elide_every
    summary["topology"] = plan.topology
    summary["data_transport"] = plan.data_transport
    print_report(summary)
    print(json.dumps(summary), flush=True)
    return 0 if summary["correct"] and summary["bitwise_identical"] else 1


if __name__ == "__main__":
    sys.exit(main())
