"""CUDA tensors over NCCL pair links (skipped without at least two GPUs)."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from resilient.group.args import check_tensors
from tests._dist import run_world

needs_gpus = pytest.mark.skipif(
    not torch.cuda.is_available() or torch.cuda.device_count() < 2 or not dist.is_nccl_available(),
    reason="needs CUDA, NCCL and at least two GPUs (one per rank)",
)


def _cuda_collectives(pg: Any, rank: int, world: int) -> list[float]:
    torch.cuda.set_device(rank)
    x = torch.arange(1000, dtype=torch.float32, device="cuda") * (rank + 1)
    pg.allreduce([x]).wait()
    torch.cuda.synchronize()
    want = torch.arange(1000, dtype=torch.float32) * sum(r + 1 for r in range(world))
    assert torch.equal(x.cpu(), want)
    outs = [torch.empty(4, device="cuda") for _ in range(world)]
    pg.allgather([outs], [torch.full((4,), float(rank), device="cuda")]).wait()
    assert [float(o[0]) for o in outs] == [float(r) for r in range(world)]
    return x[:3].cpu().tolist()


@needs_gpus
@pytest.mark.timeout(180)
def test_cuda_all_reduce_and_all_gather_over_nccl_links() -> None:
    results = run_world(_cuda_collectives, 2, rails=2)
    assert results[0] == results[1]


@pytest.mark.timeout(10)
def test_unsupported_device_or_mixed_devices_are_clear_errors() -> None:

    with pytest.raises(NotImplementedError, match="meta"):
        check_tensors("allreduce", [torch.empty(1, device="meta")])
    with pytest.raises(ValueError, match="several devices"):
        check_tensors("allreduce", [torch.empty(1), torch.empty(1, device="meta")])
