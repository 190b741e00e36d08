"""A peer that shuts its group down is lost only if it left a call this rank is in
(real processes, 3 ranks, 2 rails on loopback)."""

from __future__ import annotations

import time
from datetime import timedelta
from typing import Any

import pytest
import torch

from resilient.detect.lost_peer import closed_rails
from resilient.errors import PeerLost
from tests._dist import run_world

pytestmark = pytest.mark.timeout(120)

GONE_WITHIN_S = 30.0


def _wait_gone(store: Any, ranks: list[int]) -> None:
    store.wait([f"gone/{r}" for r in ranks], timedelta(seconds=GONE_WITHIN_S))


def _last_out_of_the_final_barrier(pg: Any, rank: int, world: int) -> dict[str, Any]:
    store = pg.links.store
    pg.allreduce([torch.ones(1000)]).wait()
    if rank != 0:
        pg.barrier().wait()
        pg.shutdown()  # links closed: run_world's own shutdown does nothing more
        store.set(f"gone/{rank}", "1")
        return {}
    # Rank 0 stays inside its barrier, after the exchange every rank needed, until
    # both peers finished it and closed their links: a host short of CPU does that.
    held: list[bool] = []
    observe = pg.epochs.stragglers.observe

    def late(exchange: Any) -> None:
        held.append(True)
        _wait_gone(store, [1, 2])
        time.sleep(0.5)  # the peer watch scans every 50 ms
        observe(exchange)

    pg.epochs.stragglers.observe = late
    pg.barrier().wait()
    pg.epochs.stragglers.observe = observe
    closed = {peer: sorted(rails) for peer, rails in closed_rails(pg.epochs.tables()).items()}
    return {"held": held, "closed": closed, "lost": pg.lost}


@pytest.mark.parametrize("transport", ["socket", "gloo"])
def test_a_peer_that_finished_every_call_before_it_left_is_not_lost(transport: str) -> None:
    config = {"data_transport": transport}
    out = run_world(_last_out_of_the_final_barrier, 3, rails=2, config=config)[0]
    assert out["held"] == [True]
    # The peers' closes were seen on every rail, as after a crash...
    assert out["closed"] == {1: [0, 1], 2: [0, 1]}
    # ...but they had finished the barrier first: an orderly end, not a loss.
    assert out["lost"] is None


def _left_before_the_barrier(pg: Any, rank: int, world: int, warm: bool) -> dict[str, Any]:
    """Rank 1 shuts its group down (after one all_reduce if ``warm``, else before
    any link was built); the others then enter a barrier."""
    store = pg.links.store
    if warm:
        pg.allreduce([torch.ones(1000)]).wait()
    if rank == 1:
        # A program that failed here and shut its group down in a ``finally``.
        pg.shutdown()
        store.set("gone/1", "1")
        return {}
    _wait_gone(store, [1])
    start = time.monotonic()
    try:
        pg.barrier().wait()
    except Exception as exc:  # the type by name: a queue carries the result back
        peer = exc.peer if isinstance(exc, PeerLost) else None
        return {"error": type(exc).__name__, "peer": peer, "text": str(exc),
                "after_s": time.monotonic() - start}  # fmt: skip
    return {"error": None}


@pytest.mark.parametrize("transport", ["socket", "gloo"])
def test_a_peer_that_left_before_a_call_this_rank_is_in_is_lost(transport: str) -> None:
    config = {"data_transport": transport}
    out = run_world(_left_before_the_barrier, 3, rails=2, config=config, args=(True,))
    for rank in (0, 2):
        assert out[rank]["error"] == "PeerLost" and out[rank]["peer"] == 1, out
        # Found by its closes, not at the 20 s op deadline of tests._dist.
        assert out[rank]["after_s"] < 5.0, out


@pytest.mark.parametrize("rails", [1, 2])
def test_a_peer_that_left_before_any_link_was_built_is_not_waited_for(rails: int) -> None:
    # A rank that timed out in a call its peer never made shuts its group down while
    # that call still builds the links; it must not wait out connect_timeout_s.
    config = {"connect_timeout_s": 60.0}
    out = run_world(_left_before_the_barrier, 2, rails=rails, config=config, args=(False,))[0]
    assert out["error"] == "PeerLost" and out["peer"] == 1, out
    assert "shut its group down" in out["text"], out
    assert out["after_s"] < 10.0, out
