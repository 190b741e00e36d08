"""A 4-rank job that shows membership, the job's epoch and a single-rank restart.

Run it under the launcher (``make membership-demo`` does this)::

    resilient run --nproc 4 --rails 2 --max-restarts 1 --lease-ttl 3 \\
        examples/membership_demo.py --steps 16

Each rank joins the job in etcd with a lease (``resilient.init()`` does it) and
trains a tiny linear model under ``recovery.Session`` over the "resilient"
backend. Rank 0 watches the member list and prints every departure and join. Rank
2 kills itself (SIGKILL) half-way through its first incarnation; its peers' next
all_reduce fails, the launcher restarts only that rank (incarnation 1), and the
survivors and the replacement agree on the next epoch: that recovery moves the
job's one epoch counter in etcd by compare-and-swap, with a history record of who
went on (``membership.epoch``). The survivors never restart. At the end rank 0
prints who finished, where the epoch lives in etcd and its history.
"""

from __future__ import annotations

import argparse
import gc
import os
import signal
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

import resilient
from membership.epoch import EPOCH_KEY, epoch_history
from membership.store import EtcdStore
from recovery.session import Session, TrainState
from resilient.process_group import ResilientProcessGroup


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=16, help="steps the job runs")
    p.add_argument("--step-s", type=float, default=0.1, help="extra seconds per step")
    p.add_argument("--crash-rank", type=int, default=2, help="rank that crashes once (-1: none)")
    return p.parse_args()


def main() -> int:
    args = parse_args()
    torch.set_num_threads(1)
    pg = resilient.init()  # init_process_group("resilient"): links, lease, member key
    rank, world = dist.get_rank(), dist.get_world_size()
    incarnation = pg.incarnation

    def say(msg: str) -> None:
        print(f"rank {rank} inc {incarnation}: {msg}", flush=True)

    assert pg.membership is not None or pg.joining, "run me under `resilient run` (etcd, token)"
    if rank == 0 and pg.membership is not None:
        pg.membership.watch_members(
            lambda kind, r, info: say(
                f"member rank {r} "
                + (f"joined (incarnation {info.incarnation})" if info else "left")
            ),
            initial=False,
        )
    torch.manual_seed(0)
    model = nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)

    def train_step(step: int) -> None:
        gen = torch.Generator().manual_seed(rank * 1_000 + step)
        x = torch.randn(16, 8, generator=gen)
        loss = (model(x) - x.sum(dim=1, keepdim=True)).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for p in model.parameters():
            assert p.grad is not None
            dist.all_reduce(p.grad)  # SUM over the ranks; the commit runs opt.step()

    session = Session(pg, TrainState(model, opt))
    for step in session.steps(args.steps):
        with session.step(step):
            if rank == args.crash_rank and incarnation == 0 and step == args.steps // 2:
                say(f"step {step}: simulating a crash (SIGKILL to myself)")
                os.kill(os.getpid(), signal.SIGKILL)
            train_step(step)
            time.sleep(args.step_s)
    say(f"finished {args.steps} steps at epoch {pg.epoch} (replayed {session.replayed})")
    if rank == 0:
        report(pg, world)
    del session
    gc.collect()
    dist.barrier()
    dist.destroy_process_group()
    return 0


def report(pg: ResilientProcessGroup, world: int) -> None:
    store = pg.store
    print("\n=== result ===")
    members = pg.membership.members() if pg.membership is not None else {}
    for r, info in sorted(members.items()):
        print(f"  rank {r}: member as incarnation {info.incarnation}")
    where = store.prefix + EPOCH_KEY if isinstance(store, EtcdStore) else "the init store"
    history = epoch_history(store)
    print(f"the job's epoch lives at {where}")
    print(f"epoch history (final epoch {pg.epoch}):")
    for rec in history:
        joined = f", joined {rec['joined']}" if rec["joined"] else ""
        print(
            f"  epoch {rec['epoch']}: members {rec['members']} of {world}{joined}, "
            f"resumed after step {rec['step']} (moved by rank {rec['rank']})"
        )
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
