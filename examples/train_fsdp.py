"""Train a small deterministic MLP with FSDP2/HSDP over the "resilient" backend (or gloo).

    resilient run --nproc 4 examples/train_fsdp.py --steps 20
    torchrun --nproc-per-node 4 examples/train_fsdp.py --backend gloo   # the same job on gloo

The ranks form a 2-D DeviceMesh (replicate x shard; ``--replicas``, default 2): each
layer's parameters and optimizer state are sharded over the "shard" dimension and
replicated over the "replicate" one (HSDP; ``--replicas 1`` is plain FSDP). Each
rank draws its own synthetic batch per step (seeded by seed, rank and step). Rank 0
prints the loss per step (averaged over ranks); every rank prints a SHA-256 of the
full parameters at the end, so runs on two backends can be compared.

Steps run under ``recovery.Session``: on the resilient backend a lost rank is
replaced in place (``resilient run --max-restarts 1``), its shards and optimizer
state restored from its replica (the rank of the same shard column in the other
replicate row), and the interrupted step replayed, with every mesh dimension
following the recovery (``examples/scenarios/kill-rank-hsdp.toml``). Plain FSDP
(``--replicas 1``) has no replica to restore from: with ``--checkpoint-dir`` every
rank goes back to the last checkpoint and replays from there
(``recovery.DcpCheckpoints.rollback``); without, a lost rank ends the job.

``--checkpoint-dir DIR`` with ``--checkpoint-every N`` saves a distributed
checkpoint (torch.distributed.checkpoint, every rank writes its shards) every N
steps (``recovery.DcpCheckpoints``), and a run started with the same DIR resumes
from the latest one.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch import nn


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    p.add_argument("--backend", default="resilient", help="process group backend")
    p.add_argument("--replicas", type=int, default=2, help="replicate dimension (1: FSDP)")
    p.add_argument("--width", type=int, default=256, help="hidden width (default 256)")
    p.add_argument("--batch", type=int, default=16, help="per-rank batch size")
    p.add_argument("--lr", type=float, default=1e-3, help="AdamW learning rate")
    p.add_argument("--seed", type=int, default=0, help="base seed (model and data)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--json-out", default=None, help="write losses/hash here (rank 0)")
    p.add_argument("--checkpoint-dir", default=None, help="DCP checkpoints go (and resume) here")
    p.add_argument("--checkpoint-every", type=int, default=0, help="save every N steps (0: never)")
    p.add_argument("--quiet", action="store_true", help="print only the final summary")
    return p.parse_args(argv)


def build_model(width: int, seed: int) -> nn.Sequential:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 16)
    )


def batch(seed: int, rank: int, step: int, width: int, size: int) -> tuple[Any, Any]:
    gen = torch.Generator().manual_seed((seed * 100_003 + rank) * 1_000_003 + step)
    x = torch.randn(size, width, generator=gen)
    return x, torch.sin(x[:, :16] * 3.0)


def shard(model: nn.Sequential, replicas: int) -> Any:
    """fully_shard every Linear and the root over a (replicate, shard) mesh."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    world = dist.get_world_size()
    if replicas < 1 or world % replicas:
        raise SystemExit(f"--replicas {replicas} does not divide the world size {world}")
    mesh = init_device_mesh("cpu", (replicas, world // replicas), mesh_dim_names=("rep", "shard"))
    mesh = mesh if replicas > 1 else mesh["shard"]
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return mesh


def full_sha256(model: nn.Module) -> str:
    """SHA-256 of the full (unsharded) parameters: the same on every rank."""
    h = hashlib.sha256()
    for v in model.state_dict().values():
        h.update(v.full_tensor().detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def params_stats(model: nn.Module) -> list[float]:
    """Per parameter, L1 and L2 norms of the full tensor in float64 (the chaos
    report compares runs whose summation order differs on these)."""
    out: list[float] = []
    for v in model.state_dict().values():
        wide = v.full_tensor().detach().to(torch.float64)
        out += [float(wide.abs().sum()), float(wide.norm())]
    return out


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    dist.init_process_group(args.backend)  # "resilient" is registered by torch's autoload
    rank, world = dist.get_rank(), dist.get_world_size()
    from recovery import DcpCheckpoints, ModelOptimizer, Session, TrainState
    from resilient.progress import StepReporter

    # Publishes each finished step to etcd (no-op without RESILIENT_ETCD): the chaos
    # CLI keys faults on it and measures step times from it.
    reporter = StepReporter.from_env()
    model = build_model(args.width, args.seed)
    shard(model, args.replicas)
    opt = torch.optim.AdamW(model.parameters(), lr=args.lr)
    # opt.step() runs when a step's block ends without an error (the commit).
    state = TrainState(model, opt)
    # Every rank writes its shards of the model and AdamW state (torch's
    # get_state_dict: loadable into another sharding of the same model).
    checkpoints = DcpCheckpoints(args.checkpoint_dir) if args.checkpoint_dir else None
    saved = {"train": ModelOptimizer(model, opt)}
    # Without a replica (plain FSDP) no peer can restore a lost rank's shards: with
    # checkpoints every rank goes back to the last one; without, steps just commit
    # and a lost rank ends the job.
    session = Session(dist.group.WORLD if args.replicas > 1 or checkpoints else None, state,
                      rollback=checkpoints.rollback(saved) if checkpoints else None)  # fmt: skip
    # A replacement gets the job's state when it is admitted, not from a checkpoint
    # (loading one is a collective the running ranks are not in).
    first = 0 if session.joining or checkpoints is None else checkpoints.resume(saved)
    losses: list[float] = []
    for step in session.steps(args.steps, start=first):
        with session.step(step):
            start = time.perf_counter()
            x, y = batch(args.seed, rank, step, args.width, args.batch)
            opt.zero_grad(set_to_none=True)
            loss = nn.functional.mse_loss(model(x), y)
            loss.backward()
            mean = loss.detach().clone()
            dist.all_reduce(mean)  # SUM: gloo has no AVG
            losses.append(float(mean) / world)
            ms = (time.perf_counter() - start) * 1e3
            reporter.step(step, loss=losses[-1], step_ms=round(ms, 3))
            if rank == 0 and not args.quiet:
                print(f"step {step:4d} loss {losses[-1]:.6f} ({ms:.1f} ms)", flush=True)
        every = args.checkpoint_every
        if checkpoints and every and session.committed == step and (step + 1) % every == 0:
            checkpoints.save(step, saved)
    digest = full_sha256(model)
    print(f"rank {rank}: final params sha256 {digest}", flush=True)
    reporter.finish(params_sha256=digest, params_stats=params_stats(model), steps=args.steps)
    if rank == 0 and args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({"backend": args.backend, "world": world, "losses": losses,
                       "params_sha256": digest}, f)  # fmt: skip
    del session, state
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
