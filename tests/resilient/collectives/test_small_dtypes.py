"""uint8, int8, int16 and bool in every collective, on 3 real processes (socket links).

These are the dtypes gloo takes beyond the float and 32/64-bit integer ones; the
object collectives ride on uint8 (tests/integration/test_object_collectives.py).
Integers wrap as torch's in-place ops do; bool sums are logical or, products and
minimums logical and.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests._dist import broadcast_opts, reduce_opts, run_world

pytestmark = pytest.mark.timeout(180)

DTYPES = [torch.uint8, torch.int8, torch.int16, torch.bool]
OPS = {"sum": dist.ReduceOp.SUM, "max": dist.ReduceOp.MAX, "min": dist.ReduceOp.MIN}


def _input(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + n)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    lo, hi = (0, 256) if dtype == torch.uint8 else (-100, 100)
    return torch.randint(lo, hi, (n,), generator=g).to(dtype)


def _reference(world: int, n: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    """Folded in rank order with the same in-place ops (wrapping as they do)."""
    acc = _input(0, n, dtype).clone()
    for r in range(1, world):
        x = _input(r, n, dtype)
        if op == "sum":
            acc.add_(x)
        else:
            (torch.maximum if op == "max" else torch.minimum)(acc, x, out=acc)
    return acc


def _every_collective(pg: Any, rank: int, world: int) -> list[str]:
    checked = []
    for dtype in DTYPES:
        # 3 and 40,000 elements: the inline rows and the data path (mesh, C steps).
        for n in (3, 40_000):
            for name, op in OPS.items():
                t = _input(rank, n, dtype)
                pg.allreduce([t], reduce_opts(op)).wait()
                assert torch.equal(t, _reference(world, n, dtype, name)), (dtype, n, name)
                checked.append(f"allreduce/{dtype}/{n}/{name}")
            t = _input(rank, n, dtype) if rank == 1 else torch.zeros(n, dtype=dtype)
            pg.broadcast([t], broadcast_opts(1)).wait()
            assert torch.equal(t, _input(1, n, dtype)), (dtype, n)
            outs = [torch.zeros(n, dtype=dtype) for _ in range(world)]
            pg.allgather([outs], [_input(rank, n, dtype)]).wait()
            assert all(torch.equal(outs[r], _input(r, n, dtype)) for r in range(world))
            full = torch.cat([_input(rank * 10 + c, n, dtype) for c in range(world)])
            out = torch.zeros(n, dtype=dtype)
            pg._reduce_scatter_base(out, full, dist.ReduceScatterOptions()).wait()
            want = _input(0 * 10 + rank, n, dtype).clone()
            for r in range(1, world):
                want.add_(_input(r * 10 + rank, n, dtype))
            assert torch.equal(out, want), (dtype, n)
            checked.append(f"others/{dtype}/{n}")
        # 9 MiB: the ring (all_reduce of 8 MiB or more), folded by torch in C steps.
        n = 9 << 20
        t = _input(rank, n, dtype)
        pg.allreduce([t], reduce_opts(dist.ReduceOp.SUM)).wait()
        assert torch.equal(t, _reference(world, n, dtype, "sum")), (dtype, n)
        checked.append(f"ring/{dtype}")
    return checked


def test_small_integer_and_bool_dtypes_in_every_collective() -> None:
    results = run_world(_every_collective, 3, timeout_s=150.0)
    assert all(len(r) == len(DTYPES) * (2 * (len(OPS) + 1) + 1) for r in results), results


def _avg_of_bools(pg: Any, rank: int, world: int) -> str:
    t = torch.ones(4, dtype=torch.bool)
    try:
        pg.allreduce([t], reduce_opts(dist.ReduceOp.AVG))
    except TypeError as exc:
        # The group is still usable after the refusal.
        pg.allreduce([t], reduce_opts(dist.ReduceOp.MIN)).wait()
        assert bool(t.all())
        return str(exc)
    return "no error"


def test_an_average_of_bools_is_refused_on_the_callers_thread() -> None:
    for msg in run_world(_avg_of_bools, 2):
        assert "AVG of bool tensors" in msg, msg
