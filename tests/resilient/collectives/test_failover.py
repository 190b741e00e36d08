"""A rail dies in the middle of a collective: the collective completes on the other
rail, bit for bit as without the fault (real processes, real gloo links; the
rail's connections are really cut, as when its NIC goes down)."""

from __future__ import annotations

import threading
from typing import Any

import pytest
import torch

from resilient.collectives import failover
from tests._dist import run_world

pytestmark = pytest.mark.timeout(240)


def _input(rank: int, n: int) -> torch.Tensor:
    return torch.randn(n, generator=torch.Generator().manual_seed(7 + rank))


def _kill_rail_after(pg: Any, rail: int, consumed: int) -> threading.Event:
    """Cut this rank's rail when one of its receive channels there has consumed
    ``consumed`` messages: a NIC dying mid-collective, at a reproducible point."""
    fired = threading.Event()
    wait = failover.Rx.wait

    def wrapped(self: failover.Rx, idx: int, nbytes: int) -> None:
        wait(self, idx, nbytes)
        data = self.route.links.name == "link"  # not the signature exchange's links
        if data and self.rail == rail and self.consumed >= consumed and not fired.is_set():
            fired.set()
            pg.board.nic_changed(rail, False)

    failover.Rx.wait = wrapped  # type: ignore[method-assign]
    return fired


def _faulty_allreduce(
    pg: Any, rank: int, world: int, n: int, victim: int, after: int
) -> dict[str, Any]:
    x = _input(rank, n)
    want = x.clone()
    pg.allreduce([want]).wait()  # the fault-free result
    fired = _kill_rail_after(pg, 0, after) if rank == victim else threading.Event()
    got = x.clone()
    pg.allreduce([got]).wait()
    again = x.clone()
    for _ in range(3):  # the group goes on; the dead rail gets no share any more
        again.copy_(x)
        pg.allreduce([again]).wait()
    engine = pg.engine
    return {
        "equal": torch.equal(got, want),
        "again_equal": torch.equal(again, want),
        "fired": fired.is_set(),
        "failovers": list(engine.failovers),
        "weights": engine.weights,
        "rail0_broken": [lk.broken for (p, r), lk in engine.links.links().items() if r == 0],
    }


@pytest.mark.parametrize(
    ("topology", "n", "after", "transport"),
    [
        ("ring", 1 << 21, 3, "socket"),
        ("mesh", 1 << 16, 1, "socket"),  # the mesh gets 2 messages per peer
        ("ring", 1 << 21, 3, "gloo"),  # gloo's large waits run in helper threads
    ],
)
def test_a_rail_cut_mid_allreduce_fails_over_without_loss(
    topology: str, n: int, after: int, transport: str
) -> None:
    out = run_world(
        _faulty_allreduce,
        4,
        rails=2,
        args=(n, 1, after),
        # The cut is placed by a channel's message count: the Python path's (a C
        # step's own cut is tests/resilient/links/test_native.py's).
        config={
            "topology": topology,
            "single_rail_below_bytes": 0,
            "data_transport": transport,
            "native_io": False,
        },
    )
    assert out[1]["fired"]
    for rank, res in enumerate(out):
        assert res["equal"], rank
        assert res["again_equal"], rank
    # The victim's channels on rail 0 resumed on rail 1, one of them mid-stream.
    moved = out[1]["failovers"]
    assert moved and all(src == 0 and dst == 1 for _, src, dst, _ in moved)
    assert any(at > 0 for *_, at in moved)
    # Its neighbours failed over too (their end was cut through the health board).
    assert any(res["failovers"] for rank, res in enumerate(out) if rank != 1)
    # Afterwards every rank agreed to give rail 0 nothing.
    assert all(res["weights"][0] == 0 for res in out)
    assert all(out[1]["rail0_broken"])


def _no_share_for_rail_1(pg: Any, rank: int, world: int, n: int) -> dict[str, Any]:
    # As if rail 1 had measured too slow for a share: every rank gives it none, so
    # the whole tensor goes over rail 0 when rail 0 dies.
    assert pg.epochs.learner is not None
    pg.epochs.learner.weights_for = lambda exchange: (1.0, 0.0)
    return _faulty_allreduce(pg, rank, world, n, 1, 3)


def test_a_healthy_rail_with_no_share_is_still_the_backup() -> None:
    # Seen on benchmarks/failover.py: the learned weights had left rail 1 out, and
    # the failover went through the store instead (+323 ms on a 64 MB op).
    out = run_world(
        _no_share_for_rail_1,
        4,
        rails=2,
        args=(1 << 21,),
        config={"topology": "ring", "single_rail_below_bytes": 0, "native_io": False},
    )
    assert out[1]["fired"]
    for rank, res in enumerate(out):
        assert res["equal"], rank
        assert res["again_equal"], rank
    moved = [m for res in out for m in res["failovers"]]
    assert moved and all(src == 0 and dst == 1 for _, src, dst, _ in moved), moved
