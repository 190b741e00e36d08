"""Cutting a link: each link knows its own TCP connection, and cutting it ends a
wait on a message that is already half-way across at once (real processes, real
gloo links; gloo itself would wait for the op's deadline, see resilient.links.gloo_wait)."""

from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

import pytest
import torch

from resilient.errors import LinkError
from tests._dist import run_world

pytestmark = pytest.mark.timeout(120)

NUMEL = 64 << 20  # 256 MiB of float32: long enough on loopback to catch mid-way
ATTEMPTS = 4


def _connections(pg: Any, rank: int, world: int) -> dict[str, Any]:
    """Every link's recorded connection, to compare with the peers' records."""
    pg.allreduce([torch.ones(1 << 16)]).wait()  # builds the links
    return {
        f"{rank}-{peer}-{rail}": [c.text() for c in link._conns]
        for (peer, rail), link in pg.links.links().items()
    }


def test_each_link_records_exactly_its_own_connection() -> None:
    out = run_world(_connections, 4, rails=2, config={"topology": "mesh"})
    records = {k: v for r in out for k, v in r.items()}
    assert len(records) == 4 * 3 * 2  # a mesh: every pair on both rails
    for key, conns in records.items():
        rank, peer, rail = key.split("-")
        assert len(conns) == 1, key
        a, b = conns[0].split(">")
        # The peer's record of the same link is the mirror image: same connection.
        assert records[f"{peer}-{rank}-{rail}"] == [f"{b}>{a}"], key


def _half_way(pg: Any, rank: int, world: int) -> dict[str, Any]:
    """Rank 0 sends 256 MiB to rank 1, which stops rank 0 once the payload began to
    arrive. If the message is still incomplete 0.2 s later (the socket buffers are
    drained by then), it is stuck half-way and rank 1 cuts the link; if it made it
    whole before the stop, the attempt proves nothing and is repeated."""
    store = pg.links.store
    link = pg.links.get(1 - rank, 0)
    if rank == 0:
        store.set("pid0", str(os.getpid()))
        ones = torch.ones(NUMEL)
        for attempt in range(ATTEMPTS):
            store.wait([f"go{attempt}"])
            work = link.isend(ones, 3 + attempt)
            if bytes(store.get(f"result{attempt}")).decode() == "cut":
                link.abort("the test is over")  # the send stays pending on a dead pair
                break
            link.wait(work, NUMEL * 4)
        return {}
    pid0 = int(bytes(store.get("pid0")).decode())
    into = torch.zeros(NUMEL)
    for attempt in range(ATTEMPTS):
        into.zero_()
        work = link.irecv(into, 3 + attempt)
        cut_at: list[float] = []
        thread = threading.Thread(target=_stop_then_cut, args=(link, into, pid0, cut_at))
        thread.start()
        store.set(f"go{attempt}", "1")
        error = None
        try:
            link.wait(work, NUMEL * 4, interruptible=True)
        except LinkError as exc:
            error = type(exc).__name__
        ended = time.monotonic()
        thread.join(10)
        os.kill(pid0, signal.SIGCONT)
        store.set(f"result{attempt}", "cut" if cut_at else "whole")
        if cut_at:
            return {
                "attempt": attempt,
                "error": error,
                "after_cut_s": ended - cut_at[0],
                "still_partial": bool(into[-1] == 0),
                "deadline_s": pg.config.deadline_s(NUMEL * 4),
            }
    return {"attempt": None}


def _stop_then_cut(link: Any, into: torch.Tensor, pid0: int, cut_at: list[float]) -> None:
    while into[0] == 0:  # the payload began to arrive
        time.sleep(0.0005)
    os.kill(pid0, signal.SIGSTOP)
    time.sleep(0.2)
    if into[-1] == 0:  # stuck half-way: nothing more can come
        cut_at.append(time.monotonic())
        link.abort("the test cuts it")
    else:
        os.kill(pid0, signal.SIGCONT)


def test_cutting_a_link_ends_a_wait_on_a_message_half_way_across() -> None:
    got = run_world(_half_way, 2, rails=2)[1]
    assert got["attempt"] is not None, f"no attempt caught the message half-way ({ATTEMPTS})"
    assert got["error"] == "LinkError"
    assert got["still_partial"]
    assert got["after_cut_s"] < 1.0
    assert got["deadline_s"] > 10.0  # what gloo's own wait would have taken
