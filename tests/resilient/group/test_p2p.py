"""send/recv on the resilient group, on real processes (resilient.group.p2p).

Round trips of every supported dtype, contiguous or not, against the values sent;
isend/irecv of 64 MiB both ways at once; tags taken in and out of order;
``batch_isend_irecv`` around a ring through torch's public API; and the bad inputs
(a receive of another size or dtype, a peer that is no other rank of the group,
a peer that never posts), each a typed error after which the group still works.
Receives from any source: from several senders (the sender's rank returned, each
sender's messages in order), a mismatch, none sent by the deadline.
"""

from __future__ import annotations

import re
import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from resilient.collectives.signature import SUPPORTED_DTYPES
from resilient.errors import CollectiveMismatch, LinkError
from tests._dist import reduce_opts, run_dist, run_world

pytestmark = pytest.mark.timeout(180)


def _values(n: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    if dtype == torch.bool:
        return torch.randint(0, 2, (n,), generator=g).bool()
    if dtype.is_floating_point:
        return torch.randn(n, generator=g).to(dtype)
    lo, hi = (0, 256) if dtype == torch.uint8 else (-100, 100)
    return torch.randint(lo, hi, (n,), generator=g).to(dtype)


def _round_trips(pg: Any, rank: int, world: int) -> int:
    checked = 0
    for i, dtype in enumerate(SUPPORTED_DTYPES):
        # 0, 3 (small frames), 30,000 elements (bytes read straight into the tensor).
        for n in (0, 3, 30_000):
            sent = _values(n, dtype, seed=i * 100 + n)
            if rank == 0:
                pg.send([sent], 1, 7).wait()
                back = torch.zeros(n, dtype=dtype)
                pg.recv([back], 1, 7).wait()
                assert torch.equal(back, sent), (dtype, n)
            else:
                got = torch.zeros(n, dtype=dtype)
                pg.recv([got], 0, 7).wait()
                assert torch.equal(got, sent), (dtype, n)
                pg.send([got], 0, 7).wait()
            checked += 1
        # Not contiguous at either end: a transposed send into a strided slice.
        grid = _values(60 * 40, dtype, seed=i).view(60, 40)
        if rank == 0:
            pg.send([grid.t()], 1, 8).wait()
        else:
            into = torch.zeros(40, 120, dtype=dtype)
            pg.recv([into[:, ::2]], 0, 8).wait()
            assert torch.equal(into[:, ::2], grid.t()), dtype
            assert not into[:, 1::2].any(), dtype  # nothing written between the strides
        checked += 1
    return checked


def test_round_trips_of_every_dtype_contiguous_or_not() -> None:
    results = run_world(_round_trips, 2, timeout_s=120.0)
    assert results == [len(SUPPORTED_DTYPES) * 4] * 2


def _both_ways_large(pg: Any, rank: int, world: int) -> float:
    n = 16 << 20  # 64 MiB of float32
    peer = 1 - rank
    mine = torch.full((n,), float(rank + 1))
    theirs = torch.zeros(n)
    start = time.monotonic()
    # Each rank sends before it receives: neither may wait for the other's receive.
    sent = pg.send([mine], peer, 0)
    got = pg.recv([theirs], peer, 0)
    sent.wait()
    got.wait()
    assert bool((theirs == float(peer + 1)).all())
    return time.monotonic() - start


def test_isend_irecv_64_mib_both_ways_at_once() -> None:
    took = run_world(_both_ways_large, 2, timeout_s=120.0)
    assert all(t < 60 for t in took), took


def _tags(pg: Any, rank: int, world: int) -> list[str]:
    big = 300_000  # 1.2 MB: read aside while the receive of another tag waits
    if rank == 0:
        works = [
            pg.send([torch.full((4,), 1.0)], 1, 1),
            pg.send([torch.full((big,), 2.0)], 1, 2),
            pg.send([torch.full((4,), 3.0)], 1, 1),
            pg.send([torch.arange(5)], 1, -5),
        ]
        for w in works:
            w.wait()
        return ["sent"]
    # Out of order: tag 2 first, then tag -5, then tag 1's two messages in issue order.
    t2, t5 = torch.zeros(big), torch.zeros(5, dtype=torch.int64)
    first, second = torch.zeros(4), torch.zeros(4)
    w2 = pg.recv([t2], 0, 2)
    w5 = pg.recv([t5], 0, -5)
    w2.wait()
    w5.wait()
    w1a = pg.recv([first], 0, 1)
    w1b = pg.recv([second], 0, 1)
    w1a.wait()
    w1b.wait()
    assert bool((t2 == 2.0).all()) and torch.equal(t5, torch.arange(5))
    assert bool((first == 1.0).all()) and bool((second == 3.0).all())
    return ["tag 2", "tag -5", "tag 1 in order"]


def test_tags_match_in_and_out_of_order() -> None:
    assert run_world(_tags, 2, timeout_s=90.0)[1] == ["tag 2", "tag -5", "tag 1 in order"]


def _ring(rank: int, world: int) -> list[float]:
    right, left = (rank + 1) % world, (rank - 1) % world
    mine = torch.arange(1000, dtype=torch.float32) + 1000 * rank
    got = torch.zeros(1000)
    ops = [dist.P2POp(dist.isend, mine, right, tag=3), dist.P2POp(dist.irecv, got, left, tag=3)]
    for req in dist.batch_isend_irecv(ops):
        req.wait()
    assert torch.equal(got, torch.arange(1000, dtype=torch.float32) + 1000 * left)
    # And the blocking API: a value passed around the ring.
    token = torch.tensor([float(rank)])
    if rank == 0:
        dist.send(token, right)
        dist.recv(token, left)
    else:
        dist.recv(token, left)
        token += 1
        dist.send(token, right)
    return [float(got[0]), float(token[0])]


def test_batch_isend_irecv_ring_through_torch() -> None:
    world = 3
    results = run_dist(_ring, world, timeout_s=120.0)
    assert [r[0] for r in results] == [2000.0, 0.0, 1000.0]
    assert results[0][1] == world - 1


def _mismatches(pg: Any, rank: int, world: int) -> list[str]:
    seen = []
    peer = 1 - rank
    # Another count, then another dtype; the larger side's bytes are read aside.
    for mine in (
        torch.ones(10) if rank == 0 else torch.zeros(12),
        torch.ones(50_000) if rank == 0 else torch.zeros(50_000, dtype=torch.float64),
    ):
        work = pg.send([mine], peer, 4) if rank == 0 else pg.recv([mine], peer, 4)
        with pytest.raises(CollectiveMismatch, match="met a"):
            work.wait()
        seen.append("mismatch")
    if rank == 1:
        assert not mine.any()  # nothing landed in the receive
    # The pair and the group go on.
    t = torch.full((6,), 5.0) if rank == 0 else torch.zeros(6)
    (pg.send([t], 1, 4) if rank == 0 else pg.recv([t], 0, 4)).wait()
    assert bool((t == 5.0).all())
    s = torch.ones(3)
    pg.allreduce([s], reduce_opts(dist.ReduceOp.SUM)).wait()
    assert bool((s == world).all())
    return [*seen, "usable"]


def test_size_or_dtype_mismatch_fails_both_ends_and_the_group_goes_on() -> None:
    assert run_world(_mismatches, 2, timeout_s=90.0) == [["mismatch", "mismatch", "usable"]] * 2


def _bad_peers(pg: Any, rank: int, world: int) -> str:
    t = torch.zeros(2)
    for bad in (rank, world, -1):
        with pytest.raises(ValueError, match="cannot"):
            pg.send([t], bad, 0)
        with pytest.raises(ValueError, match="cannot"):
            pg.recv([t], bad, 0)
    with pytest.raises(ValueError, match="tag"):
        pg.send([t], 1 - rank, 1 << 40)
    with pytest.raises(TypeError, match="dtype"):
        pg.send([torch.zeros(2, dtype=torch.complex64)], 1 - rank, 0)
    with pytest.raises(ValueError, match="tag"):
        pg.recv_anysource([t], 1 << 40)
    s = torch.ones(3)
    pg.allreduce([s], reduce_opts(dist.ReduceOp.SUM)).wait()
    assert bool((s == world).all())
    return "ok"


def test_bad_peer_ranks_raise_value_error_on_the_callers_thread() -> None:
    assert run_world(_bad_peers, 2, timeout_s=60.0) == ["ok", "ok"]


def _unmatched(pg: Any, rank: int, world: int) -> list[str]:
    t = torch.arange(4.0) if rank == 0 else torch.zeros(4)
    (pg.send([t], 1, 0) if rank == 0 else pg.recv([t], 0, 0)).wait()  # the link is up
    out = []
    if rank == 0:
        # Rank 1 never sends: the receive fails at its deadline (floor 1.5 s).
        start = time.monotonic()
        with pytest.raises(LinkError):
            pg.recv([torch.zeros(4)], 1, 9).wait()
        took = time.monotonic() - start
        assert 1.0 < took < 10.0, took
        out.append("timed out")
        pg.store.set("p2p-test/timed-out", "1")
    else:
        pg.store.wait(["p2p-test/timed-out"])
    s = torch.ones(3)
    pg.allreduce([s], reduce_opts(dist.ReduceOp.SUM)).wait()
    assert bool((s == world).all())
    # The pair's next calls build the link again, at both ends.
    t = torch.full((4,), 7.0) if rank == 1 else torch.zeros(4)
    (pg.send([t], 0, 0) if rank == 1 else pg.recv([t], 1, 0)).wait()
    assert bool((t == 7.0).all())
    return [*out, "usable"]


def test_a_peer_that_never_posts_fails_the_op_at_its_deadline() -> None:
    results = run_world(_unmatched, 2, timeout_s=90.0, config={"op_timeout_floor_s": 1.5})
    assert results == [["timed out", "usable"], ["usable"]]


def _any_source(rank: int, world: int) -> list[int]:
    """torch's pattern (test_send_recv_any_source): each rank in turn receives from
    any source, recv and irecv, while every other one sends it two messages, here
    isend'ed together (the second must not overtake the first)."""
    got: list[int] = []
    for receiver in range(world):
        if rank != receiver:
            works = [dist.isend(torch.tensor([rank, k, 7.0]), receiver) for k in range(2)]
            for w in works:
                w.wait()
            continue
        seen: dict[int, int] = {}
        for i in range(2 * (world - 1)):
            t = torch.full((3,), -1.0)
            if i % 2 == 0:
                src = dist.recv(t)
            else:
                work = dist.irecv(t)
                work.wait()
                src = work._source_rank()
            assert int(t[0]) == src and t[2] == 7.0, (src, t)
            assert int(t[1]) == seen.get(src, 0), (src, t)  # each sender's in issue order
            seen[src] = int(t[1]) + 1
            got.append(src)
    return sorted(got)


def test_recv_from_any_source_names_each_sender() -> None:
    world = 3
    results = run_dist(_any_source, world, timeout_s=120.0)
    for rank, got in enumerate(results):
        assert got == sorted([r for r in range(world) if r != rank] * 2), (rank, got)


def _any_mismatch(pg: Any, rank: int, world: int) -> list[str]:
    out = []
    if rank == 0:
        with pytest.raises(CollectiveMismatch, match="from any rank met a send"):
            pg.recv_anysource([t := torch.zeros(10)], 4).wait()
        assert not t.any()  # nothing landed
        out.append("mismatch")
        pg.store.set("p2p-test/any-mismatch", "1")
        # Rank 2's send met the first receive's READY too: declined, it takes this one.
        work = pg.recv_anysource([t], 4)
        work.wait()
        assert (work._source_rank(), float(t[0])) == (2, 2.0)
        pg.store.set("p2p-test/any-second", "1")
        # Rank 1's next send meets the READY that the second receive left there first:
        # declined, it takes this named receive's.
        pg.recv([t], 1, 4).wait()
        assert bool((t == 1.0).all())
        out.append("usable")
    elif rank == 1:
        with pytest.raises(CollectiveMismatch, match="met a recv of float32"):
            pg.send([torch.ones(12)], 0, 4).wait()
        out.append("mismatch")
        pg.store.wait(["p2p-test/any-second"])
        pg.send([torch.full((10,), 1.0)], 0, 4).wait()
    else:
        pg.store.wait(["p2p-test/any-mismatch"])
        pg.send([torch.full((10,), 2.0)], 0, 4).wait()
    s = torch.ones(3)
    pg.allreduce([s], reduce_opts(dist.ReduceOp.SUM)).wait()
    assert bool((s == world).all())
    return out


def test_recv_from_any_source_of_another_size_fails_both_ends_and_goes_on() -> None:
    results = run_world(_any_mismatch, 3, timeout_s=90.0)
    assert results == [["mismatch", "usable"], ["mismatch"], []]


def _any_unmatched(pg: Any, rank: int, world: int) -> list[str]:
    for peer in range(world):  # every pair's link up first (as a named receive's)
        if peer != rank:
            t = torch.zeros(1)
            w = pg.send([t], peer, 0) if rank < peer else pg.recv([t], peer, 0)
            w.wait()
            w = pg.recv([t], peer, 0) if rank < peer else pg.send([t], peer, 0)
            w.wait()
    out = []
    if rank == 0:
        start = time.monotonic()
        with pytest.raises(LinkError, match="no rank sent"):
            pg.recv_anysource([torch.zeros(4)], 9).wait()
        took = time.monotonic() - start
        assert 1.0 < took < 10.0, took
        out.append("timed out")
        pg.store.set("p2p-test/any-timed-out", "1")
        # Rank 1's late send is declined by the READY left over, and meets this one.
        work = pg.recv_anysource([t := torch.zeros(4)], 9)
        work.wait()
        assert work._source_rank() == 1 and bool((t == 3.0).all())
    elif rank == 1:
        pg.store.wait(["p2p-test/any-timed-out"])
        pg.send([torch.full((4,), 3.0)], 0, 9).wait()
    s = torch.ones(3)
    pg.allreduce([s], reduce_opts(dist.ReduceOp.SUM)).wait()
    assert bool((s == world).all())
    return [*out, "usable"]


def test_recv_from_any_source_with_no_sender_fails_at_its_deadline() -> None:
    results = run_world(_any_unmatched, 3, timeout_s=90.0, config={"op_timeout_floor_s": 1.5})
    assert results == [["timed out", "usable"], ["usable"], ["usable"]]


def _pipeline(backend: str) -> list[str]:
    import os
    import subprocess
    import sys

    from resilient.procs import free_port

    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
        "--master-port", str(free_port()), "examples/pipeline_stages.py",
        "--backend", backend, "--steps", "4", "--width", "64",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120, env=env, check=False)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    # Two ranks share the launcher's stdout, so lines may interleave: match the
    # reports themselves rather than whole lines.
    found = re.findall(r"final loss \d+\.\d{9} params [0-9a-f]{16}", proc.stdout)
    return sorted(found)


@pytest.mark.timeout(300)
def test_the_pipeline_example_ends_as_on_gloo() -> None:
    resilient, gloo = _pipeline("resilient"), _pipeline("gloo")
    assert len(resilient) == 2 and resilient == gloo


def _undriven(rank: int, world: int) -> list[Any]:
    """Rank 0 isends to rank 1 before rank 1's READY can have come, then touches
    neither the work nor the group for 4 s: its pump, whose wake-up was deferred
    (p2p_late_wakes), must still write the bytes. Then both ranks go on; rank 2
    meanwhile waits on a receive from rank 0 (another channel), which rank 0's
    wait on it must not let starve the send to 1."""
    # Build the 0-1 link first: an op issued before its link is built wakes the pump.
    if rank == 0:
        dist.send(torch.ones(1), 1)
    elif rank == 1:
        dist.recv(torch.ones(1), 0)
    if rank == 0:
        work = dist.isend(torch.full((16,), 3.0), 1, tag=4)
        time.sleep(4.0)
        dist.send(torch.ones(2), 2, tag=5)
        work.wait()
        return ["sent"]
    if rank == 1:
        time.sleep(0.3)  # rank 0's send was issued and its pump left asleep
        got = torch.zeros(16)
        began = time.monotonic()
        dist.recv(got, 0, tag=4)
        took = time.monotonic() - began
        assert torch.equal(got, torch.full((16,), 3.0))
        # Rank 0 sleeps 4 s: a bytes only its own wait would write came after it.
        return ["received", took < 2.0]
    got = torch.zeros(2)
    dist.recv(got, 0, tag=5)
    return [float(got.sum())]


def test_an_isend_nobody_waits_for_still_reaches_its_peer() -> None:
    assert run_dist(_undriven, 3, timeout_s=90.0) == [["sent"], ["received", True], [2.0]]
