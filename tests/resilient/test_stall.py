"""A link op pending far longer than its size explains is reported, and still completes."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from resilient._stall import STALL_S, StallWatch
from tests._dist import run_world


@pytest.mark.timeout(10)
def test_a_pending_op_is_reported_once_per_stall() -> None:
    import recovery.events as ev

    seen: list[dict[str, Any]] = []
    real = ev.emit
    ev.emit = lambda kind, **f: seen.append({"kind": kind, **f})  # type: ignore[assignment]
    try:
        w = StallWatch()
        a, b = w.begin((0, 1, 0), "link-a", 0.0), w.begin((0, 1, 0), "link-a", 0.0)
        fast = w.begin((0, 2, 0), "link-b", 0.0)
        w.end(fast)  # completed in time: never reported
        time.sleep(STALL_S + 0.3)
        w.end(a)
        w.end(b)
    finally:
        ev.emit = real  # type: ignore[assignment]
    assert [(s["kind"], s["links"]) for s in seen] == [("link.degraded", [(0, 1, 0)])]


def _late_peer(pg: Any, rank: int, world: int) -> dict[str, Any]:
    from resilient import _stall

    pg.allreduce([torch.zeros(1 << 16)]).wait()  # links up before timing
    before = _stall.watch().reported
    t = torch.full((1 << 16,), float(rank))
    if rank == 1:
        time.sleep(1.5)  # everyone else waits on this rank's share
    start = time.perf_counter()
    pg.allreduce([t]).wait()
    return {
        "elapsed": time.perf_counter() - start,
        "reported": _stall.watch().reported - before,
        "ok": bool(torch.all(t == 1.0)),
    }


@pytest.mark.timeout(120)
def test_a_late_peer_is_reported_as_stalled_and_the_op_completes() -> None:
    # Without the signature exchange a late peer stalls the data links themselves (with
    # it, the wait happens in the exchange, which is not watched: a late rank is not a
    # bad link).
    config = {"topology": "ring", "check_mismatch": False}
    results = run_world(_late_peer, 2, config=config, timeout_s=90)
    assert all(r["ok"] for r in results)
    assert results[0]["elapsed"] > 1.0 and results[0]["reported"] >= 1
