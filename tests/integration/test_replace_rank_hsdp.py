"""A rank killed in an HSDP job gets its shards back from its replica.

Four processes train a small MLP with FSDP2 on a 2 x 2 (replicate x shard) mesh
over "resilient" under ``recovery.Session``, with AdamW (per-parameter optimizer
state, sharded like the parameters). Rank 3 kills itself inside backward at step
4; the stand-in launcher (tests._replace) starts it again. Rank 3's shards live
on rank 1 (same shard coordinate, the other replica row), so only rank 1 may be
its donor: the plan must say so, and the parameters and optimizer state after
the replayed steps must equal a fault-free run's bit for bit.

Plain FSDP (no replica) is refused at setup with a RecoveryError naming the rank;
with ``rollback=`` (``recovery.DcpCheckpoints``) every rank goes back to the last
checkpoint instead, and ends bitwise equal to a fault-free run too.
"""

from __future__ import annotations

import hashlib
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests._dist import run_dist
from tests._replace import NEVER, run_with_replacement

WORLD = 4
STEPS = 8
VICTIM = 3
KILL_AT = 4


def _build(rank: int, replicas: int) -> tuple[Any, Any]:
    import torch
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (replicas, WORLD // replicas), mesh_dim_names=("rep", "shard"))
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 32), nn.ReLU(), nn.Linear(32, 4))
    for layer in model:
        if isinstance(layer, nn.Linear):
            fully_shard(layer, mesh=mesh if replicas > 1 else mesh["shard"])
    fully_shard(model, mesh=mesh if replicas > 1 else mesh["shard"])
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _digest(model: Any, opt: Any) -> str:
    """SHA-256 of this rank's own shards: parameters and AdamW moments."""
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.to_local().detach().contiguous().numpy().tobytes())
        for value in opt.state.get(p, {}).values():
            local = value.to_local() if hasattr(value, "to_local") else value
            h.update(local.detach().contiguous().numpy().tobytes())
    return h.hexdigest()


def _worker(
    rank: int, port: int, incarnation: int, kill_at: int, results: Any, checkpoints: str = ""
) -> None:
    """HSDP on 2 x 2; with ``checkpoints`` (a directory), plain FSDP that saves a
    DCP checkpoint after steps 2 and 5 and rolls back to the latest."""
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(WORLD), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        RESILIENT_RAILS=f"127.0.1.{rank + 1}", RESILIENT_INCARNATION=str(incarnation),
        RESILIENT_OP_TIMEOUT_S="20", RESILIENT_REPLACE_TIMEOUT_S="60",
    )  # fmt: skip
    import torch
    import torch.distributed as dist

    import resilient
    from membership.epoch import epoch_record
    from recovery import DcpCheckpoints, ModelOptimizer, Session, TrainState

    torch.set_num_threads(1)
    pg = resilient.init()
    model, opt = _build(rank, replicas=1 if checkpoints else 2)
    saved = {"train": ModelOptimizer(model, opt)}
    ckpts = DcpCheckpoints(checkpoints) if checkpoints else None
    at = {"step": -1}

    def die_in_backward(grad: torch.Tensor) -> torch.Tensor:
        if rank == VICTIM and at["step"] == kill_at:
            os.kill(os.getpid(), signal.SIGKILL)
        return grad

    # Mid-backward: after the last layer's gradients went out, before the first's.
    # (A hook on a sharded parameter never fires: FSDP2 sets its grad itself.)
    def watch(_module: Any, _inputs: Any, out: torch.Tensor) -> None:
        out.register_hook(die_in_backward)

    model[1].register_forward_hook(watch)
    session = Session(pg, TrainState(model, opt), rollback=ckpts.rollback(saved) if ckpts else None)
    for step in session.steps(STEPS):
        with session.step(step):
            at["step"] = step
            gen = torch.Generator().manual_seed(rank * 1_000 + step)
            x = torch.randn(8, 32, generator=gen)
            loss = (model(x) - torch.sin(x[:, :4])).square().mean()
            opt.zero_grad(set_to_none=True)
            loss.backward()
            dist.all_reduce(loss.detach())
        if ckpts and session.committed == step and step % 3 == 2:
            ckpts.save(step, saved)
    record = epoch_record(pg.store, 1) or {}
    donors = record.get("donors")
    results.put((rank, incarnation, _digest(model, opt), session.replayed, pg.epoch, donors))
    del session
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(480)
def test_a_killed_hsdp_rank_gets_its_shards_from_its_replica() -> None:
    clean = run_with_replacement(_worker, world=WORLD, victim=VICTIM, kill_at=NEVER)
    assert sorted(clean) == [(r, 0) for r in range(WORLD)], clean
    faulty = run_with_replacement(_worker, world=WORLD, victim=VICTIM, kill_at=KILL_AT)
    assert sorted(faulty) == [(0, 0), (1, 0), (2, 0), (3, 1)], faulty
    for (rank, inc), (digest, replayed, epoch, donors) in faulty.items():
        assert digest == clean[(rank, 0)][0], f"rank {rank}.{inc}: shards differ from clean run"
        assert epoch == 1, (rank, inc)
        assert donors == {"3": 1}, donors  # rank 1 holds rank 3's shards; rank 0 does not
        if inc == 0:
            assert replayed == 1, rank


@pytest.mark.timeout(480)
def test_a_killed_plain_fsdp_rank_sends_every_rank_back_to_the_last_checkpoint(
    tmp_path: Path,
) -> None:
    # Plain FSDP: nobody holds rank 3's shards. A checkpoint after step 2; rank 3
    # dies in step 4's backward (step 3 was committed): every rank loads step 2
    # and replays 3 and 4.
    runs = {}
    for name, kill_at in (("clean", NEVER), ("faulty", KILL_AT)):
        (tmp_path / name).mkdir()
        extra = (str(tmp_path / name),)
        runs[name] = run_with_replacement(
            _worker, world=WORLD, victim=VICTIM, kill_at=kill_at, extra=extra
        )
    clean, faulty = runs["clean"], runs["faulty"]
    assert sorted(clean) == [(r, 0) for r in range(WORLD)], clean
    assert sorted(faulty) == [(0, 0), (1, 0), (2, 0), (3, 1)], faulty
    for (rank, inc), (digest, replayed, epoch, donors) in faulty.items():
        assert digest == clean[(rank, 0)][0], f"rank {rank}.{inc}: shards differ from clean run"
        assert epoch == 1, (rank, inc)
        assert donors == {}, donors  # every rank loaded the checkpoint: no peer sent a state
        if inc == 0:
            assert replayed == 2, rank  # steps 3 and 4 again, from the checkpoint of step 2


def _plain_fsdp(rank: int, world: int) -> str:
    import torch.distributed as dist

    from recovery.session import Session, TrainState
    from resilient.errors import RecoveryError

    model, opt = _build(rank, replicas=1)
    with pytest.raises(RecoveryError, match=r"rank 0's shards .* have no replica"):
        Session(dist.group.WORLD, TrainState(model, opt))
    return "refused"


@pytest.mark.timeout(180)
def test_plain_fsdp_state_is_refused_at_setup() -> None:
    assert run_dist(_plain_fsdp, WORLD) == ["refused"] * WORLD
