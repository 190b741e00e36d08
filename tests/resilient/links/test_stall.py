"""A link op pending far longer than its size explains is reported, and still completes."""

from __future__ import annotations

import time
from typing import Any

import pytest
import torch

from resilient.links.stall import STALL_S, StallWatch
from tests._dist import run_world


@pytest.mark.timeout(10)
def test_a_pending_op_is_reported_once_per_stall() -> None:
    import resilient.events as ev

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


class _Conn:
    """Stands in for a link: what the kernel says of its connection."""

    def __init__(self, dead: bool) -> None:
        self.dead = dead
        self.asked: list[int] = []

    def network_stall(self, min_ms: int = 1000) -> str | None:
        self.asked.append(min_ms)
        return "1 segment(s) unacknowledged" if self.dead and min_ms < 1000 else None


@pytest.mark.timeout(10)
def test_a_quiet_op_is_reported_only_when_the_kernel_sees_its_connection_failing() -> None:
    import resilient.events as ev

    seen: list[dict[str, Any]] = []
    real = ev.emit
    ev.emit = lambda kind, **f: seen.append({"kind": kind, **f})  # type: ignore[assignment]
    alive, dead = _Conn(dead=False), _Conn(dead=True)
    try:
        w = StallWatch()
        a = w.begin((0, 1, 0), alive, 0.0, report=False)  # e.g. waiting for an ack
        b = w.begin((0, 2, 0), dead, 0.0, report=False)
        time.sleep(STALL_S + 0.3)
        w.end(a)
        w.end(b)
    finally:
        ev.emit = real  # type: ignore[assignment]
    assert [(s["kind"], s["links"]) for s in seen] == [("link.degraded", [(0, 2, 0)])]
    assert "unacknowledged" in seen[0]["reason"]
    assert alive.asked and all(m == int(STALL_S * 1000) or m == 1000 for m in alive.asked)


def _late_peer(pg: Any, rank: int, world: int) -> dict[str, Any]:
    from resilient.links import stall

    pg.allreduce([torch.zeros(1 << 16)]).wait()  # links up before timing
    before = stall.watch().reported
    t = torch.full((1 << 16,), float(rank))
    if rank == 1:
        time.sleep(1.5)  # everyone else waits on this rank's share
    start = time.perf_counter()
    pg.allreduce([t]).wait()
    return {
        "elapsed": time.perf_counter() - start,
        "reported": stall.watch().reported - before,
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
