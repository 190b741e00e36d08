"""A killed rank is replaced in a job that also uses subgroups (a 2 x 2 DeviceMesh).

Four processes train a small MLP with DDP over "resilient" under
``recovery.Session``; each step also reduces a step-dependent tensor over the
mesh's "rep" dimension and gathers it over its "shard" dimension (subgroups made
by ``init_device_mesh``). Rank 3 kills itself inside backward at step 4; the test,
standing in for the launcher, starts it again as incarnation 1, and the
replacement makes the same mesh (the same group names) before it is admitted.
Every subgroup must follow the world group into the next epoch: the step is
replayed, the subgroups' results of every step after the kill equal a fault-free
run's, and so do the parameters.
"""

from __future__ import annotations

import functools
import hashlib
import os
import signal
from typing import Any

import pytest

from tests._replace import NEVER, run_with_replacement

WORLD = 4
STEPS = 8
VICTIM = 3
KILL_AT = 4


def _worker(rank: int, port: int, incarnation: int, kill_at: int, results: Any) -> None:
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        RESILIENT_RAILS=f"127.0.1.{rank + 1}", RESILIENT_INCARNATION=str(incarnation),
        RESILIENT_OP_TIMEOUT_S="5", RESILIENT_REPLACE_TIMEOUT_S="30",
    )  # fmt: skip
    import torch
    import torch.distributed as dist
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh

    import resilient
    from recovery.session import Session, TrainState

    torch.set_num_threads(1)
    pg = resilient.init()
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
    rep, shard = mesh.get_group("rep"), mesh.get_group("shard")
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    at = {"step": NEVER + 1}
    seen: dict[int, list[float]] = {}

    def die_in_backward(grad: torch.Tensor) -> torch.Tensor:
        if rank == VICTIM and at["step"] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return grad

    model[0].weight.register_hook(die_in_backward)

    def train_step(
        step: int, ddp: nn.Module = ddp, opt: torch.optim.Optimizer = opt
    ) -> torch.Tensor:
        gen = torch.Generator().manual_seed(rank * 1_000 + step)
        loss = ddp(torch.randn(8, 64, generator=gen)).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        t = torch.full((3,), float(10 * rank + step))
        dist.all_reduce(t, group=rep)
        out = torch.empty(6)
        dist.all_gather_into_tensor(out, t, group=shard)
        seen[step] = out.tolist()
        return loss.detach()

    session = Session(pg, TrainState(model, opt), warmup=functools.partial(train_step, 0), ddp=ddp)
    for step in session.steps(STEPS):
        with session.step(step):
            at["step"] = step
            dist.all_reduce(train_step(step))
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    names = (rep.group_name, shard.group_name)
    results.put((rank, incarnation, h.hexdigest(), session.replayed, seen, names, pg.epoch))
    del session, train_step, ddp, opt
    dist.barrier()
    dist.destroy_process_group()


def _run(kill_at: int) -> dict[tuple[int, int], Any]:
    return run_with_replacement(_worker, world=WORLD, victim=VICTIM, kill_at=kill_at)


@pytest.mark.timeout(420)
def test_subgroups_follow_the_world_group_when_a_killed_rank_is_replaced() -> None:
    clean = _run(kill_at=NEVER)
    assert sorted(clean) == [(r, 0) for r in range(WORLD)], clean
    faulty = _run(kill_at=KILL_AT)
    assert sorted(faulty) == [(0, 0), (1, 0), (2, 0), (3, 1)], faulty
    for (rank, inc), (digest, replayed, seen, names, epoch) in faulty.items():
        want_digest, _, want_seen, want_names, _ = clean[(rank, 0)]
        assert digest == want_digest, f"rank {rank}.{inc}: parameters differ from the clean run"
        assert names == want_names, (rank, inc)  # the same groups, by name
        assert epoch == 1, (rank, inc)
        for step in range(KILL_AT, STEPS):
            assert seen[step] == want_seen[step], (rank, inc, step)
        if inc == 0:
            assert replayed == 1, rank
