"""reduce, gather and scatter on real processes (socket links), against references
computed here, and through torch's public API against gloo.

Floats carry integer values, so every sum is exact whatever the fold order; bool
sums are logical or, as torch's in-place add.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from tests._dist import run_dist, run_world

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.uint8, torch.bool]
# 6 elements travel inside the signature rows; 40,000 take the engine's data path.
SIZES = (6, 40_000)


def _input(rank: int, n: int, dtype: torch.dtype, salt: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * rank + n + salt)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    hi = 50 if dtype == torch.uint8 else 100  # no uint8 wrap-around over 3 ranks
    return torch.randint(0, hi, (n,), generator=g).to(dtype)


def _ref_reduce(world: int, n: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    acc = _input(0, n, dtype).clone()
    for r in range(1, world):
        x = _input(r, n, dtype)
        if op == "sum":
            acc.add_(x)
        else:
            torch.maximum(acc, x, out=acc)
    return acc


def _opts(kind: str, root: int, op: Any = None) -> Any:
    o = {"reduce": dist.ReduceOptions, "gather": dist.GatherOptions}.get(
        kind, dist.ScatterOptions
    )()
    o.rootRank = root
    if op is not None:
        o.reduceOp = op
    return o


def _reduce_case(pg: Any, rank: int, world: int, dtype: torch.dtype, n: int, root: int) -> None:
    for name, op in (("sum", dist.ReduceOp.SUM), ("max", dist.ReduceOp.MAX)):
        mine = _input(rank, n, dtype)
        # Non-contiguous: every other element of a tensor twice as long.
        holder = torch.zeros(2 * n, dtype=dtype)
        t = holder[::2]
        t.copy_(mine)
        pg.reduce([t], _opts("reduce", root, op)).wait()
        if rank == root:
            assert torch.equal(t, _ref_reduce(world, n, dtype, name)), (dtype, n, root, name)
        else:
            assert torch.equal(t, mine), "a non-root tensor changed"
        assert not holder[1::2].any(), "reduce wrote outside the view"


def _gather_scatter_case(
    pg: Any, rank: int, world: int, dtype: torch.dtype, n: int, root: int
) -> None:
    outs = [torch.zeros(n, dtype=dtype) for _ in range(world)] if rank == root else []
    pg.gather([outs] if outs else [], [_input(rank, n, dtype)], _opts("gather", root)).wait()
    if rank == root:
        for r in range(world):
            assert torch.equal(outs[r], _input(r, n, dtype)), (dtype, n, root, r)
    half = (n // 2, 2)
    ins = [_input(root, n, dtype, salt=7 + r).view(half) for r in range(world)]
    # A 2-D non-contiguous output: a transposed view.
    out = torch.zeros((2, n // 2), dtype=dtype).t()
    pg.scatter([out], [ins] if rank == root else [], _opts("scatter", root)).wait()
    assert torch.equal(out, ins[rank]), (dtype, n, root)


def _every_rooted_call(pg: Any, rank: int, world: int) -> int:
    checked = 0
    for dtype in DTYPES:
        for n in SIZES:
            for root in range(1, world):  # roots other than 0
                _reduce_case(pg, rank, world, dtype, n, root)
                _gather_scatter_case(pg, rank, world, dtype, n, root)
                checked += 1
    return checked


@pytest.mark.timeout(300)
@pytest.mark.parametrize("world", [2, 3])
def test_reduce_gather_scatter_every_dtype_and_root(world: int) -> None:
    results = run_world(_every_rooted_call, world, timeout_s=240.0)
    assert results == [len(DTYPES) * len(SIZES) * (world - 1)] * world


@pytest.mark.timeout(240)
def test_rooted_calls_with_checks_off() -> None:
    # No signature exchange: even the small calls take the engine's data path.
    results = run_world(_every_rooted_call, 2, timeout_s=200.0, config={"check_mismatch": False})
    assert results == [len(DTYPES) * len(SIZES)] * 2


def _bad_calls(pg: Any, rank: int, world: int) -> list[str]:
    msgs = []
    t = torch.ones(4)
    calls = [
        lambda: pg.reduce([t], _opts("reduce", world, dist.ReduceOp.SUM)),
        lambda: pg.gather([], [t], _opts("gather", -1)),
        lambda: pg.scatter([t], [], _opts("scatter", 7)),
    ]
    if rank == 0:  # only the root checks its lists (the others would queue their calls)
        calls += [
            # The root passes one output too few.
            lambda: pg.gather([[torch.ones(4)] * (world - 1)], [t], _opts("gather", 0)),
            # The root's inputs are shaped unlike the output.
            lambda: pg.scatter([t], [[torch.ones(5)] * world], _opts("scatter", 0)),
        ]
    for call in calls:
        try:
            call()
            msgs.append("no error")
        except (ValueError, TypeError) as exc:
            msgs.append(f"{type(exc).__name__}: {exc}")
    # The group still works: nothing was queued.
    x = torch.full((3,), float(rank + 1))
    pg.reduce([x], _opts("reduce", 0, dist.ReduceOp.SUM)).wait()
    msgs.append(str(x.tolist()))
    return msgs


@pytest.mark.timeout(120)
def test_bad_rooted_calls_raise_on_the_callers_thread() -> None:
    results = run_world(_bad_calls, 3)
    for rank, msgs in enumerate(results):
        assert "reduce: root rank 3 is out of range" in msgs[0], msgs
        assert "gather: root rank -1 is out of range" in msgs[1], msgs
        assert "scatter: root rank 7 is out of range" in msgs[2], msgs
        if rank == 0:
            assert "ValueError" in msgs[3] and "3 tensors" in msgs[3], msgs
            assert "ValueError" in msgs[4] and "shape (5,)" in msgs[4], msgs
    assert results[0][-1] == str([6.0, 6.0, 6.0])
    assert results[1][-1] == str([2.0, 2.0, 2.0])  # a non-root tensor is left as it was


# -- through torch's public API, against gloo -----------------------------------------
WORLD = 3


def _api_rank(rank: int, world: int) -> tuple[str, dict[str, Any]]:
    gloo = dist.new_group(backend="gloo")
    out = {}
    for name, group in (("resilient", None), ("gloo", gloo)):
        x = torch.arange(5, dtype=torch.float64) * (rank + 1)
        dist.reduce(x, dst=2, op=dist.ReduceOp.SUM, group=group)
        g = [torch.zeros(4, dtype=torch.int64) for _ in range(WORLD)] if rank == 1 else None
        dist.gather(torch.full((4,), rank, dtype=torch.int64), g, dst=1, group=group)
        s = torch.zeros(3)
        chunks = [torch.full((3,), 10.0 * r) for r in range(WORLD)] if rank == 2 else None
        dist.scatter(s, chunks, src=2, group=group)
        out[name] = (x.tolist() if rank == 2 else None,
                     [t.tolist() for t in g] if g else None, s.tolist())  # fmt: skip
    return type(dist.group.WORLD).__name__, out


@pytest.mark.timeout(150)
def test_reduce_gather_scatter_through_torch_match_gloo() -> None:
    seen = dict(enumerate(run_dist(_api_rank, WORLD, timeout_s=120)))
    for rank, (kind, out) in seen.items():
        assert kind == "ResilientProcessGroup", (rank, kind)
        assert out["resilient"] == out["gloo"], (rank, out)
        assert out["resilient"][2] == [10.0 * rank] * 3, (rank, out)
    assert seen[2][1]["resilient"][0] == [0.0, 6.0, 12.0, 18.0, 24.0]
    assert seen[1][1]["resilient"][1] == [[r] * 4 for r in range(WORLD)]
