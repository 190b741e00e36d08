"""A rail that silently drops everything (a partition: no error, no FIN, no RST) is
cut once the kernel sees its connection dead, and the collective fails over long
before its deadline (real processes and gloo links; iptables drops rail 0 on
loopback, as root)."""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

import pytest
import torch

from resilient.links import stall
from tests._dist import run_world
from tests._iptables import drop_rules, iptables

pytestmark = [
    pytest.mark.timeout(180),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (iptables)"),
    pytest.mark.skipif(shutil.which("iptables") is None, reason="iptables is not installed"),
]

RAIL0 = ("127.0.1.1", "127.0.1.2")  # rail 0 of ranks 0 and 1 (tests._dist's addresses)
FLOOR_S = 20.0


def _partitioned(pg: Any, rank: int, world: int, n: int, tag: str) -> dict[str, Any]:
    x = torch.randn(n, generator=torch.Generator().manual_seed(3 + rank))
    want = x.clone()
    pg.allreduce([want]).wait()  # fault-free; builds the links
    if rank == 0:
        iptables("-I", drop_rules(RAIL0, tag), check=True)
    start = time.monotonic()
    # The signature exchange of this call already meets the partition (rank 0 is
    # past its rules when it sends); the data call after it too, unless the rail
    # was given no share by then.
    pg.allreduce([torch.zeros(1)]).wait()
    got = x.clone()
    pg.allreduce([got]).wait()
    took = time.monotonic() - start
    if rank == 0:
        iptables("-D", drop_rules(RAIL0, tag))
    return {
        "equal": torch.equal(got, want),
        "took_s": took,
        # Either watch may see it first: a socket send is done once its bytes are in
        # the socket, so the rank whose bytes are lost may have no op waiting there.
        "cut": stall.watch().cut + pg._peer_watch.cut,
        "failovers": len(pg.engine.failovers) + len(pg.epochs.checks.failovers),
    }


def test_a_silently_partitioned_rail_is_cut_and_the_collective_fails_over() -> None:
    tag = f"rsl-test-{os.getpid()}"
    try:
        out = run_world(
            _partitioned,
            2,
            rails=2,
            args=(1 << 21, tag),
            config={"single_rail_below_bytes": 0, "op_timeout_floor_s": FLOOR_S},
        )
    finally:
        iptables("-D", drop_rules(RAIL0, tag))  # whatever a failed run left behind
    for rank, res in enumerate(out):
        assert res["equal"], rank
        assert res["took_s"] < FLOOR_S / 2, rank  # not at the deadline
    assert any(res["cut"] for res in out)  # the kernel's view cut it
    assert any(res["failovers"] for res in out)
