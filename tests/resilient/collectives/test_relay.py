"""A pair with no rail left (both rails silently dropped between two ranks) still
completes its collectives, through the store, with the right bits; once the rails
come back, the links are repaired (real processes and gloo links; iptables on
loopback, as root)."""

from __future__ import annotations

import os
import shutil
import time
from typing import Any

import pytest
import torch

from resilient.collectives.relay import RELAY_RAIL
from tests._dist import run_world
from tests._iptables import drop_rules, iptables

pytestmark = [
    pytest.mark.timeout(240),
    pytest.mark.skipif(os.geteuid() != 0, reason="needs root (iptables)"),
    pytest.mark.skipif(shutil.which("iptables") is None, reason="iptables is not installed"),
]

# Both rails of both ranks (tests._dist's addresses): no rail connects them. Both
# ends' addresses, because on loopback the connecting end of a link is unbound.
CUT = ("127.0.1.1", "127.0.1.2", "127.0.2.1", "127.0.2.2")
FLOOR_S = 30.0


def _cut_off(pg: Any, rank: int, world: int, n: int, tag: str) -> dict[str, Any]:
    x = torch.randn(n, generator=torch.Generator().manual_seed(5 + rank))
    want = x.clone()
    pg.allreduce([want]).wait()  # fault-free; builds the links
    if rank == 0:
        iptables("-I", drop_rules(CUT, tag), check=True)
    start = time.monotonic()
    got = [x.clone() for _ in range(2)]
    for t in got:  # the first meets the partition; the second starts without rails
        pg.allreduce([t]).wait()
    took = time.monotonic() - start
    if rank == 0:
        iptables("-D", drop_rules(CUT, tag))
    after = x.clone()
    # Wait for a repair seen by either rank, decided together (a per-rank loop lets
    # one rank leave it while the other still calls: mismatched collectives).
    for _ in range(150):  # 30 s of 0.2 s waits, the same count on every rank
        seen = torch.tensor([float(bool(pg.board.repair.repaired))])
        pg.allreduce([seen]).wait()
        if seen.item() > 0:
            break
        time.sleep(0.2)
    pg.allreduce([after]).wait()
    relayed = [f for f in pg.engine.failovers + pg.epochs.checks.failovers
               if f[2] == RELAY_RAIL]  # fmt: skip
    return {
        "equal": [torch.equal(t, want) for t in got] + [torch.equal(after, want)],
        "took_s": took,
        "relayed": len(relayed),
        "repaired": len(pg.board.repair.repaired),
    }


def test_a_pair_with_no_rail_left_goes_through_the_store_then_is_repaired() -> None:
    tag = f"rsl-relay-{os.getpid()}"
    try:
        out = run_world(
            _cut_off,
            2,
            rails=2,
            timeout_s=200,
            args=(1 << 18, tag),
            config={"single_rail_below_bytes": 0, "op_timeout_floor_s": FLOOR_S},
        )
    finally:
        iptables("-D", drop_rules(CUT, tag))  # whatever a failed run left behind
    for rank, res in enumerate(out):
        assert res["equal"] == [True, True, True], (rank, res)
        assert res["took_s"] < FLOOR_S, (rank, res)  # not at an op's deadline
    assert all(res["relayed"] for res in out), out
    assert any(res["repaired"] for res in out), out
