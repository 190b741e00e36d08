"""FSDP2 step time: the resilient process group against gloo, interleaved in one run.

    python benchmarks/fsdp_step.py --ranks 4 --steps 20
    python benchmarks/fsdp_step.py --ranks 4 --steps 20 --rails 2

Each of ``--ranks`` processes calls ``init_process_group("gloo")`` and then makes a
resilient group of every rank with ``new_group(backend="resilient")`` (over
``--rails`` loopback rails), builds the same MLP twice (same seed), shards one copy
with ``fully_shard`` on a 1-D DeviceMesh of each group, and alternates training
steps between them (order swapped every step), each step started after a barrier.
A step (batch, forward with parameter all-gathers, backward with gradient
reduce-scatters, AdamW update) is timed on every rank; a step's time is the slowest
rank's. Prints a table, then one JSON line (medians in ms, the ratio, and whether
the two copies ended with the same parameters).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from _common import (
    CpuMeter,
    load_line,
    max_over_ranks,
    print_conditions,
    print_table,
    rail_address,
    run_ranks,
    summarise,
)

NAMES = ("resilient", "gloo")


@dataclass(frozen=True, slots=True)
class Plan:
    world: int
    steps: int
    warmup: int
    width: int
    layers: int
    batch: int
    rails: int
    seed: int = 0
    timeout_s: float = 180.0


def parse_args(argv: list[str] | None) -> Plan:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4, help="processes (default 4)")
    p.add_argument("--steps", type=int, default=20, help="timed steps per backend (default 20)")
    p.add_argument("--warmup", type=int, default=3, help="untimed steps first (default 3)")
    p.add_argument("--width", type=int, default=1024, help="hidden width (default 1024)")
    p.add_argument("--layers", type=int, default=4, help="hidden layers, each sharded (default 4)")
    p.add_argument("--batch", type=int, default=32, help="per-rank batch size (default 32)")
    p.add_argument("--rails", type=int, default=1, help="rails of the resilient group")
    a = p.parse_args(argv)
    if a.ranks < 2 or a.steps < 1 or a.warmup < 0 or a.rails < 1 or a.layers < 1:
        p.error("need --ranks >= 2, --steps >= 1, --warmup >= 0, --rails >= 1, --layers >= 1")
    return Plan(a.ranks, a.steps, a.warmup, a.width, a.layers, a.batch, a.rails)


# -- rank side -------------------------------------------------------------------------
class Trainer:
    """One FSDP2-sharded copy of the model over one 1-D mesh."""

    def __init__(self, mesh: Any, plan: Plan) -> None:
        import torch
        from torch.distributed.fsdp import fully_shard

        torch.manual_seed(plan.seed)
        layers: list[torch.nn.Module] = []
        for _ in range(plan.layers):
            layers += [torch.nn.Linear(plan.width, plan.width), torch.nn.ReLU()]
        self.model = torch.nn.Sequential(*layers, torch.nn.Linear(plan.width, 16))
        for layer in self.model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(self.model, mesh=mesh)
        self.opt = torch.optim.AdamW(self.model.parameters(), lr=1e-3)
        self.plan = plan

    def step(self, rank: int, step: int) -> float:
        """One training step; its wall time in ms."""
        import torch

        gen = torch.Generator().manual_seed(self.plan.seed * 1000 + rank * 100_000 + step)
        start = time.perf_counter()
        x = torch.randn(self.plan.batch, self.plan.width, generator=gen)
        loss = self.model(x).pow(2).mean()
        loss.backward()  # type: ignore[no-untyped-call]
        self.opt.step()
        self.opt.zero_grad(set_to_none=True)
        return (time.perf_counter() - start) * 1e3

    def digest(self) -> str:
        h = hashlib.sha256()
        for v in self.model.state_dict().values():
            h.update(v.full_tensor().detach().contiguous().numpy().tobytes())
        return h.hexdigest()


def rank_main(rank: int, world: int, port: int, plan: Plan) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import DeviceMesh

    torch.set_num_threads(1)
    os.environ["RESILIENT_RAILS"] = ",".join(rail_address(rank, r) for r in range(plan.rails))
    os.environ.setdefault("RESILIENT_OP_TIMEOUT_S", str(plan.timeout_s))
    store = dist.TCPStore(
        "127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=plan.timeout_s)
    )
    dist.init_process_group("gloo", store=store, rank=rank, world_size=world)
    try:
        ours = dist.new_group(backend="resilient")
        meshes = {
            "resilient": DeviceMesh.from_group(ours, "cpu"),
            "gloo": DeviceMesh.from_group(dist.group.WORLD, "cpu"),
        }
        trainers = {name: Trainer(meshes[name], plan) for name in NAMES}
        times: dict[str, list[float]] = {name: [] for name in NAMES}
        for step in range(plan.warmup + plan.steps):
            order = NAMES if step % 2 == 0 else NAMES[::-1]
            for name in order:
                dist.barrier()  # the gloo world group: both copies start level
                ms = trainers[name].step(rank, step)
                if step >= plan.warmup:
                    times[name].append(ms)
        digests = {name: t.digest() for name, t in trainers.items()}
        dist.barrier()
        return {"times": times, "digests": digests}
    finally:
        dist.destroy_process_group()


# -- driver ----------------------------------------------------------------------------
def main(argv: list[str] | None = None) -> int:
    plan = parse_args(argv)
    meter = CpuMeter()
    before = load_line()
    per_rank = run_ranks(rank_main, plan.world, (plan,), plan.timeout_s * 4)
    cpu = meter.report()
    steps = max_over_ranks([r["times"] for r in per_rank])
    stats = {name: summarise(steps[name]) for name in NAMES}
    same = all(r["digests"]["resilient"] == r["digests"]["gloo"] for r in per_rank)
    ratio = stats["resilient"]["median"] / stats["gloo"]["median"]
    summary: dict[str, Any] = {
        "benchmark": "fsdp_step",
        "ranks": plan.world,
        "rails": plan.rails,
        "width": plan.width,
        "layers": plan.layers,
        "batch": plan.batch,
        "steps": plan.steps,
        "resilient_ms": stats["resilient"],
        "gloo_ms": stats["gloo"],
        "ratio": round(ratio, 3),
        "params_bitwise_equal": same,
        "load": [before, load_line()],
        "cpu": cpu,
    }
    print_conditions(summary)
    print_table(
        ["backend", "median ms", "min ms", "max ms"],
        [
            [n, f"{stats[n]['median']:.1f}", f"{stats[n]['min']:.1f}", f"{stats[n]['max']:.1f}"]
            for n in NAMES
        ],
    )
    print(f"ratio resilient/gloo {ratio:.3f}; parameters bitwise equal: {same}")
    print(json.dumps(summary))
    return 0


if __name__ == "__main__":
    sys.exit(main())
