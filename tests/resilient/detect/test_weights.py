"""Learned rail weights: the agreement rule, and a slow rail losing its share for real."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch

from resilient.detect.rail_weights import DOWN, PROBE_EVERY, QUANTUM, agreed_backups, agreed_weights
from tests._dist import run_world


@pytest.mark.timeout(10)
def test_weights_follow_the_slowest_rank_of_each_rail() -> None:
    rates = [[400, 100], [390, 120], [410, 100]]  # rail 1 is 4x slower everywhere
    w = agreed_weights(rates, (1.0, 1.0), seq=1)
    assert w[0] / sum(w) == pytest.approx(390 / 490, abs=2 / QUANTUM)
    assert agreed_weights(rates, (1.0, 1.0), seq=1) == w  # a pure function


@pytest.mark.timeout(10)
def test_unknown_rates_or_one_rail_keep_the_static_weights() -> None:
    assert agreed_weights([[0, 100], [300, 100]], (1.0, 1.0), seq=3) == (1.0, 1.0)
    assert agreed_weights([[300], [200]], (1.0,), seq=3) == (1.0,)
    assert agreed_weights([], (2.0, 1.0), seq=3) == (2.0, 1.0)


@pytest.mark.timeout(10)
def test_a_starved_rail_is_dropped_but_probed() -> None:
    w = agreed_weights([[10**9, 10]], (1.0, 1.0), seq=1)
    assert w == (float(QUANTUM), 0.0)  # not even a token share: calls never wait for it
    probe = agreed_weights([[10**9, 10]], (1.0, 1.0), seq=PROBE_EVERY)
    assert probe[1] / sum(probe) > 1 / 20  # lifted toward PROBE_SHARE (then renormalised)


def _throttled(pg: Any, rank: int, world: int) -> dict[str, Any]:
    import time

    from resilient.links import fault_hook

    # Rail 0 of rank 1 at 80 Mbit/s (the in-process fault hook, no root needed).
    hook = fault_hook.FaultHook()
    hook.faults = (fault_hook.LinkFault(kind="throttle", rank=1, rail=0, rate_bps=80e6),)
    fault_hook._HOOK = hook
    times, digests = [], []
    for i in range(24):
        t = torch.arange(1 << 20, dtype=torch.float32) * (rank + 1) + i
        start = time.perf_counter()
        pg.allreduce([t]).wait()
        times.append(time.perf_counter() - start)
        digests.append(hashlib.sha256(t.numpy().tobytes()).hexdigest())
    expect = torch.arange(1 << 20, dtype=torch.float32) * sum(range(1, world + 1)) + world * 23
    return {
        "first_s": times[0],
        "last_s": sorted(times[-6:])[3],
        "weights": pg.engine.weights,
        "control_weights": pg.epochs.checks.engine.weights,
        "digests": digests,
        "exact": bool(torch.equal(t, expect)),
    }


@pytest.mark.timeout(180)
def test_a_throttled_rail_loses_its_share_and_results_stay_identical() -> None:
    results = run_world(_throttled, 3, rails=2, config={"topology": "ring"}, timeout_s=150)
    for r in results:
        assert r["exact"]
        assert r["digests"] == results[0]["digests"]  # bitwise equal on every rank
        assert r["weights"] == results[0]["weights"]  # agreed, not merely similar
        w0, w1 = r["weights"]
        assert w0 / (w0 + w1) < 0.2, r["weights"]  # the slow rail carries little or nothing
        assert r["last_s"] < r["first_s"] / 2, (r["first_s"], r["last_s"])
        # The signature exchange (one rail, the heaviest) left the slow rail too.
        c0, c1 = r["control_weights"]
        assert c1 > c0, r["control_weights"]


@pytest.mark.timeout(10)
def test_degraded_and_repaired_events_need_a_streak(tmp_path: Any, monkeypatch: Any) -> None:
    import resilient.events as ev_mod
    from resilient.collectives.signature import Exchange
    from resilient.detect.rail_weights import CONFIRM_CALLS, WeightLearner

    log = ev_mod.EventLog(tmp_path, job="j", rank=0)
    monkeypatch.setattr(ev_mod, "default_log", lambda: log)
    learner = WeightLearner((1.0, 1.0), rank=0)
    slow, fast = [[400, 10]], [[400, 400]]
    seq = 1

    def call(rates: list[list[int]]) -> None:
        nonlocal seq
        seq += 1 if (seq + 1) % PROBE_EVERY else 2  # skip probe calls
        learner.weights_for(Exchange(seq=seq, inline=torch.empty(0), rates=rates))

    call(slow)
    call(fast)  # one noisy call: no event
    for _ in range(CONFIRM_CALLS):
        call(slow)
    assert learner.slow == {1}
    for _ in range(CONFIRM_CALLS):
        call(fast)
    assert learner.slow == set()
    log.close()
    kinds = [e["kind"] for e in ev_mod.read_events(tmp_path)]
    assert kinds == ["link.degraded", "link.repaired"]


@pytest.mark.timeout(10)
def test_every_rail_no_rank_proposes_down_is_a_backup_whatever_its_share() -> None:
    fast, slow = 100_000_000, 1_000_000  # rail 1 gets no share at all
    assert agreed_weights([[fast, slow], [fast, slow]], (1.0, 1.0), 1)[1] == 0
    assert agreed_backups([[fast, slow], [fast, slow]], 2) == frozenset({0, 1})
    assert agreed_backups([[fast, int(DOWN)], [fast, slow]], 2) == frozenset({0})
    assert agreed_backups([[0, 0], [0, 0]], 2) == frozenset({0, 1})  # nothing measured yet
    assert agreed_backups([], 2) is None
    assert agreed_backups([[int(DOWN), slow], [fast, int(DOWN)]], 2) is None  # the board decides
