"""The signature exchange's rows: sent when a call is made, read when it runs
(resilient.check.exchange), on real multi-process groups over socket control links."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch
import torch.distributed as dist

from resilient.errors import CollectiveMismatch
from tests._dist import reduce_opts, run_world

LARGE = 4096  # floats: 16 KiB, above the inline limit, so the call has a data phase


def _large_mismatches(pg: Any, rank: int, world: int) -> list[tuple[str, tuple[str, ...]]]:
    seen: list[tuple[str, tuple[str, ...]]] = []
    pg.allreduce([torch.ones(LARGE)]).wait()  # links built; every later row can go early
    cases = [
        ("shape", lambda: pg.allreduce([torch.zeros(LARGE + (rank == 1))])),
        (
            "dtype",
            lambda: pg.allreduce(
                [torch.zeros(LARGE, dtype=torch.float64 if rank == 3 else torch.float32)]
            ),
        ),
        (
            "op",
            lambda: pg.allreduce(
                [torch.zeros(LARGE)],
                reduce_opts(dist.ReduceOp.MAX if rank == 0 else dist.ReduceOp.SUM),
            ),
        ),
        # A barrier's row goes out only when the communication thread takes it up.
        ("collective", lambda: pg.barrier() if rank == 2 else pg.allreduce([torch.zeros(LARGE)])),
    ]
    for name, call in cases:
        # A matching call first, submitted with the odd one before either is waited
        # for: the odd call's row goes out while the first call's data moves.
        first = torch.full((LARGE,), float(rank))
        works = [pg.allreduce([first]), call()]
        works[0].wait()
        assert torch.equal(first, torch.full((LARGE,), float(sum(range(world)))))
        try:
            works[1].wait()
        except CollectiveMismatch as exc:
            seen.append((name, exc.fields))
            assert len(exc.calls) == world
        after = torch.ones(LARGE)
        pg.allreduce([after]).wait()  # the group stays usable
        assert torch.equal(after, torch.full((LARGE,), float(world)))
    return seen


@pytest.mark.timeout(120)
@pytest.mark.parametrize(
    ("rails", "control", "elide"),
    [(1, "socket", 0), (2, "socket", 0), (1, "gloo", 0), (1, "socket", 4), (2, "socket", 5)],
)
def test_large_calls_that_differ_raise_on_every_rank(rails: int, control: str, elide: int) -> None:
    # Over gloo control links every exchange runs whole when its call runs. With
    # ``elide`` (collectives.digest_check) most of the odd calls are elided: calls 1, 4, 7,
    # 10, 13 here are the cases' (4 exchanges, 2-3 between each), so with K = 4 or
    # 5 some of them keep their exchange and the others fall back.
    config: dict[str, Any] = {"control_transport": control, "elide_every": elide}
    for seen in run_world(_large_mismatches, 4, rails=rails, config=config):
        assert [name for name, _ in seen] == ["shape", "dtype", "op", "collective"]
        fields = dict(seen)
        assert "shape" in fields["shape"] and "dtype" in fields["dtype"]
        assert "reduce" in fields["op"] and "op" in fields["collective"]


def _rows_in_order(pg: Any, rank: int, world: int) -> dict[str, Any]:
    channel = pg.epochs.checks
    pg.allreduce([torch.ones(LARGE)]).wait()
    seen: dict[str, Any] = {}
    if rank == 1:
        time.sleep(1.0)  # everyone else's next exchange waits for this rank's row
    a = torch.ones(LARGE)
    first = pg.allreduce([a])
    seen["after_first"] = (channel.submitted, channel._sent)
    if rank != 1:
        barrier = pg.barrier()  # quiet: its row waits until the call runs
        b = torch.ones(LARGE)
        third = pg.allreduce([b])  # behind the barrier's row
        seen["queued"] = (channel.submitted, channel._sent)
        for w in (first, barrier, third):
            w.wait()
    else:
        pg.barrier().wait()
        b = torch.ones(LARGE)
        pg.allreduce([b]).wait()
        first.wait()
    seen["end"] = (channel.submitted, channel._sent)
    seen["sums"] = (float(a[0]), float(b[0]))
    return seen


@pytest.mark.timeout(90)
def test_a_row_goes_out_when_its_call_is_made_and_quiet_calls_keep_their_turn() -> None:
    # Every call with its exchange: elided calls (resilient.collectives.digest_check) send no row.
    results = run_world(_rows_in_order, 4, config={"elide_every": 0})
    for rank, seen in enumerate(results):
        # The previous exchange had settled: the row went out inside the call itself.
        assert seen["after_first"] == (2, 2)
        if rank != 1:
            # The first call still waits for rank 1's row; the barrier's row and the
            # row after it are not sent yet.
            assert seen["queued"] == (4, 2)
        assert seen["end"] == (4, 4)
        assert seen["sums"] == (4.0, 4.0)
