"""all_reduce of sparse COO tensors (SUM), as gloo does: every rank's entries summed."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests._dist import reduce_opts, run_world


def _entries(rank: int) -> torch.Tensor:
    # Rank 1 holds nothing; the others overlap at row 2, and each row has two
    # dense columns (a hybrid tensor), so duplicates must be summed.
    if rank == 1:
        empty = torch.zeros((1, 0), dtype=torch.int64)
        return torch.sparse_coo_tensor(empty, torch.zeros((0, 2)), (6, 2), check_invariants=True)
    rows = torch.tensor([[2, rank + 3]])
    vals = torch.tensor([[1.5 * (rank + 1), -1.0], [0.25, float(rank)]])
    return torch.sparse_coo_tensor(rows, vals, (6, 2), check_invariants=True)


def _sparse(pg: Any, rank: int, world: int) -> tuple[list[list[float]], int, str]:
    import torch.distributed as dist

    t = _entries(rank)
    pg.allreduce([t], reduce_opts(dist.ReduceOp.SUM)).wait()
    try:
        pg.allreduce([_entries(rank)], reduce_opts(dist.ReduceOp.MAX)).wait()
        refused = "no error"
    except NotImplementedError as exc:
        refused = str(exc)
    # The group still works after the refusal.
    dense = torch.ones(3)
    pg.allreduce([dense]).wait()
    return t.to_dense().tolist(), int(t._nnz()), refused + f" / {dense.tolist()}"


@pytest.mark.timeout(90)
def test_sparse_all_reduce_sums_every_ranks_entries() -> None:
    world = 3
    want = sum((_entries(r).to_dense() for r in range(world)), torch.zeros(6, 2))
    results = run_world(_sparse, world)
    for rank, (dense, nnz, refused) in enumerate(results):
        assert dense == want.tolist(), rank
        assert nnz == 3, rank  # rows 2, 3 and 5, coalesced
        assert "SUM only" in refused and refused.endswith("[3.0, 3.0, 3.0]"), (rank, refused)
