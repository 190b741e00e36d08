"""DDP step time: the resilient process group against gloo, interleaved in one run.

    python benchmarks/ddp_step.py --ranks 4 --steps 50

Each of ``--ranks`` processes builds the examples/train_ddp.py model twice (same
seed), wraps one copy in DDP over a ``ResilientProcessGroup`` and the other in DDP over
a ``ProcessGroupGloo`` bound to rail 0's address, and alternates training steps
between them (order swapped every step), each step started after a barrier. A step
(batch, forward, backward with gradient all-reduce, SGD update) is timed on every
rank; a step's time is the slowest rank's. Prints a table, then one JSON line.

One launch's overhead moves by several points from launch to launch on a shared
2-core host (where the ranks' threads land, what the host does meanwhile), more
than between two steps of one launch. ``--launches N`` starts the ranks N times
over and reports medians over the launches (each launch's figures are kept
in the JSON).
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import statistics
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import ModuleType
from typing import Any

from _common import (
    DATA_TRANSPORT,
    ELIDE_EVERY,
    CpuMeter,
    add_common_flags,
    control_barrier,
    gloo_group,
    gloo_process_group,
    load_line,
    max_over_ranks,
    print_conditions,
    print_table,
    rail_address,
    run_ranks,
    summarise,
    tcp_store,
)

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "train_ddp.py"
NAMES = ("resilient", "gloo")


@dataclass(frozen=True, slots=True)
class Plan:
    world: int
    steps: int
    warmup: int
    width: int
    batch: int
    rails: int
    check_mismatch: bool = True
    elide_every: int = ELIDE_EVERY
    data_transport: str = DATA_TRANSPORT
    topology: str = "auto"
    native_io: bool = True
    lr: float = 0.05
    seed: int = 0
    timeout_s: float = 120.0


def add_step_flags(p: argparse.ArgumentParser, steps_help: str) -> None:
    """The run's flags (shared with benchmarks/ddp_threads.py)."""
    p.add_argument("--ranks", type=int, default=4, help="processes (default 4)")
    p.add_argument("--steps", type=int, default=50, help=steps_help)
    p.add_argument("--warmup", type=int, default=5, help="untimed steps first (default 5)")
    p.add_argument("--width", type=int, default=1024, help="hidden width (1024: 2.1M params)")
    p.add_argument("--batch", type=int, default=32, help="per-rank batch size (default 32)")
    p.add_argument("--rails", type=int, default=1, help="rails of the resilient group")
    add_common_flags(p)


def plan_of(args: argparse.Namespace) -> Plan:
    """The :class:`Plan` of parsed flags; SystemExit when they make no run."""
    if args.ranks < 2 or args.steps < 1 or args.warmup < 0 or args.rails < 1:
        raise SystemExit("need --ranks >= 2, --steps >= 1, --warmup >= 0, --rails >= 1")
    return Plan(
        world=args.ranks,
        steps=args.steps,
        warmup=args.warmup,
        width=args.width,
        batch=args.batch,
        rails=args.rails,
        check_mismatch=not args.no_check_mismatch,
        elide_every=args.elide_every,
        data_transport=args.data_transport,
        topology=args.topology,
        native_io=not args.no_native_io,
    )


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_step_flags(p, "timed steps per backend (default 50)")
    p.add_argument(
        "--launches",
        type=int,
        default=1,
        help="start the ranks this many times; report medians over the launches (default 1)",
    )
    args = p.parse_args(argv)
    if args.launches < 1:
        p.error("--launches must be at least 1")
    return args


def load_example() -> ModuleType:
    """examples/train_ddp.py as a module (for ``build_model`` and ``batch``)."""
    spec = importlib.util.spec_from_file_location("train_ddp_example", EXAMPLE)
    if spec is None or spec.loader is None:
        raise RuntimeError(f"cannot load {EXAMPLE}")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


# -- rank side -------------------------------------------------------------------------
class Trainer:
    """One DDP replica of the example model over one process group."""

    def __init__(self, example: ModuleType, pg: Any, plan: Plan, rank: int) -> None:
        import torch
        from torch import nn

        self.example, self.plan = example, plan
        self.model = example.build_model(plan.width, plan.seed)
        self.ddp = nn.parallel.DistributedDataParallel(self.model, process_group=pg)
        self.opt = torch.optim.SGD(self.ddp.parameters(), lr=plan.lr)
        self.rank = rank
        self.steps = 0

    def step(self) -> tuple[float, float]:
        """One training step; returns its wall time and this process's CPU time
        (every thread's, the library's own included) in ms."""
        from torch import nn

        start, cpu = time.perf_counter(), time.process_time()
        x, y = self.example.batch(
            self.plan.seed, self.rank, self.steps, self.plan.width, self.plan.batch
        )
        self.steps += 1
        loss = nn.functional.mse_loss(self.ddp(x), y)
        self.opt.zero_grad(set_to_none=True)
        loss.backward()  # type: ignore[no-untyped-call]
        self.opt.step()
        return (time.perf_counter() - start) * 1e3, (time.process_time() - cpu) * 1e3

    def digest(self) -> str:
        h = hashlib.sha256()
        for p in self.model.parameters():
            h.update(p.detach().contiguous().numpy().tobytes())
        return h.hexdigest()


def make_groups(rank: int, store: Any, plan: Plan) -> dict[str, Any]:
    from resilient.config import DataPlaneConfig
    from resilient.process_group import ResilientProcessGroup

    t, w = plan.timeout_s, plan.world
    gloo, gloo_backend = gloo_process_group(store, "ddp/gloo", rank, w, [rail_address(rank, 0)], t)
    return {
        "control": gloo_group(store, "ddp/control", rank, w, ["127.0.0.1"], t),
        "gloo": gloo,
        "gloo_backend": gloo_backend,
        "resilient": ResilientProcessGroup(
            rank=rank,
            world_size=w,
            rails=[rail_address(rank, r) for r in range(plan.rails)],
            store=store,
            config=DataPlaneConfig(
                connect_timeout_s=t,
                op_timeout_floor_s=t,
                check_mismatch=plan.check_mismatch,
                elide_every=plan.elide_every,
                topology=plan.topology,
                data_transport=plan.data_transport,
                native_io=plan.native_io,
            ),
        ),
    }


def close_groups(groups: dict[str, Any]) -> None:
    """Shut the groups of :func:`make_groups` down (gloo's wrapper dropped first)."""
    groups["resilient"].shutdown()
    groups.pop("gloo")
    for name in ("gloo_backend", "control"):
        groups.pop(name).shutdown()


def train(
    trainers: dict[str, Trainer], control: Any, plan: Plan
) -> tuple[dict[str, list[float]], dict[str, list[float]]]:
    """Alternate steps between the replicas; keep the wall and CPU times after warm-up."""
    times: dict[str, list[float]] = {n: [] for n in NAMES}
    cpu: dict[str, list[float]] = {n: [] for n in NAMES}
    for step in range(plan.warmup + plan.steps):
        order = NAMES if step % 2 == 0 else NAMES[::-1]
        for name in order:
            control_barrier(control, plan.timeout_s)
            elapsed, used = trainers[name].step()
            if step >= plan.warmup:
                times[name].append(elapsed)
                cpu[name].append(used)
    control_barrier(control, plan.timeout_s)  # DDP work of the last step is done everywhere
    return times, cpu


def rank_main(rank: int, world: int, port: int, plan: Plan) -> dict[str, Any]:
    import torch

    from resilient.links import native_steps

    torch.set_num_threads(1)
    example = load_example()
    store = tcp_store(rank, world, port, plan.timeout_s)
    groups = make_groups(rank, store, plan)
    try:
        trainers = {n: Trainer(example, groups[n], plan, rank) for n in NAMES}
        before = dict(native_steps.STATS)
        times, cpu = train(trainers, groups["control"], plan)
        # C steps run and stopped; rail passes moved whole in C and by the Python path.
        c_steps = [
            native_steps.STATS[k] - before[k]
            for k in ("steps", "stopped", "c_passes", "python_passes")
        ]
        digests = {n: t.digest() for n, t in trainers.items()}
        diff = max(
            float((a.detach() - b.detach()).abs().max())
            for a, b in zip(
                trainers["resilient"].model.parameters(),
                trainers["gloo"].model.parameters(),
                strict=True,
            )
        )
        del trainers
    finally:
        close_groups(groups)
    return {
        "times": times,
        "cpu": cpu,
        "digests": digests,
        "max_param_diff": diff,
        "c_steps": c_steps,
    }


# -- parent side -----------------------------------------------------------------------
def summary_of(plan: Plan, results: list[dict[str, Any]], loads: list[str]) -> dict[str, Any]:
    per_step = max_over_ranks([r["times"] for r in results])
    stats = {n: summarise(v) for n, v in per_step.items()}
    res, gloo = stats["resilient"]["median"], stats["gloo"]["median"]
    # A step's CPU: every rank's, summed (on a host with fewer cores than ranks the
    # step time follows it).
    cpu = {
        n: statistics.median(sum(per) for per in zip(*(r["cpu"][n] for r in results), strict=True))
        for n in NAMES
    }
    return {
        "bench": "ddp_step",
        "ranks": plan.world,
        "steps": plan.steps,
        "warmup": plan.warmup,
        "width": plan.width,
        "batch": plan.batch,
        "rails": plan.rails,
        "check_mismatch": plan.check_mismatch,
        "elide_every": plan.elide_every,
        "topology": plan.topology,
        "data_transport": plan.data_transport,
        "native_io": plan.native_io,
        # C mesh steps run on all ranks, and those that stopped and handed back.
        "c_steps": [sum(r["c_steps"][i] for r in results) for i in (0, 1)],
        "rail_passes_c_python": [sum(r["c_steps"][i] for r in results) for i in (2, 3)],
        "resilient_step_ms": round(res, 2),
        "gloo_step_ms": round(gloo, 2),
        "overhead": round(res / gloo - 1, 4),
        "resilient_step_cpu_ms": round(cpu["resilient"], 2),
        "gloo_step_cpu_ms": round(cpu["gloo"], 2),
        "min_max_ms": {n: [round(s["min"], 2), round(s["max"], 2)] for n, s in stats.items()},
        "samples_ms": {n: [round(v, 1) for v in vs] for n, vs in per_step.items()},
        "resilient_identical_across_ranks": len({r["digests"]["resilient"] for r in results}) == 1,
        "gloo_identical_across_ranks": len({r["digests"]["gloo"] for r in results}) == 1,
        "max_param_diff_vs_gloo": max(r["max_param_diff"] for r in results),
        "threads_per_rank": 1,
        "load": loads,
    }


def print_report(s: dict[str, Any]) -> None:
    print(
        f"DDP step, {s['ranks']} ranks, width {s['width']}, batch {s['batch']}/rank, "
        f"resilient over {s['rails']} rail(s); median of {s['steps']} steps each "
        f"(max over ranks), torch.set_num_threads(1) per rank"
    )
    if "launches" in s:
        each = ", ".join(
            f"{x['overhead'] * 100:+.1f}% (gloo {x['gloo_step_ms']:.1f})" for x in s["launches"]
        )
        print(f"{len(s['launches'])} launches, medians over them below; overheads: {each}")
    print_conditions(s)
    rows = [
        [n, f"{s[f'{n}_step_ms']:.2f}", f"{lo:.2f}", f"{hi:.2f}", f"{s[f'{n}_step_cpu_ms']:.1f}"]
        for n, (lo, hi) in s["min_max_ms"].items()
    ]
    print_table(["backend", "median ms", "min ms", "max ms", "CPU ms (all ranks)"], rows)
    print(
        f"overhead (resilient/gloo - 1): {s['overhead'] * 100:+.1f}%; replicas identical "
        f"across ranks: resilient {s['resilient_identical_across_ranks']}, gloo "
        f"{s['gloo_identical_across_ranks']}; max |param diff| resilient vs gloo "
        f"{s['max_param_diff_vs_gloo']:.2e}"
    )


def combined(launches: list[dict[str, Any]]) -> dict[str, Any]:
    """One summary of several launches' (see :func:`summary_of`): the medians over
    them of step times, CPU and overhead; each launch's own under ``launches``."""
    if len(launches) == 1:
        return launches[0]
    out = dict(launches[0])
    for key in ("resilient_step_ms", "gloo_step_ms", "resilient_step_cpu_ms", "gloo_step_cpu_ms"):
        out[key] = round(statistics.median(s[key] for s in launches), 2)
    out["overhead"] = round(statistics.median(s["overhead"] for s in launches), 4)
    out["c_steps"] = [sum(s["c_steps"][i] for s in launches) for i in (0, 1)]
    out["rail_passes_c_python"] = [
        sum(s["rail_passes_c_python"][i] for s in launches) for i in (0, 1)
    ]
    out["min_max_ms"] = {
        n: [
            min(s["min_max_ms"][n][0] for s in launches),
            max(s["min_max_ms"][n][1] for s in launches),
        ]
        for n in NAMES
    }
    for key in ("resilient_identical_across_ranks", "gloo_identical_across_ranks"):
        out[key] = all(s[key] for s in launches)
    out["max_param_diff_vs_gloo"] = max(s["max_param_diff_vs_gloo"] for s in launches)
    out["load"] = [launches[0]["load"][0], launches[-1]["load"][-1]]
    del out["samples_ms"]  # each launch keeps its own
    out["launches"] = [
        {k: s[k] for k in ("overhead", "resilient_step_ms", "gloo_step_ms", "samples_ms")}
        for s in launches
    ]
    return out


def launch(plan: Plan, timeout_s: float) -> dict[str, Any]:
    """Start the ranks once; their summary (see :func:`summary_of`)."""
    loads = [load_line()]
    results = run_ranks(rank_main, plan.world, (plan,), timeout_s)
    loads.append(load_line())
    return summary_of(plan, results, loads)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = plan_of(args)
    timeout_s = args.timeout or 300.0 + 2 * (plan.steps + plan.warmup) * 2.0
    meter, launches = CpuMeter(), []
    for i in range(args.launches):
        launches.append(launch(plan, timeout_s))
        if args.launches > 1:  # progress: a launch takes ~15 s at the defaults
            last = launches[-1]
            # gloo's step says which state the host was in (docs/BENCHMARKS.md,
            # 2026-12-05): the overhead is about twice as large when gloo is fast.
            print(
                f"launch {i + 1}/{args.launches}: overhead {last['overhead'] * 100:+.1f}% "
                f"(resilient {last['resilient_step_ms']:.2f} ms, gloo {last['gloo_step_ms']:.2f})",
                flush=True,
            )
    summary = combined(launches)
    summary["cpu"] = meter.report()
    print_report(summary)
    print(json.dumps(summary), flush=True)
    ok = summary["resilient_identical_across_ranks"] and summary["gloo_identical_across_ranks"]
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
