"""A rank SIGKILLed in the middle of a DDP backward pass is replaced in place.

Three real processes train a small MLP with DDP over "resilient" (2 rails) under
``recovery.Session``. Rank 2 kills itself inside backward at step 6; the test
(standing in for the launcher) starts rank 2 again as incarnation 1. The
survivors must not restart: they agree on the next epoch with the replacement,
rank 0 sends its state, the interrupted step is replayed, and every rank ends
with parameters bitwise equal to a fault-free run of the same job. Only links to
the lost rank are rebuilt: survivor links stay the same objects.
"""

from __future__ import annotations

import functools
import hashlib
import os
import signal
from typing import Any

import pytest

from tests._replace import NEVER, run_with_replacement

WORLD = 3
STEPS = 12
VICTIM = 2
KILL_AT = 6


def _worker(
    rank: int, port: int, incarnation: int, kill_at: int, results: Any, with_ddp: bool
) -> None:
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(WORLD),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RESILIENT_RAILS=f"127.0.1.{rank + 1},127.0.2.{rank + 1}",
        RESILIENT_INCARNATION=str(incarnation),
        RESILIENT_OP_TIMEOUT_S="5",
        RESILIENT_REPLACE_TIMEOUT_S="20",
    )
    import torch
    import torch.distributed as dist
    from torch import nn

    import resilient
    from recovery.session import Session, TrainState

    torch.set_num_threads(1)
    pg = resilient.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(128, 128), nn.ReLU(), nn.Linear(128, 8))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    at = {"step": NEVER + 1}

    def die_in_backward(grad: torch.Tensor) -> torch.Tensor:
        if rank == VICTIM and at["step"] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return grad

    model[0].weight.register_hook(die_in_backward)

    def train_step(
        step: int, ddp: nn.Module = ddp, opt: torch.optim.Optimizer = opt
    ) -> torch.Tensor:
        gen = torch.Generator().manual_seed(rank * 1_000 + step)
        x = torch.randn(16, 128, generator=gen)
        loss = ddp(x).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        return loss.detach()

    session = Session(
        pg, TrainState(model, opt), warmup=functools.partial(train_step, 0),
        ddp=ddp if with_ddp else None,
    )  # fmt: skip
    survivor_links: dict[tuple[int, int], int] = {}
    for step in session.steps(STEPS):
        with session.step(step):
            at["step"] = step
            loss = train_step(step)
            dist.all_reduce(loss)
        if step == kill_at - 1:
            survivor_links = {
                key: id(link) for key, link in pg.links.links().items() if key[0] != VICTIM
            }
    kept = {key: id(pg.links.links().get(key)) == ident for key, ident in survivor_links.items()}
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    results.put((rank, incarnation, h.hexdigest(), session.replayed, kept, pg.epoch))
    del session, train_step, ddp, opt
    dist.barrier()
    dist.destroy_process_group()


def _run(kill_at: int, *, with_ddp: bool = False) -> dict[tuple[int, int], Any]:
    """``with_ddp``: the session is given the DDP module (its comm hook, and its
    reducer reset on entering an epoch)."""
    return run_with_replacement(
        _worker, world=WORLD, victim=VICTIM, kill_at=kill_at, extra=(with_ddp,), timeout_s=150
    )


@pytest.fixture(scope="module")
def clean() -> str:
    """The parameters' digest of a fault-free run (every rank's)."""
    out = _run(kill_at=NEVER, with_ddp=True)
    assert sorted(out) == [(r, 0) for r in range(WORLD)], out
    digests = {v[0] for v in out.values()}
    assert len(digests) == 1, out
    return digests.pop()


@pytest.mark.timeout(240)
def test_a_killed_rank_is_replaced_and_the_job_matches_a_fault_free_run(clean: str) -> None:
    faulty = _run(kill_at=KILL_AT, with_ddp=True)
    assert sorted(faulty) == [(0, 0), (1, 0), (2, 1)], faulty
    for who, (digest, replayed, kept, epoch) in faulty.items():
        assert digest == clean, f"rank {who} differs from the fault-free run"
        assert epoch == 1, who
        if who[1] == 0:
            assert replayed == 1, who
            assert kept and all(kept.values()), f"rank {who} rebuilt survivor links: {kept}"


@pytest.mark.timeout(240)
def test_a_rank_killed_in_the_first_step_gets_the_state_training_started_from(
    clean: str,
) -> None:
    # Nothing was committed yet: the survivors' state is the one DDP made the same
    # on every rank before step 0, and that is what the replacement receives.
    # Every member's DDP reducer is reset (the survivors' had recorded a first
    # iteration, the replacement's had rebuilt its buckets in its warm-up).
    faulty = _run(kill_at=0, with_ddp=True)
    assert sorted(faulty) == [(0, 0), (1, 0), (2, 1)], faulty
    for who, (digest, replayed, _, epoch) in faulty.items():
        assert digest == clean, f"rank {who} differs from the fault-free run"
        assert epoch == 1, who
        assert replayed == (1 if who[1] == 0 else 0), who
