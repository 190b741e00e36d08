"""Links built ahead of first use (``prebuild_links``): the control mesh and the
data links the engine reaches, on every rail, by a background thread; the next
collective runs on exactly those links (real processes, gloo, a TCP store)."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from tests._dist import run_world

pytestmark = pytest.mark.timeout(120)


def _ahead(pg: Any, rank: int, world: int) -> dict[str, Any]:
    from resilient.links import repair

    thread = pg.prebuild_links()
    registered = thread in repair._STRANDED  # the group's shutdown waits for it
    thread.join(60)
    tables = {"data": pg.links, "ctl": pg.epochs.checks.engine.links}
    before = {name: {k: id(v) for k, v in t.links().items()} for name, t in tables.items()}
    x = torch.full((1000,), float(rank + 1))
    pg.allreduce([x]).wait()
    after = {name: {k: id(v) for k, v in t.links().items()} for name, t in tables.items()}
    return {
        "alive": thread.is_alive(),
        "registered": registered,
        "built": {name: sorted(links) for name, links in before.items()},
        "same_objects": before == after,
        "sum": float(x[0]),
    }


def test_missing_links_are_built_ahead_and_the_next_call_uses_them() -> None:
    out = run_world(_ahead, 3, rails=2)
    for rank, got in enumerate(out):
        peers = [p for p in range(3) if p != rank]
        every = sorted((p, r) for p in peers for r in range(2))
        assert not got["alive"] and got["registered"]
        # Three ranks: the data engine is a mesh, so every peer, like the control mesh.
        assert got["built"] == {"data": every, "ctl": every}
        assert got["same_objects"]  # nothing built on first use
        assert got["sum"] == 6.0
