"""Train a small deterministic MLP with DDP over the "resilient" backend (or gloo).

    resilient run --nproc 4 --rails 2 examples/train_ddp.py --steps 50
    torchrun --nproc-per-node 4 examples/train_ddp.py --backend gloo    # the same job on gloo

Each rank draws its own synthetic batch per step (seeded by seed, rank id and step,
so a replayed step draws the same data), DDP averages the gradients, and every rank
ends with the same parameters. Rank 0 prints the loss per step (averaged over
ranks); every rank prints a SHA-256 of its final parameters, so runs can be
compared bit for bit.

Steps run under ``recovery.Session``: a step's optimizer update is committed only
when all its collectives succeeded. When a rank is lost and ``resilient run``
restarts it, the survivors and the replacement agree on a new epoch, the
replacement gets the model and optimizer state from a live rank, and the
interrupted step is replayed; no other rank restarts. With
``RESILIENT_SHRINK_AFTER_S`` (``resilient run --min-ranks``) and no replacement,
the survivors go on without the lost rank and take over its data shard.
"""

from __future__ import annotations

import argparse
import functools
import gc
import hashlib
import json
import os
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
    p.add_argument("--width", type=int, default=1024, help="hidden width (1024: 2.1M params)")
    p.add_argument("--batch", type=int, default=32, help="per-rank batch size")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    p.add_argument("--seed", type=int, default=0, help="base seed (model and data)")
    p.add_argument("--threads", type=int, default=1, help="torch intra-op threads per rank")
    p.add_argument("--json-out", default=None, help="write losses/hash/step times here (rank 0)")
    p.add_argument("--quiet", action="store_true", help="print only the final summary")
    p.add_argument(
        "--checkpoint-dir",
        default=None,
        help="resume from DIR/ckpt.pt if present; with --checkpoint-every, rank 0 saves there",
    )
    p.add_argument("--checkpoint-every", type=int, default=0, help="save every N steps (0: never)")
    return p.parse_args(argv)


def build_model(width: int, seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(
        nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 16)
    )


def batch(
    seed: int, rank: int, step: int, width: int, size: int
) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed((seed * 100_003 + rank) * 1_000_003 + step)
    x = torch.randn(size, width, generator=gen)
    # A fixed teacher signal: the target depends on the inputs, not on the rank.
    y = torch.sin(x[:, :16] * 3.0) + 0.1 * x[:, 16:32]
    return x, y


def params_stats(model: nn.Module) -> list[float]:
    """Per parameter tensor, its L1 and L2 norms in float64: what a run whose
    schedule changed (summation order) is compared on, within a relative tolerance
    (norms, not sums: a sum near zero makes any relative difference look large)."""
    out: list[float] = []
    for p in model.parameters():
        wide = p.detach().to(torch.float64)
        out += [float(wide.abs().sum()), float(wide.norm())]
    return out


def params_sha256(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def load_checkpoint(directory: str | None, state: Any) -> int:
    """Load DIR/ckpt.pt into ``state`` if it exists; the step to start from."""
    path = os.path.join(directory, "ckpt.pt") if directory else None
    if path is None or not os.path.exists(path):
        return 0
    saved = torch.load(path, weights_only=True)
    state.load_state_dict(saved["state"])
    return int(saved["step"]) + 1


def save_checkpoint(directory: str | None, state: Any, step: int) -> None:
    """Write DIR/ckpt.pt atomically (a restart never reads half a file)."""
    assert directory is not None, "--checkpoint-every needs --checkpoint-dir"
    os.makedirs(directory, exist_ok=True)
    tmp = os.path.join(directory, f".ckpt-{os.getpid()}.pt")
    torch.save({"step": step, "state": state.state_dict()}, tmp)
    os.replace(tmp, os.path.join(directory, "ckpt.pt"))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(args.threads)
    if args.backend == "resilient":
        import resilient

        resilient.init()  # registers the backend, then init_process_group("resilient")
    elif "TORCHELASTIC_RESTART_COUNT" in os.environ:
        # Under torchrun --max-restarts, keys of the previous attempt stay in the
        # store and a restarted group reads their stale addresses (torch 2.13,
        # pytorch issue 135712): give each attempt its own key prefix.
        store, rank, world = next(dist.rendezvous("env://"))
        attempt = os.environ["TORCHELASTIC_RESTART_COUNT"]
        store = dist.PrefixStore(f"attempt-{attempt}/", store)
        dist.init_process_group(args.backend, store=store, rank=rank, world_size=world)
    else:
        dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    from resilient.progress import StepReporter

    # Publishes each finished step to etcd (no-op without RESILIENT_ETCD): the chaos
    # CLI keys faults on it and measures step times from it.
    reporter = StepReporter.from_env()
    model = build_model(args.width, args.seed)
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=args.lr)
    losses: list[float] = []
    step_ms: list[float] = []

    from recovery.shards import Piece

    def train_step(
        step: int,
        rows: int = args.batch,
        shards: tuple[Piece, ...] = (Piece(rank),),
        ddp: nn.Module = ddp,
        opt: torch.optim.Optimizer = opt,
    ) -> torch.Tensor:
        # ``shards``: whose data this rank trains on (after a shrink, an equal part
        # of each lost rank's shard too; see Session.shards).
        parts = [(p.rows(rows), batch(args.seed, p.shard, step, args.width, rows)) for p in shards]
        x = torch.cat([xy[0][sl] for sl, xy in parts])
        y = torch.cat([xy[1][sl] for sl, xy in parts])
        loss = nn.functional.mse_loss(ddp(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        return loss.detach()

    from recovery.session import Session, TrainState

    # opt.step() runs when a step's block ends without an error (the commit).
    state = TrainState(model, opt)
    # A replacement runs ``warmup`` alone twice before it is admitted (DDP builds
    # its buckets then); one row is enough for that.
    # ddp=: gradients are averaged over the ranks taking part (fewer after a shrink).
    session = Session(dist.group.WORLD, state, warmup=functools.partial(train_step, 0, 1), ddp=ddp)
    # A restarted job (torchrun --max-restarts) resumes from its last checkpoint.
    first = load_checkpoint(args.checkpoint_dir, state)
    for step in session.steps(args.steps, start=first):
        with session.step(step):
            start = time.perf_counter()
            mean_loss = train_step(step, shards=tuple(session.shards())).clone()
            dist.all_reduce(mean_loss)  # SUM: gloo has no AVG
            step_ms.append((time.perf_counter() - start) * 1e3)
            losses.append(float(mean_loss) / len(session.members))
            reporter.step(step, loss=losses[-1], step_ms=round(step_ms[-1], 3))
            if rank == 0 and not args.quiet:
                print(f"step {step:4d} loss {losses[-1]:.6f} ({step_ms[-1]:.1f} ms)", flush=True)
        every = args.checkpoint_every
        if rank == 0 and every and session.committed == step and (step + 1) % every == 0:
            save_checkpoint(args.checkpoint_dir, state, step)
    digest = params_sha256(model)
    print(f"rank {rank}: final params sha256 {digest}", flush=True)
    reporter.finish(params_sha256=digest, params_stats=params_stats(model), steps=args.steps)
    if rank == 0 and args.json_out:
        with open(args.json_out, "w") as f:
            json.dump(
                {
                    "backend": args.backend,
                    "world": world,
                    "losses": losses,
                    "params_sha256": digest,
                    "step_ms": step_ms,
                },
                f,
            )
    # Drop DDP (its reducer holds the group) and wait for every rank before tearing
    # the group down: a gloo group destroyed while a peer still talks to it, or
    # alive at interpreter exit, can abort the process ("terminate called ...").
    del session, state, train_step, ddp, opt
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
