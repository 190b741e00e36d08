"""recovery.DcpCheckpoints on a one-process gloo group: FSDP2 state saved, resumed
and rolled back (through recovery.restore.roll_back) bit for bit, and what raises."""

from __future__ import annotations

import multiprocessing as mp
from pathlib import Path
from typing import Any

import pytest


def _one_rank(directory: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from recovery import DcpCheckpoints, ModelOptimizer
    from recovery.agree import Plan
    from recovery.restore import roll_back
    from resilient.errors import RecoveryError

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    seen: dict[str, Any] = {}

    def build(seed: int) -> tuple[Any, Any]:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 8), torch.nn.ReLU(), torch.nn.Linear(8, 2))
        mesh = init_device_mesh("cpu", (1,))
        fully_shard(model[0], mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    def train(model: Any, opt: Any, step: int) -> None:
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        opt.zero_grad(set_to_none=True)
        model(x).square().mean().backward()
        opt.step()

    def snapshot(model: Any, opt: Any) -> list[Any]:
        out = [p.full_tensor().clone() for p in model.parameters()]
        for p in model.parameters():
            out += [v.full_tensor().clone() if hasattr(v, "full_tensor") else v.clone()
                    for v in opt.state[p].values()]  # fmt: skip
        return out

    def same(a: list[Any], b: list[Any]) -> bool:
        return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))

    try:
        checkpoints = DcpCheckpoints(directory)
        model, opt = build(0)
        state = {"train": ModelOptimizer(model, opt)}
        seen["latest before"] = checkpoints.latest()
        seen["resume nothing"] = checkpoints.resume(state)
        for step in range(3):
            train(model, opt, step)
        checkpoints.save(2, state)
        at_2 = snapshot(model, opt)
        for step in range(3, 5):
            train(model, opt, step)
        checkpoints.save(4, state)
        at_4 = snapshot(model, opt)
        train(model, opt, 5)
        seen["latest"] = checkpoints.latest()
        # The rollback a Session runs: the minimum over the members, then the load.
        rollback = checkpoints.rollback(state)
        plan = Plan(epoch=1, members=(0,), step=5, donor=0, receivers=(), joined=(),
                    keep_data={}, keep_ctl={})  # fmt: skip
        seen["rolled back to"] = roll_back(dist.group.WORLD, rollback, plan)
        seen["rollback equal"] = same(snapshot(model, opt), at_4)
        # An older one still loads, also into a callable's state; and into a new
        # model built with other weights (as a fresh run resumes).
        checkpoints.rollback(lambda: state).load(2)
        seen["older equal"] = same(snapshot(model, opt), at_2)
        other, other_opt = build(1)
        seen["resume"] = checkpoints.resume({"train": ModelOptimizer(other, other_opt)})
        seen["resumed equal"] = same(snapshot(other, other_opt), at_4)
        try:
            checkpoints.load(3, state)
        except RecoveryError as exc:
            seen["missing"] = str(exc)
        (Path(directory) / "latest").write_text("four")
        try:
            checkpoints.latest()
        except RecoveryError as exc:
            seen["garbled"] = str(exc)
    finally:
        dist.destroy_process_group()
    return seen


@pytest.mark.timeout(120)
def test_dcp_checkpoints_save_resume_and_roll_back_fsdp_state(tmp_path: Path) -> None:
    # In a process of its own (see tests/recovery/test_replicas.py).
    with mp.get_context("spawn").Pool(1) as pool:
        seen = pool.map(_one_rank, [str(tmp_path)], chunksize=1)[0]
    assert (seen["latest before"], seen["resume nothing"]) == (-1, 0)
    assert seen["latest"] == 4
    assert seen["rolled back to"] == 4 and seen["rollback equal"] is True
    assert seen["older equal"] is True
    assert seen["resume"] == 5 and seen["resumed equal"] is True
    assert seen["missing"].startswith("recovery: no checkpoint of step 3 ("), seen["missing"]
    assert "holds 'four', not a step number" in seen["garbled"], seen["garbled"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["latest", "step-2", "step-4"]
