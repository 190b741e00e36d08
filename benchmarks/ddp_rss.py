"""Peak resident memory of a DDP rank: the resilient process group against gloo.

    .venv/bin/python benchmarks/ddp_rss.py --rails 2            # 4 ranks, 30 steps, 3 launches
    .venv/bin/python benchmarks/ddp_rss.py --rails 1 --launches 5

Each launch starts ``--ranks`` fresh processes that train examples/train_ddp.py's
model with DDP over ONE backend (one process cannot tell two groups' memory apart),
launches alternating gloo and resilient. A rank reports its peak RSS
(``getrusage``'s ``ru_maxrss``) after the steps, and its RSS before it made any
group (torch and the model loaded): the backend's own share is the difference.
The figure is the median over launches of the largest rank's peak, resilient over
gloo. The last line of stdout is one JSON line.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import sys
from typing import Any

from _common import CpuMeter, gloo_process_group, rail_address, run_ranks, tcp_store
from ddp_step import Plan, Trainer, add_step_flags, load_example, plan_of

BACKENDS = ("gloo", "resilient")


def _rss_mib() -> float:
    """This process's resident set now (from /proc: ru_maxrss only keeps the peak)."""
    with open("/proc/self/statm") as f:
        pages = int(f.read().split()[1])
    return pages * resource.getpagesize() / (1 << 20)


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def rank_main(rank: int, world: int, port: int, plan: Plan, backend: str) -> dict[str, float]:
    import torch

    torch.set_num_threads(1)
    example = load_example()
    example.build_model(plan.width, plan.seed)  # the model's memory is in the baseline
    store = tcp_store(rank, world, port, plan.timeout_s)
    before = _rss_mib()
    if backend == "gloo":
        pg, keep = gloo_process_group(
            store, "rss/gloo", rank, world, [rail_address(rank, 0)], plan.timeout_s
        )
    else:
        from resilient.config import DataPlaneConfig
        from resilient.process_group import ResilientProcessGroup

        keep = None
        pg = ResilientProcessGroup(
            rank=rank,
            world_size=world,
            rails=[rail_address(rank, r) for r in range(plan.rails)],
            store=store,
            config=DataPlaneConfig(
                connect_timeout_s=plan.timeout_s, op_timeout_floor_s=plan.timeout_s
            ),
        )
    trainer = Trainer(example, pg, plan, rank)
    for _ in range(plan.warmup + plan.steps):
        trainer.step()
    out = {"baseline_mib": before, "peak_mib": _peak_mib(), "end_mib": _rss_mib()}
    del trainer
    if backend == "resilient":
        pg.shutdown()
    else:
        del pg
        keep.shutdown()
    return out


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    add_step_flags(p, "steps per launch after the warm-up (default 30)")
    p.set_defaults(steps=30)
    p.add_argument(
        "--launches", type=int, default=3, help="launches per backend, alternated (default 3)"
    )
    args = p.parse_args(argv)
    if args.launches < 1:
        p.error("--launches must be at least 1")
    return args


def summary_of(plan: Plan, runs: dict[str, list[list[dict[str, float]]]]) -> dict[str, Any]:
    """Per backend: the median over launches of the largest rank's peak and of the
    largest rank's growth over its baseline (MiB)."""
    out: dict[str, Any] = {"bench": "ddp_rss", "ranks": plan.world, "rails": plan.rails}
    for name in BACKENDS:
        peaks = [max(r["peak_mib"] for r in launch) for launch in runs[name]]
        grown = [max(r["peak_mib"] - r["baseline_mib"] for r in launch) for launch in runs[name]]
        out[f"{name}_peak_mib"] = round(statistics.median(peaks), 1)
        out[f"{name}_grown_mib"] = round(statistics.median(grown), 1)
        out[f"{name}_peaks_mib"] = [round(x, 1) for x in peaks]
    out["peak_ratio"] = round(out["resilient_peak_mib"] / out["gloo_peak_mib"], 4)
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    plan = plan_of(args)
    timeout_s = args.timeout or 300.0 + 2 * (plan.steps + plan.warmup) * 2.0
    meter = CpuMeter()
    runs: dict[str, list[list[dict[str, float]]]] = {n: [] for n in BACKENDS}
    for i in range(args.launches):
        order = BACKENDS if i % 2 == 0 else BACKENDS[::-1]
        for name in order:
            runs[name].append(run_ranks(rank_main, plan.world, (plan, name), timeout_s))
    summary = summary_of(plan, runs)
    summary["cpu"] = meter.report()
    print(
        f"peak RSS of the largest rank, median of {args.launches} launches: resilient "
        f"{summary['resilient_peak_mib']} MiB (grew {summary['resilient_grown_mib']}), gloo "
        f"{summary['gloo_peak_mib']} MiB (grew {summary['gloo_grown_mib']}); "
        f"ratio {summary['peak_ratio']}"
    )
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
