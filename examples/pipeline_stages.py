"""Train a small MLP split into two pipeline stages, with send/recv between them.

    torchrun --nproc-per-node 2 examples/pipeline_stages.py --backend resilient
    torchrun --nproc-per-node 2 examples/pipeline_stages.py --backend gloo   # same loss

Rank 0 runs the first half of the MLP, rank 1 the second half and the loss. Each step
cuts the batch into ``--microbatches``: stage 0 sends every microbatch's activations
with ``isend`` (tagged by microbatch), stage 1 receives them, runs forward and
backward, and sends the activations' gradients back the same way; stage 0 then runs
its backward and both stages take an SGD step. Data and initial weights are seeded,
and send/recv move bytes unchanged, so every backend prints the same loss and the
same parameter digests, bit for bit.
"""

from __future__ import annotations

import argparse
import hashlib
import sys

import torch
import torch.distributed as dist
from torch import nn


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="resilient", help="process group backend")
    p.add_argument("--steps", type=int, default=20, help="training steps (default 20)")
    p.add_argument("--width", type=int, default=256, help="hidden width")
    p.add_argument("--batch", type=int, default=64, help="rows per step")
    p.add_argument("--microbatches", type=int, default=4, help="microbatches per step")
    p.add_argument("--lr", type=float, default=0.05, help="SGD learning rate")
    p.add_argument("--seed", type=int, default=0, help="seed of weights and data")
    return p.parse_args(argv)


def stage_of(rank: int, width: int, seed: int) -> nn.Sequential:
    """This rank's half of one seeded MLP (both ranks build all of it alike)."""
    torch.manual_seed(seed)
    layers = [
        nn.Linear(width, width), nn.ReLU(), nn.Linear(width, width), nn.ReLU(),
        nn.Linear(width, width), nn.ReLU(), nn.Linear(width, 16),
    ]  # fmt: skip
    return nn.Sequential(*(layers[:4] if rank == 0 else layers[4:]))


def batch(seed: int, step: int, width: int, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed * 1_000_003 + step)
    x = torch.randn(rows, width, generator=gen)
    return x, torch.sin(x[:, :16] * 3.0)


def first_stage(model: nn.Module, xs: list[torch.Tensor]) -> None:
    """Forward every microbatch, send its activations, then backward with the
    gradients stage 1 sends back."""
    acts = [model(x) for x in xs]
    sends = [dist.isend(a.detach(), 1, tag=i) for i, a in enumerate(acts)]
    grads = [torch.empty_like(a) for a in acts]
    recvs = [dist.irecv(g, 1, tag=i) for i, g in enumerate(grads)]
    for work in sends + recvs:
        work.wait()
    torch.autograd.backward(acts, grads)


def second_stage(model: nn.Module, ys: list[torch.Tensor], width: int) -> float:
    """Receive each microbatch's activations, run forward and backward, send the
    activations' gradients back; returns the step's mean loss."""
    acts = [torch.empty(len(y), width) for y in ys]
    recvs = [dist.irecv(a, 0, tag=i) for i, a in enumerate(acts)]
    total = 0.0
    sends = []
    for i, (work, a, y) in enumerate(zip(recvs, acts, ys, strict=True)):
        work.wait()
        a.requires_grad_(True)
        loss = nn.functional.mse_loss(model(a), y) / len(ys)
        loss.backward()
        total += float(loss)
        assert a.grad is not None
        sends.append(dist.isend(a.grad, 0, tag=i))
    for work in sends:
        work.wait()
    return total


def digest(model: nn.Module) -> str:
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    torch.set_num_threads(1)
    if args.backend == "resilient":
        import resilient

        resilient.init()  # registers the backend, then init_process_group("resilient")
    else:
        dist.init_process_group(args.backend)
    rank, world = dist.get_rank(), dist.get_world_size()
    if world != 2:
        raise SystemExit(f"pipeline_stages.py runs on 2 ranks, got {world}")
    model = stage_of(rank, args.width, args.seed)
    opt = torch.optim.SGD(model.parameters(), lr=args.lr)
    loss = 0.0
    for step in range(args.steps):
        x, y = batch(args.seed, step, args.width, args.batch)
        opt.zero_grad(set_to_none=True)
        if rank == 0:
            first_stage(model, list(x.chunk(args.microbatches)))
        else:
            loss = second_stage(model, list(y.chunk(args.microbatches)), args.width)
            print(f"step {step:3d} loss {loss:.6f}", flush=True)
        opt.step()
    final = torch.tensor([loss], dtype=torch.float64)
    dist.broadcast(final, src=1)  # so both stages report it
    # One write per line: both ranks share the launcher's stdout.
    line = f"rank {rank} ({args.backend}): final loss {float(final):.9f} params {digest(model)}\n"
    sys.stdout.write(line)
    sys.stdout.flush()
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
