"""The gate link builds take turns through (resilient.links.gloo_sockets): one build at a
time, so each can tell its own connection, but a build stuck past its bound, or
one whose epoch is over, holds up nobody (seen: a repair of an old epoch sat in
gloo's constructor for 9+ s and the next epoch's signature exchange waited
behind it until a peer gave up)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

from resilient.links import gloo_sockets
from tests._dist import run_world

pytestmark = pytest.mark.timeout(120)


def _entered_after(
    gate: gloo_sockets._Gate, bound_s: float
) -> tuple[threading.Thread, list[float]]:
    """A thread that enters ``gate`` and records when (then leaves)."""
    at: list[float] = []

    def run() -> None:
        turn = gate.enter(bound_s, None)
        at.append(time.monotonic())
        gate.leave(turn)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, at


def test_a_build_waits_for_the_one_in_the_gate_until_it_leaves() -> None:
    gate = gloo_sockets._Gate()
    first = gate.enter(30.0, lambda: False)
    thread, at = _entered_after(gate, 30.0)
    time.sleep(0.3)
    assert at == []  # still waiting
    left = time.monotonic()
    gate.leave(first)
    thread.join(5)
    assert at and at[0] >= left


def test_a_build_whose_epoch_is_over_holds_up_nobody() -> None:
    gate = gloo_sockets._Gate()
    over = threading.Event()
    gate.enter(30.0, over.is_set)  # never leaves: stuck in gloo's constructor
    thread, at = _entered_after(gate, 30.0)
    time.sleep(0.3)
    assert at == []
    ended = time.monotonic()
    over.set()
    thread.join(5)
    assert at and at[0] - ended < 0.5


def test_a_repair_in_the_gate_holds_up_only_what_could_be_mistaken_for_it() -> None:
    # Seen: the signature exchange's build waited 6 s behind a repair sitting out
    # gloo's timeout on a flapping NIC, and a peer gave up. But a build to the same
    # peer on the same rail must wait: the peer's notes could not tell the two
    # connections apart (seen when nothing waited: a repaired link kept another
    # rail's connection too, cut it with its own, and the rings re-ordered).
    gate = gloo_sockets._Gate()
    repair = gate.enter(30.0, lambda: False, background=True, key=("10.0.0.1", 2))
    for key in (("10.0.0.1", 3), ("10.0.1.1", 2)):  # another peer; another rail
        began = time.monotonic()
        gate.leave(gate.enter(30.0, None, key=key))
        assert time.monotonic() - began < 0.5, key
        gate._holder = repair  # still at it
    for background, key in ((False, ("10.0.0.1", 2)), (True, ("10.0.1.1", 3))):
        at: list[float] = []

        def build(
            background: bool = background, key: tuple[str, int] = key, at: list[float] = at
        ) -> None:
            gate.leave(gate.enter(30.0, None, background=background, key=key))
            at.append(time.monotonic())

        thread = threading.Thread(target=build, daemon=True)
        thread.start()
        time.sleep(0.3)
        assert at == [], (background, key)  # waits for the repair
        gate.leave(repair)
        thread.join(5)
        assert at, (background, key)
        repair = gate.enter(30.0, lambda: False, background=True, key=("10.0.0.1", 2))


def test_a_build_past_its_bound_holds_up_nobody(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gloo_sockets, "_OVERRUN_S", 0.0)
    gate = gloo_sockets._Gate()
    start = time.monotonic()
    stuck = gate.enter(0.5, lambda: False)
    thread, at = _entered_after(gate, 30.0)
    thread.join(5)
    assert at and 0.5 <= at[0] - start < 1.5
    # The overrunning build leaving late does not end the newcomer's turn.
    newcomer = gate.enter(30.0, None)
    gate.leave(stuck)
    thread, at = _entered_after(gate, 30.0)
    time.sleep(0.3)
    assert at == []
    gate.leave(newcomer)
    thread.join(5)
    assert at


def _builds_behind_a_stuck_one(pg: Any, rank: int, world: int) -> dict[str, Any]:
    """Hold the gate as a stuck build of an old epoch would, start a collective
    (its links are built inside it), then let that epoch end."""
    over = threading.Event()
    gloo_sockets._GATE.enter(60.0, over.is_set)
    t = torch.full((1024,), float(rank + 1))
    done = threading.Event()
    thread = threading.Thread(target=lambda: (pg.allreduce([t]).wait(), done.set()), daemon=True)
    thread.start()
    waited = not done.wait(1.0)
    over.set()
    thread.join(30)
    return {
        "waited": waited,
        "done": done.is_set(),
        "sum": t[0].item(),
        "conns": [len(link._conns) for link in pg.links.links().values()],
    }


def test_links_are_built_once_a_stuck_build_of_an_old_epoch_is_over() -> None:
    # The gate guards gloo's builds (socket links take their descriptors themselves).
    out = run_world(_builds_behind_a_stuck_one, 2, rails=2, config={"data_transport": "gloo"})
    for r in out:
        assert r["waited"]  # the gate held the builds while the stuck one counted
        assert r["done"] and r["sum"] == 3.0
        assert r["conns"] and all(n == 1 for n in r["conns"])  # each its own connection


def test_the_accepting_end_keeps_only_a_connection_accepted_on_the_links_rail() -> None:
    # A repair to a peer on rail 0 and a build to the same peer on rail 1 may run
    # at once: the peer's notes then name both connections (seen: the repaired
    # link kept rail 1's too and cut it with its own).
    conn = gloo_sockets.Conn(7, ("10.100.0.2", 40000), ("10.100.0.3", 51234))
    assert gloo_sockets._at(conn, "10.100.0.2")
    assert not gloo_sockets._at(conn, "10.101.0.2")
    assert gloo_sockets._at(conn, "node7-rail0")  # a host name is not compared
