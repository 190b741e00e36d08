"""Calls checked by a digest in their data instead of an exchange of rows
(resilient.collectives.digest_check), on real multi-process groups over socket links."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from resilient.collectives.digest_check import call_key, digest_of, elided
from resilient.collectives.engine import Reduce
from resilient.collectives.signature import Signature
from resilient.errors import CollectiveMismatch
from tests._dist import broadcast_opts, reduce_opts, run_world

LARGE = 16 << 10  # floats: 64 KiB, a DDP-sized bucket, far above the inline limit


def test_which_calls_elide_and_what_their_digests_tell_apart() -> None:
    assert [s for s in range(1, 10) if not elided(4, s)] == [1, 4, 8]
    assert not any(elided(0, s) for s in range(1, 10))
    x = torch.zeros(8)
    base = digest_of(Signature.of("allreduce", [x], reduce=Reduce.SUM))
    assert base > 0 and base == digest_of(Signature.of("allreduce", [x], reduce=Reduce.SUM))
    others = [
        Signature.of("allreduce", [torch.zeros(9)], reduce=Reduce.SUM),
        Signature.of("allreduce", [x.double()], reduce=Reduce.SUM),
        Signature.of("allreduce", [x], reduce=Reduce.MAX),
        Signature.of("allreduce", [x.view(2, 4)], reduce=Reduce.SUM),
        Signature.of("broadcast", [x], root=0),
    ]
    assert base not in {digest_of(s) for s in others}
    # Never the tags of checked calls (0), and another epoch's call never shares one.
    assert call_key(0, 65535) != 0 and call_key(0, 7) != call_key(1, 7)


# (numel, dtype, op): DDP-sized buckets and others, so every dtype path folds.
_CALLS = [
    (LARGE, torch.float32, dist.ReduceOp.SUM),
    (3 * LARGE + 5, torch.float64, dist.ReduceOp.MAX),
    (LARGE, torch.int64, dist.ReduceOp.SUM),
    (LARGE, torch.float32, dist.ReduceOp.AVG),
    (LARGE + 1, torch.float32, dist.ReduceOp.MIN),
]


def _data(rank: int, call: int, numel: int, dtype: torch.dtype) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 * call + rank)
    return (torch.randn(numel, generator=gen) * 100).to(dtype)


def _reference(world: int, call: int, numel: int, dtype: torch.dtype, op: Any) -> torch.Tensor:
    """The mesh's fold: rank order 0..P-1, avg as the sum divided by P."""
    parts = [_data(r, call, numel, dtype) for r in range(world)]
    acc = parts[0].clone()
    for p in parts[1:]:
        if op in (dist.ReduceOp.SUM, dist.ReduceOp.AVG):
            acc += p
        elif op == dist.ReduceOp.MAX:
            acc = torch.maximum(acc, p)
        else:
            acc = torch.minimum(acc, p)
    return acc / world if op == dist.ReduceOp.AVG else acc


def _many_calls(pg: Any, rank: int, world: int) -> tuple[int, int, int, int]:
    # Data and references first: compute between calls that differs across ranks
    # could make the straggler watch confirm one, and that stops elision.
    rounds = [
        [
            (_data(rank, 10 * r + i, n, dt), _reference(world, 10 * r + i, n, dt, op), op)
            for i, (n, dt, op) in enumerate(_CALLS)
        ]
        for r in range(3)
    ]
    calls = 0
    for calls_of_round in rounds:
        works = [(t, ref, pg.allreduce([t], reduce_opts(op))) for t, ref, op in calls_of_round]
        for t, ref, work in works:
            work.wait()
            assert torch.equal(t, ref)
            calls += 1
    ch = pg.epochs.checks
    return calls, ch.exchanges, ch.elided, ch.fallbacks


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rails", [1, 2])
def test_elided_calls_skip_their_exchange_and_reduce_as_checked_calls_do(rails: int) -> None:
    # Five calls in flight at a time, so rows of the full exchanges go out while
    # elided calls' data moves; the results are the checked mesh's bits. On two
    # rails the float64 call (393 KiB) is split across both, the others take one.
    config = {"elide_every": 3}
    for calls, exchanges, elided_calls, fallbacks in run_world(
        _many_calls, 4, rails=rails, config=config
    ):
        assert calls == 15 and exchanges + elided_calls == 15
        # Calls 1, 3, 6, 9, 12, 15 exchange; the others elide while the group is
        # quiet (a straggler confirmed on a loaded host may cost a few).
        assert elided_calls > 0 and exchanges >= 6
        # On two rails the float64 call takes the ring across both, behind its
        # gate (collectives.ring_gate): every call elides for real on either.
        assert fallbacks == 0


def _refused(pg: Any, rank: int, world: int) -> dict[str, Any]:
    pg.allreduce([torch.ones(LARGE)]).wait()  # call 1: the full exchange
    seen: dict[str, Any] = {}
    odd_op = dist.ReduceOp.MAX if rank == 0 else dist.ReduceOp.SUM
    cases = {
        "shape": lambda t: pg.allreduce([torch.cat([t, t[:1]]) if rank == 1 else t]),
        # 512 KiB on rank 1: on two rails its plan uses both, the others' only one.
        "size": lambda t: pg.allreduce([torch.cat([t] * 8) if rank == 1 else t]),
        "dtype": lambda t: pg.allreduce([t.double() if rank == 3 else t]),
        "op": lambda t: pg.allreduce([t], reduce_opts(odd_op)),
        "collective": lambda t: (
            pg.broadcast([t], broadcast_opts(0)) if rank == 2 else pg.allreduce([t])
        ),
    }
    ch = pg.epochs.checks
    refusals = []  # per odd call: (ran elided, fell back)
    for name, call in cases.items():
        t = torch.full((LARGE,), float(rank + 1))
        before = (ch.elided, ch.fallbacks)
        try:
            call(t).wait()
        except CollectiveMismatch as exc:
            seen[name] = exc.fields
            assert len(exc.calls) == world
        refusals.append((ch.elided - before[0], ch.fallbacks - before[1]))
        # Nothing was folded into it before the call was refused.
        assert torch.equal(t, torch.full((LARGE,), float(rank + 1))), name
        before = (ch.elided, ch.fallbacks)
        after = torch.ones(LARGE)
        pg.allreduce([after]).wait()  # the group stays usable, elided again
        assert torch.equal(after, torch.full((LARGE,), float(world)))
        assert ch.fallbacks == before[1]  # a matching call never falls back
    seen["counts"] = (ch.exchanges, ch.elided, refusals)
    return seen


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rails", [1, 2])
def test_a_refused_elided_call_raises_everywhere_and_leaves_the_tensors(rails: int) -> None:
    config = {"elide_every": 1000}
    for seen in run_world(_refused, 4, rails=rails, config=config):
        assert "shape" in seen["shape"] and "shape" in seen["size"]
        assert "dtype" in seen["dtype"]
        assert "reduce" in seen["op"] and "op" in seen["collective"]
        # Eleven calls, each run elided or with an exchange; every odd call that
        # ran elided fell back (the group stops eliding while it has confirmed a
        # straggler, as it may on a loaded host: the exchange refuses the call then).
        exchanges, elided_calls, refusals = seen["counts"]
        assert exchanges + elided_calls == 11
        assert all(fell == ran for ran, fell in refusals), refusals
        assert any(ran for ran, _ in refusals), refusals


def _unelidable(pg: Any, rank: int, world: int) -> tuple[int, list[tuple[int, int]]]:
    def quiet_again() -> None:
        # A falled-back call that the mesh does not take ends the quiet (the next
        # calls would likely be like it); a meshed all_reduce exchanges and starts it.
        t = torch.ones(LARGE // 2)
        pg.allreduce([t]).wait()
        assert torch.equal(t, torch.full((LARGE // 2,), float(world)))

    def allreduce(numel: int) -> None:
        t = torch.full((numel,), float(rank))
        pg.allreduce([t]).wait()
        assert torch.equal(t, torch.full((numel,), float(sum(range(world)))))

    def broadcast() -> None:
        b = torch.full((LARGE,), float(rank))
        pg.broadcast([b], broadcast_opts(world - 1)).wait()
        assert torch.equal(b, torch.full((LARGE,), float(world - 1)))

    def allgather() -> None:
        outs = [torch.zeros(LARGE) for _ in range(world)]
        pg.allgather([outs], [torch.full((LARGE,), float(rank))]).wait()
        assert all(torch.equal(o, torch.full((LARGE,), float(r))) for r, o in enumerate(outs))

    def reduce_scatter() -> None:
        out = torch.zeros(LARGE)
        pg.reduce_scatter([out], [[torch.full((LARGE,), float(r)) for r in range(world)]]).wait()
        assert torch.equal(out, torch.full((LARGE,), float(rank * world)))

    fell = []
    ch = pg.epochs.checks
    # A tensor the mesh does not take (config: mesh only below 64 KiB) runs on the
    # ring behind its gate (collectives.ring_gate); one small enough to travel in
    # the rows, and the other ops: each falls back, completes.
    for call in (
        lambda: allreduce(4 * LARGE), lambda: allreduce(8), broadcast, allgather,
        reduce_scatter, lambda: pg.barrier().wait(),
    ):  # fmt: skip
        quiet_again()
        before = (ch.elided, ch.fallbacks)
        call()
        fell.append((ch.elided - before[0], ch.fallbacks - before[1]))
    return ch.elide_every, fell


@pytest.mark.timeout(120)
@pytest.mark.parametrize("world", [2, 4])
def test_calls_that_cannot_run_elided_fall_back_and_complete(world: int) -> None:
    config = {"elide_every": 1000, "mesh_below_bytes": 64 << 10}
    out = run_world(_unelidable, world, config=config)
    assert out[0] == out[-1]  # every rank took each call alike
    every, fell = out[0]
    if world == 2:  # two ranks never mesh, so nothing elides there (it would fall back)
        assert every == 0 and fell == [(0, 0)] * 6
        return
    # The ring's all_reduce ran elided; each other call taken elided fell back. A
    # straggler confirmed on a loaded host (the group is not quiet then) may have
    # some of them exchange instead.
    ring_fell, others = fell[0][1], fell[1:]
    assert every == 1000 and ring_fell == 0
    assert all(f == e for e, f in others) and any(e for e, _ in fell)


RING = 64 << 10  # floats: 256 KiB, cut across both rails (single_rail_below_bytes)


def _ring_calls(pg: Any, rank: int, world: int) -> dict[str, Any]:
    """Elided calls the ring takes behind their gate (collectives.ring_gate): one
    that matches, then calls that differ on one rank, each refused everywhere."""
    ch = pg.epochs.checks
    seen: dict[str, Any] = {"ran": []}
    pg.allreduce([torch.ones(RING)]).wait()  # call 1: the full exchange
    cases = {
        "same": lambda t: pg.allreduce([t]),
        "size": lambda t: pg.allreduce([torch.cat([t, t[:1]]) if rank == 1 else t]),
        "op": lambda t: pg.allreduce(
            [t], reduce_opts(dist.ReduceOp.MAX if rank == 3 else dist.ReduceOp.SUM)
        ),
        # A hello (digest_check) from rank 2 where the others wait at their gates.
        "collective": lambda t: (
            pg.broadcast([t], broadcast_opts(0)) if rank == 2 else pg.allreduce([t])
        ),
    }
    for name, call in cases.items():
        t = torch.full((RING,), float(rank + 1))
        before = (ch.elided, ch.fallbacks)
        try:
            call(t).wait()
            seen[name] = torch.equal(t, torch.full((RING,), float(sum(range(1, world + 1)))))
        except CollectiveMismatch as exc:
            seen[name] = exc.fields
            # Nothing was folded into it before the call was refused.
            assert torch.equal(t, torch.full((RING,), float(rank + 1))), name
        seen["ran"].append((ch.elided - before[0], ch.fallbacks - before[1]))
        after = torch.full((RING,), float(rank))
        before = (ch.elided, ch.fallbacks)
        pg.allreduce([after]).wait()  # the group stays usable, elided again
        assert torch.equal(after, torch.full((RING,), float(sum(range(world)))))
        assert ch.fallbacks == before[1]  # a matching call never falls back
    seen["elided"] = ch.elided
    return seen


@pytest.mark.timeout(120)
@pytest.mark.parametrize("rails", [1, 2])
def test_elided_calls_the_ring_takes_gate_first_and_refuse_alike(rails: int) -> None:
    # One rail: the mesh only below 64 KiB, so these 256 KiB calls take the ring.
    config = {"elide_every": 1000, "mesh_below_bytes": 64 << 10}
    out = run_world(_ring_calls, 4, rails=rails, config=config)
    for seen in out:
        assert seen["same"] is True
        assert "shape" in seen["size"] and "reduce" in seen["op"]
        assert "op" in seen["collective"]
        # The matching call and every call after a refusal ran elided, without a
        # fallback (a straggler confirmed on a loaded host may make some exchange);
        # each odd call taken elided fell back.
        same, *odd = seen["ran"]
        assert same[1] == 0 and all(fell == ran for ran, fell in odd), seen["ran"]
        assert seen["elided"] > 0
