"""Straggler detection on synthetic step times: noise never confirms, 30 % slower does."""

from __future__ import annotations

import random

import pytest

from resilient.detect.straggler_scores import StragglerConfig, StragglerDetector, Transition
from resilient.errors import ConfigError

RANKS = 4
BASE_S = 0.030


def _times(rng: random.Random, slow: dict[int, float] | None = None) -> dict[int, float]:
    """One step: every rank 30 ms with 5 % gaussian jitter and rare 2x spikes."""
    out = {}
    for r in range(RANKS):
        t = BASE_S * (1 + rng.gauss(0, 0.05)) * (slow or {}).get(r, 1.0)
        if rng.random() < 0.01:
            t *= 2.0  # a GC pause or a page-fault storm: one step, not a straggler
        out[r] = t
    return out


@pytest.mark.timeout(30)
@pytest.mark.parametrize("seed", range(5))
def test_a_thousand_clean_steps_with_jitter_confirm_nobody(seed: int) -> None:
    rng, det = random.Random(seed), StragglerDetector()
    seen: list[Transition] = []
    for step in range(1000):
        seen += det.observe(step, _times(rng))
    assert [t for t in seen if t.kind == "confirmed"] == []


@pytest.mark.timeout(30)
@pytest.mark.parametrize("seed", range(5))
def test_a_rank_slowed_by_30_percent_is_confirmed_within_20_steps(seed: int) -> None:
    rng, det = random.Random(seed), StragglerDetector()
    for step in range(100):
        det.observe(step, _times(rng))
    confirmed_at = None
    for step in range(100, 140):
        for t in det.observe(step, _times(rng, slow={2: 1.3})):
            if t.kind == "confirmed":
                assert (t.rank, t.cause) == (2, "compute")
                assert t.relative < 0.85
                confirmed_at = confirmed_at if confirmed_at is not None else step
    assert confirmed_at is not None and confirmed_at - 100 < 20, confirmed_at
    assert det.state(2) == "confirmed" and det.state(0) == "ok"
    cleared = [t for s in range(140, 180) for t in det.observe(s, _times(rng)) if t.rank == 2]
    assert cleared and cleared[-1].kind == "cleared" and det.state(2) == "ok"


@pytest.mark.timeout(30)
def test_a_rank_with_slow_links_but_normal_compute_is_a_link_straggler() -> None:
    rng, det = random.Random(7), StragglerDetector()
    rates = {0: 1e9, 1: 1e9, 2: 1e9, 3: 2e8}
    kinds = [
        (t.kind, t.rank, t.cause)
        for step in range(30)
        for t in det.observe(step, _times(rng), link_rates=rates)
    ]
    assert ("confirmed", 3, "link") in kinds
    assert all(rank == 3 for _, rank, _ in kinds)


@pytest.mark.timeout(10)
def test_bad_thresholds_are_refused() -> None:
    with pytest.raises(ConfigError):
        StragglerConfig(confirm_steps=12, confirm_window=10)
    with pytest.raises(ConfigError):
        StragglerConfig(margin=1.5)
