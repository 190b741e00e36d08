"""Every collective and dtype on 4 real processes over real gloo links (2 rails)."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch
import torch.distributed as dist

from resilient.errors import CollectiveMismatch
from tests._dist import reduce_opts, run_world

DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int32, torch.int64]
OPS = {
    "sum": dist.ReduceOp.SUM,
    "avg": dist.ReduceOp.AVG,
    "product": dist.ReduceOp.PRODUCT,
    "min": dist.ReduceOp.MIN,
    "max": dist.ReduceOp.MAX,
}


def _input(rank: int, n: int, dtype: torch.dtype, small: bool = False) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + rank)
    if dtype.is_floating_point:
        x = (
            torch.rand(n, generator=g, dtype=torch.float64) + 0.5
            if small
            else torch.randn(n, generator=g, dtype=torch.float64)
        )
        return x.to(dtype)
    lo, hi = (1, 4) if small else (-1000, 1000)
    return torch.randint(lo, hi, (n,), generator=g, dtype=dtype)


def _reference(world: int, n: int, dtype: torch.dtype, op: str) -> torch.Tensor:
    xs = [_input(r, n, dtype, small=op == "product") for r in range(world)]
    wide = torch.stack([x.to(torch.float64) if dtype.is_floating_point else x for x in xs])
    if op == "sum":
        return wide.sum(0)
    if op == "avg":
        return (
            wide.sum(0) / world
            if dtype.is_floating_point
            else torch.div(wide.sum(0), world, rounding_mode="trunc")
        )
    if op == "product":
        return wide.prod(0)
    return wide.min(0).values if op == "min" else wide.max(0).values


def _close(got: torch.Tensor, want: torch.Tensor, dtype: torch.dtype) -> bool:
    if not dtype.is_floating_point:
        return torch.equal(got, want.to(dtype))
    tol = {torch.float16: 2e-2, torch.bfloat16: 1e-1}.get(dtype, 1e-5)
    return torch.allclose(got.to(torch.float64), want, rtol=tol, atol=tol)


def _digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


def _all_collectives(pg: Any, rank: int, world: int) -> dict[str, str]:
    digests: dict[str, str] = {}
    for dtype in DTYPES:
        for n in (1, 3, 1001, 70_000):
            for name, op in OPS.items():
                t = _input(rank, n, dtype, small=name == "product")
                opts = dist.AllreduceOptions()
                opts.reduceOp = op
                pg.allreduce([t], opts).wait()
                assert _close(t, _reference(world, n, dtype, name), dtype), (dtype, n, name)
                digests[f"allreduce/{dtype}/{n}/{name}"] = _digest(t)
        # Non-contiguous input: a transposed view is reduced in place.
        base = _input(rank, 12 * 7, dtype).view(12, 7)
        view = base.t()
        pg.allreduce([view]).wait()
        want = _reference(world, 12 * 7, dtype, "sum").view(12, 7).t()
        assert _close(view, want, dtype)
        digests[f"noncontig/{dtype}"] = _digest(base)
        # all_gather (list and into-tensor forms)
        mine = _input(rank, 33, dtype)
        outs = [torch.empty(33, dtype=dtype) for _ in range(world)]
        pg.allgather([outs], [mine]).wait()
        assert all(torch.equal(outs[r], _input(r, 33, dtype)) for r in range(world))
        flat = torch.empty(world * 33, dtype=dtype)
        pg._allgather_base(flat, mine).wait()
        assert torch.equal(flat, torch.cat(outs))
        # reduce_scatter (list and tensor forms)
        full = [_input(rank * 10 + c, 17, dtype) for c in range(world)]
        out = torch.empty(17, dtype=dtype)
        pg.reduce_scatter([out], [full]).wait()
        want_rs = sum(_input(r * 10 + rank, 17, dtype).to(torch.float64) for r in range(world))
        assert _close(out, want_rs if dtype.is_floating_point else want_rs.to(dtype), dtype)
        out2 = torch.empty(17, dtype=dtype)
        pg._reduce_scatter_base(out2, torch.cat(full)).wait()
        assert torch.equal(out, out2)
        # broadcast from a non-zero root
        b = _input(rank, 5000, dtype)
        bopts = dist.BroadcastOptions()
        bopts.rootRank = 2
        pg.broadcast([b], bopts).wait()
        assert torch.equal(b, _input(2, 5000, dtype))
    pg.barrier().wait()
    return digests


@pytest.mark.timeout(300)
@pytest.mark.parametrize("topology", ["ring", "mesh"])
def test_every_collective_and_dtype_matches_reference_and_is_bitwise_equal_across_ranks(
    topology: str,
) -> None:
    results = run_world(_all_collectives, 4, rails=2, timeout_s=240, config={"topology": topology})
    assert results[0], "no collective ran"
    for other in results[1:]:
        assert other == results[0]


def _weights(pg: Any, rank: int, world: int) -> list[str]:
    from resilient.collectives.engine import Reduce

    out = []
    for weights in ((1.0, 1.0), (3.0, 1.0), (1.0, 0.0), (0.2, 5.0)):
        pg.engine.weights = weights
        t = _input(rank, 100_003, torch.float32)
        pg.engine.all_reduce(t, Reduce.SUM)
        out.append(_digest(t))
    return out


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("topology", "transport"), [("ring", "socket"), ("mesh", "socket"), ("ring", "gloo")]
)
def test_results_bitwise_independent_of_rail_weights(topology: str, transport: str) -> None:
    results = run_world(
        _weights, 4, rails=2, config={"topology": topology, "data_transport": transport}
    )
    assert len(set(results[0])) == 1, "rail weights changed the result bits"
    assert all(r == results[0] for r in results)


def _mismatches(pg: Any, rank: int, world: int) -> list[tuple[str, tuple[str, ...]]]:
    seen: list[tuple[str, tuple[str, ...]]] = []
    cases = [
        ("shape", lambda: pg.allreduce([torch.zeros(5 if rank != 1 else 6)])),
        (
            "dtype",
            lambda: pg.allreduce(
                [torch.zeros(5, dtype=torch.float64 if rank == 3 else torch.float32)]
            ),
        ),
        (
            "op",
            lambda: pg.allreduce(
                [torch.zeros(5)], reduce_opts(dist.ReduceOp.MAX if rank == 0 else dist.ReduceOp.SUM)
            ),
        ),
        ("collective", lambda: pg.barrier() if rank == 2 else pg.allreduce([torch.zeros(5)])),
    ]
    for name, call in cases:
        try:
            call().wait()
        except CollectiveMismatch as exc:
            seen.append((name, exc.fields))
            assert len(exc.calls) == world
        # The group stays usable: a matching call right after works.
        t = torch.ones(4)
        pg.allreduce([t]).wait()
        assert torch.equal(t, torch.full((4,), float(world)))
    return seen


@pytest.mark.timeout(120)
def test_mismatch_raises_on_every_rank_and_group_stays_usable() -> None:
    results = run_world(_mismatches, 4, rails=1)
    for seen in results:
        assert [name for name, _ in seen] == ["shape", "dtype", "op", "collective"]
        fields = dict(seen)
        assert "shape" in fields["shape"] and "dtype" in fields["dtype"]
        assert "reduce" in fields["op"] and "op" in fields["collective"]


def _checked_after_known(pg: Any, rank: int, world: int) -> list[str]:
    """A call known by dtype, shape and op (group.args.AllreduceCalls) does not
    vouch for one that differs in any of them (complex tensors reach the group only
    as real views through torch.distributed, so here they are a dtype it refuses)."""
    t = torch.full((8,), float(rank + 1))
    pg.allreduce([t], reduce_opts(dist.ReduceOp.SUM)).wait()
    assert torch.equal(t, torch.full((8,), float(sum(range(1, world + 1)))))
    seen = []
    for bad in (
        lambda: pg.allreduce([torch.ones(8, dtype=torch.cfloat)], reduce_opts(dist.ReduceOp.SUM)),
        lambda: pg.allreduce([torch.ones(8)], reduce_opts(dist.ReduceOp.BAND)),
    ):
        try:
            bad()
        except (TypeError, NotImplementedError) as exc:
            seen.append(type(exc).__name__)
    # Same dtype and shape, another op: its own reduction.
    t = torch.full((8,), float(rank + 1))
    pg.allreduce([t], reduce_opts(dist.ReduceOp.MAX)).wait()
    assert torch.equal(t, torch.full((8,), float(world)))
    return seen


@pytest.mark.timeout(60)
def test_known_calls_keep_their_checks() -> None:
    assert run_world(_checked_after_known, 2) == [["TypeError", "NotImplementedError"]] * 2


def _unsupported(pg: Any, rank: int, world: int) -> str:
    try:
        # Every op is supported on CPU tensors; a device this backend does not take
        # is refused before anything is posted.
        pg.recv([torch.zeros(1, device="meta")], 1 - rank, 0)
    except NotImplementedError as exc:
        return str(exc)
    return "no error"


@pytest.mark.timeout(60)
def test_an_unsupported_call_names_the_op() -> None:
    results = run_world(_unsupported, 2)
    assert all("recv" in r for r in results), results


def _peer_gone(pg: Any, rank: int, world: int) -> tuple[str, float]:
    import time

    from resilient.errors import CommunicationError

    pg.barrier().wait()
    if rank == world - 1:
        return ("left", 0.0)  # the harness shuts this rank's group down: its links close
    time.sleep(1.5)
    start = time.monotonic()
    try:
        pg.allreduce([torch.ones(100_000)]).wait()
    except CommunicationError as exc:
        return (type(exc).__name__, time.monotonic() - start)
    return ("no error", time.monotonic() - start)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("topology", ["ring", "mesh"])
def test_a_departed_peer_gives_a_typed_error_not_a_hang(topology: str) -> None:
    results = run_world(
        _peer_gone, 3, config={"topology": topology, "op_timeout_floor_s": 3.0}, timeout_s=60
    )
    assert results[-1] == ("left", 0.0)
    for kind, elapsed in results[:-1]:
        # Its links closed at its end on every rail: the peer is gone (PeerLost).
        # On the ring a rank may first fail on a live neighbour that gave up.
        allowed = ("PeerLost",) if topology == "mesh" else ("PeerLost", "LinkError")
        assert kind in (*allowed, "CollectiveTimeout"), kind
        assert elapsed < 3.0 + 5.0  # the op deadline, plus slack for a loaded machine


def _straggler_aware(pg: Any, rank: int, world: int) -> dict[str, str]:
    """The straggler-aware schedule (each rank in turn left out of the reduction)
    gives the mesh's bits: same fold order, only who folds changes."""
    from resilient.collectives.engine import Reduce, fold_rows

    out: dict[str, str] = {}
    for slow in (None, *range(world)):
        pg.engine.slow_rank = slow
        for dtype in (torch.float32, torch.bfloat16, torch.int64):
            for n, op in ((1, Reduce.SUM), (1001, Reduce.AVG), (300_001, Reduce.MAX)):
                t = _input(rank, n, dtype)
                pg.engine.all_reduce(t, op)
                want = fold_rows(torch.stack([_input(r, n, dtype) for r in range(world)]), op)
                assert torch.equal(t, want), (slow, dtype, n, op)
                out[f"{slow}/{dtype}/{n}/{op}"] = _digest(t)
    pg.engine.slow_rank = None
    return out


@pytest.mark.timeout(180)
def test_straggler_aware_all_reduce_is_bitwise_the_mesh_result_on_every_rank() -> None:
    results = run_world(_straggler_aware, 4, rails=2, timeout_s=150, config={"topology": "mesh"})
    assert all(r == results[0] for r in results)
    assert len(results[0]) == 5 * 3 * 3


def _reordered(pg: Any, rank: int, world: int, order: tuple[int, ...]) -> dict[str, Any]:
    # Checks off: with the exchange on, every call would set the order from the
    # rows (which name no cut pair here) before moving data.
    pg.engine.order = order
    digests = _all_collectives(pg, rank, world)
    return {"digests": digests, "peers": sorted({p for p, _ in pg.links.links()})}


@pytest.mark.timeout(300)
def test_a_reordered_ring_keeps_every_collective_right_and_avoids_the_skipped_pairs() -> None:
    # Ring 0-2-1-3: ranks 0 and 1 (and 2 and 3) are never neighbours, as when no
    # rail connects them (resilient.collectives.reorder).
    order = (0, 2, 1, 3)
    results = run_world(
        _reordered,
        4,
        rails=2,
        timeout_s=240,
        args=(order,),
        config={"topology": "ring", "check_mismatch": False},
    )
    for other in results[1:]:
        assert other["digests"] == results[0]["digests"]
    for rank, res in enumerate(results):
        pos = order.index(rank)
        assert res["peers"] == sorted({order[pos - 1], order[(pos + 1) % 4]}), (rank, res)
