"""all_to_all and all_to_all_single on real processes (socket links), against
references computed here: equal and uneven splits (zero-size ones included), every
dtype, non-contiguous tensors, two rails, checks off, disagreeing splits, equal-split
calls run elided (and refused at their gate when a peer's call differs), and
through torch's public API against gloo.

Rank ``i``'s block for rank ``j`` holds values made from (i, j) alone, so every
rank knows what it must receive.
"""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from resilient.errors import CollectiveMismatch
from tests._dist import run_dist, run_world, stop_c_steps_early

DTYPES = [torch.float32, torch.float64, torch.bfloat16, torch.int64, torch.uint8, torch.bool]
COLS = 3


def _block(i: int, j: int, rows: int, dtype: torch.dtype) -> torch.Tensor:
    """What rank ``i`` sends rank ``j``: ``rows`` rows of COLS."""
    g = torch.Generator().manual_seed(100 * i + j + 7 * rows)
    v = torch.randint(0, 2 if dtype == torch.bool else 100, (rows, COLS), generator=g)
    return v.to(dtype)


def _uneven(i: int, j: int, world: int) -> int:
    """Rows rank ``i`` sends rank ``j`` (0 for some pairs)."""
    return (i + 2 * j) % world


def _single(pg: Any, rank: int, world: int, dtype: torch.dtype, rows_of: Any) -> None:
    """all_to_all_single with ``rows_of(i, j)`` rows from i to j; a non-contiguous
    input (a transposed copy's transpose) and output."""
    splits_in = [rows_of(rank, j) for j in range(world)]
    splits_out = [rows_of(i, rank) for i in range(world)]
    inp = torch.cat([_block(rank, j, splits_in[j], dtype) for j in range(world)])
    inp = inp.t().contiguous().t()  # same values, column-major
    out = torch.zeros((COLS, sum(splits_out)), dtype=dtype).t()
    # (A single row is contiguous either way.)
    assert inp.is_contiguous() == (sum(splits_in) < 2), splits_in
    assert out.is_contiguous() == (sum(splits_out) < 2), splits_out
    equal = len(set(splits_in)) == 1 and len(set(splits_out)) == 1
    pg.alltoall_base(out, inp, [] if equal else splits_out, [] if equal else splits_in).wait()
    want = torch.cat([_block(i, rank, splits_out[i], dtype) for i in range(world)])
    assert torch.equal(out, want), (dtype, splits_in, splits_out)


def _listed(pg: Any, rank: int, world: int, dtype: torch.dtype) -> None:
    """all_to_all of lists, blocks of different sizes per pair (zero-size included)."""
    ins = [_block(rank, j, _uneven(rank, j, world), dtype) for j in range(world)]
    outs = [torch.ones((_uneven(i, rank, world), COLS), dtype=dtype) for i in range(world)]
    pg.alltoall(outs, ins).wait()
    for i in range(world):
        assert torch.equal(outs[i], _block(i, rank, _uneven(i, rank, world), dtype)), (dtype, i)


def _every_dtype(pg: Any, rank: int, world: int) -> int:
    checked = 0
    for dtype in DTYPES:
        _single(pg, rank, world, dtype, lambda i, j: 2)
        _single(pg, rank, world, dtype, lambda i, j: _uneven(i, j, world))
        _listed(pg, rank, world, dtype)
        checked += 1
    # 3 MiB of float32 per rank: well past the inline rows, in 1 MiB messages.
    _single(pg, rank, world, torch.float32, lambda i, j: 1 << 18 if i != j else 5)
    return checked


@pytest.mark.timeout(240)
@pytest.mark.parametrize("world", [2, 3])
def test_all_to_all_every_dtype_equal_and_uneven(world: int) -> None:
    assert run_world(_every_dtype, world, timeout_s=200.0) == [len(DTYPES)] * world


@pytest.mark.timeout(240)
def test_all_to_all_with_checks_off() -> None:
    # Splits then travel in an all_gather of their own, not in the signature rows.
    results = run_world(_every_dtype, 3, timeout_s=200.0, config={"check_mismatch": False})
    assert results == [len(DTYPES)] * 3


def _rail1_bytes(pg: Any) -> int:
    """Bytes the kernel saw acknowledged on this rank's rail-1 links (C steps move
    them past the links' op counters)."""
    return sum(
        (link.sent() or (0,))[0] for (_, rail), link in pg.links.links().items() if rail == 1
    )


def _two_rails(pg: Any, rank: int, world: int, slice_s: float = -1.0) -> tuple[int, int, int]:
    from resilient.links import native_steps

    stop_c_steps_early(rank, slice_s)
    pg.barrier().wait()  # builds the links: the count below is the exchanges' own
    before, stats = _rail1_bytes(pg), dict(native_steps.STATS)
    # 2 MiB per message: above single_rail_below_bytes, so cut across both rails.
    for _ in range(3):
        _single(pg, rank, world, torch.float32, lambda i, j: (2 << 20) // (4 * COLS))
        _single(pg, rank, world, torch.int64, lambda i, j: _uneven(i, j, world) * 30_000)
    moved = {k: native_steps.STATS[k] - stats[k] for k in ("c_passes", "stopped")}
    return _rail1_bytes(pg) - before, moved["c_passes"], moved["stopped"]


@pytest.mark.timeout(300)
def test_all_to_all_single_on_two_rails_in_c_steps_on_channels_and_handed_back() -> None:
    on = run_world(_two_rails, 3, rails=2, timeout_s=200.0)
    off = run_world(_two_rails, 3, rails=2, timeout_s=200.0, config={"native_io": False})
    stopping = run_world(_two_rails, 3, rails=2, args=(0.002,), timeout_s=200.0)
    # Every rank sent about half of 6 x 2 MiB to its peers on rail 1, however moved.
    assert all(n >= 4 << 20 for n, _, _ in on + off + stopping), (on, off, stopping)
    assert all(c > 0 for _, c, _ in on) and all(c == 0 for _, c, _ in off)
    assert sum(stopped for *_, stopped in stopping) > 0


def _bad_splits(pg: Any, rank: int, world: int) -> list[str]:
    msgs = []
    # Rank 1 expects 2 rows from rank 0, which sends it 1.
    splits_in = [1] * world
    splits_out = [2 if rank == 1 and i == 0 else 1 for i in range(world)]
    out = torch.zeros((sum(splits_out), 4))
    try:
        pg.alltoall_base(out, torch.ones((world, 4)), splits_out, splits_in).wait()
        msgs.append("no error")
    except ValueError as exc:
        msgs.append(str(exc))
    assert not out.any(), "data moved although the splits disagreed"
    for call in (
        # Output rows do not add up to the output's dim 0.
        lambda: pg.alltoall_base(torch.zeros(5, 4), torch.ones(world, 4), [1] * world, []),
        # Dim 0 does not divide into equal splits.
        lambda: pg.alltoall_base(torch.zeros(world + 1), torch.ones(world + 1), [], []),
        # Input and output of different dtypes.
        lambda: pg.alltoall_base(torch.zeros(world, dtype=torch.int64), torch.ones(world), [], []),
        # Not one tensor per rank.
        lambda: pg.alltoall([torch.zeros(1)], [torch.zeros(1)]),
    ):
        try:
            call()
            msgs.append("no error")
        except (ValueError, TypeError) as exc:
            msgs.append(f"{type(exc).__name__}: {exc}")
    t = torch.ones(2)
    pg.allreduce([t]).wait()  # the group still works
    msgs.append(str(t.tolist()))
    return msgs


@pytest.mark.timeout(120)
@pytest.mark.parametrize("checks", [True, False])
def test_disagreeing_splits_fail_on_every_rank_and_the_group_goes_on(checks: bool) -> None:
    results = run_world(_bad_splits, 3, config={"check_mismatch": checks})
    first = results[0][0]
    assert "split sizes disagree" in first, first
    assert "rank 0 sends 4 to rank 1, which expects 8 from it" in first, first
    for msgs in results:
        assert msgs[0] == first  # the same error on every rank
        assert "ValueError" in msgs[1] and "adding up to its dim 0 (5)" in msgs[1], msgs
        assert "ValueError" in msgs[2] and "does not divide into 3" in msgs[2], msgs
        assert "TypeError" in msgs[3] and "share a dtype" in msgs[3], msgs
        assert "ValueError" in msgs[4] and "need 3 inputs" in msgs[4], msgs
        assert msgs[5] == str([3.0, 3.0])


# -- equal-split calls run elided ---------------------------------------------------
def _equal(pg: Any, rank: int, world: int, rows: int = 2) -> None:
    """An equal-split call (``rows`` rows of COLS per rank), checked."""
    inp = torch.cat([_block(rank, j, rows, torch.float32) for j in range(world)])
    out = torch.zeros((world * rows, COLS))
    pg.alltoall_base(out, inp, [], []).wait()
    want = torch.cat([_block(i, rank, rows, torch.float32) for i in range(world)])
    assert torch.equal(out, want), rows


def _elided_calls(pg: Any, rank: int, world: int) -> tuple[int, int, int]:
    ch = pg.epochs.checks
    _equal(pg, rank, world)  # call 1: the full exchange, which finds the group quiet
    for rows in (2, 2, 5, 2, 2, 0, 2, 2):  # explicit equal splits elide alike
        _equal(pg, rank, world, rows)
    inp = torch.ones((world * 3, COLS)) * rank
    out = torch.zeros_like(inp)
    pg.alltoall_base(out, inp, [3] * world, [3] * world).wait()
    assert torch.equal(out[:, 0], torch.arange(world).repeat_interleave(3).float())
    return ch.exchanges, ch.elided, ch.fallbacks


@pytest.mark.timeout(120)
def test_equal_split_calls_skip_their_exchange() -> None:
    for exchanges, elided_calls, fallbacks in run_world(
        _elided_calls, 4, config={"elide_every": 4}
    ):
        assert exchanges + elided_calls == 10
        # Calls 1, 4 and 8 exchange; the others elide while the group is quiet (a
        # straggler confirmed on a loaded host may cost a few), and never fall back.
        assert elided_calls > 0 and exchanges >= 3, (exchanges, elided_calls)
        assert fallbacks == 0


def _odd_calls(pg: Any, rank: int, world: int) -> dict[str, Any]:
    def single(out: torch.Tensor, inp: torch.Tensor, so: list[int], si: list[int]) -> Any:
        return pg.alltoall_base(out, inp, so, si)

    ones = torch.ones((world, 4))
    cases = {
        # Rank 1 expects 2 rows from rank 0, which sends it 1.
        "splits": lambda out: single(out, ones, [2, 1, 1, 1] if rank == 1 else [1] * 4, [1] * 4),
        "block": lambda out: (
            single(out, torch.ones((2 * world, 4)), [], [])
            if rank == 2
            else single(out, ones, [], [])
        ),
        "dtype": lambda out: (
            single(out.double(), ones.double(), [], []) if rank == 3 else single(out, ones, [], [])
        ),
        "collective": lambda out: pg.allreduce([out]) if rank == 0 else single(out, ones, [], []),
    }
    seen: dict[str, Any] = {}
    ch = pg.epochs.checks
    refusals = []  # per odd call: (ran elided, fell back)
    _equal(pg, rank, world)  # call 1: the full exchange
    for name, call in cases.items():
        rows = {("splits", 1): world + 1, ("block", 2): 2 * world}.get((name, rank), world)
        out = torch.zeros((rows, 4))
        before = (ch.elided, ch.fallbacks)
        try:
            call(out).wait()
            seen[name] = "no error"
        except ValueError as exc:
            seen[name] = str(exc)
        except CollectiveMismatch as exc:
            seen[name] = exc.fields
        refusals.append((ch.elided - before[0], ch.fallbacks - before[1]))
        assert not out.any(), f"{name}: data moved although the calls differed"
        _equal(pg, rank, world)  # the group still works (checked: the quiet ended)
        _equal(pg, rank, world)  # and elides again
    # A legitimate mix of equal and uneven splits (no digest on rank 0 and 1): rank 0
    # sends rank 1 one row more, and itself one less.
    send = [0, 2, 1, 1] if rank == 0 else [1] * world
    recv = {0: [0, 1, 1, 1], 1: [2, 1, 1, 1]}.get(rank, [1] * world)
    out = torch.zeros((sum(recv), 4))
    single(out, torch.full((sum(send), 4), float(rank)), recv, send).wait()
    assert out[:, 0].tolist() == [float(i) for i in range(world) for _ in range(recv[i])]
    seen["counts"] = (ch.exchanges, ch.elided, refusals)
    return seen


@pytest.mark.timeout(150)
def test_a_refused_elided_call_raises_everywhere_and_writes_nothing() -> None:
    results = run_world(_odd_calls, 4, config={"elide_every": 1000})
    first = results[0]
    assert "rank 0 sends 4 to rank 1, which expects 8 from it" in first["splits"], first
    assert "rank 2 sends 8 to rank 0, which expects 4 from it" in first["block"], first
    assert "dtype" in first["dtype"] and "op" in first["collective"], first
    for seen in results:
        for name in ("splits", "block", "dtype", "collective"):
            assert seen[name] == first[name], (name, seen[name])  # alike on every rank
        # Every odd call that ran elided fell back (none may elide while the group
        # has confirmed a straggler, as it may on a loaded host).
        _, _, refusals = seen["counts"]
        assert all(fell == ran for ran, fell in refusals), refusals
        assert any(ran for ran, _ in refusals), refusals


# -- through torch's public API, against gloo -----------------------------------------
WORLD = 3


def _api_rank(rank: int, world: int) -> tuple[str, dict[str, Any]]:
    gloo = dist.new_group(backend="gloo")
    out = {}
    splits_in = [_uneven(rank, j, WORLD) for j in range(WORLD)]
    splits_out = [_uneven(i, rank, WORLD) for i in range(WORLD)]
    src = torch.arange(WORLD * 4, dtype=torch.float32) + 100 * rank
    uneven = torch.arange(sum(splits_in), dtype=torch.int64) + 100 * rank
    for name, group in (("resilient", None), ("gloo", gloo)):
        a = torch.zeros(WORLD * 4)
        dist.all_to_all_single(a, src, group=group)
        b = torch.zeros(sum(splits_out), dtype=torch.int64)
        dist.all_to_all_single(b, uneven, splits_out, splits_in, group=group)
        # gloo's list form takes equal sizes only.
        c = [torch.zeros(2) for _ in range(WORLD)]
        dist.all_to_all(c, [torch.full((2,), float(rank + j)) for j in range(WORLD)], group=group)
        out[name] = (a.tolist(), b.tolist(), [t.tolist() for t in c])
    return type(dist.group.WORLD).__name__, out


@pytest.mark.timeout(150)
def test_all_to_all_through_torch_matches_gloo() -> None:
    seen = dict(enumerate(run_dist(_api_rank, WORLD, timeout_s=120)))
    for rank, (kind, out) in seen.items():
        assert kind == "ResilientProcessGroup", (rank, kind)
        assert out["resilient"] == out["gloo"], (rank, out)
        assert out["resilient"][0][:4] == [4.0 * rank + k for k in range(4)], (rank, out)
        assert out["resilient"][2] == [[float(i + rank)] * 2 for i in range(WORLD)], (rank, out)
