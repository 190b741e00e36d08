"""Straggler watch on the exchange clocks: the stolen-time and the compute signals."""

from __future__ import annotations

import random

import pytest
import torch

from resilient.collectives.signature import Exchange
from resilient.detect.stragglers import StragglerWatch

RANKS = 4
CALL_US = 25_000  # two calls per 50 ms step


class _Job:
    """Running clocks of RANKS ranks; every call each rank is active, waits or is stolen."""

    def __init__(self, seed: int) -> None:
        self.rng = random.Random(seed)
        self.clocks = [[0, 0, 0] for _ in range(RANKS)]
        self.seq = 0

    def call(self, *, stopped: int | None = None, late: int | None = None) -> Exchange:
        """One call of CALL_US wall time. ``stopped`` could not run 30 % of it (and so
        was as late as everyone: its peers block in the same ops); ``late`` computed
        30 % longer and the others waited for it in the exchange."""
        for r, c in enumerate(self.clocks):
            jitter = self.rng.gauss(0, 0.05) * CALL_US
            waited = max(0.0, 0.3 * CALL_US + jitter)
            stolen = self.rng.expovariate(1 / (0.03 * CALL_US))
            if r == stopped:
                stolen += 0.3 * CALL_US
            if late is not None:
                waited = 0.05 * CALL_US if r == late else waited + 0.3 * CALL_US
            total = CALL_US * (1.3 if late is not None else 1.0)
            c[0] += int(total - waited)
            c[1] += int(waited)
            c[2] += int(min(stolen, total))
        self.seq += 1
        return Exchange(
            seq=self.seq,
            inline=torch.zeros(RANKS, 1, dtype=torch.uint8),
            rates=[[] for _ in range(RANKS)],
            clocks=[(a, w, s) for a, w, s in self.clocks],
        )


def _settled(seed: int) -> tuple[_Job, StragglerWatch]:
    """A job and rank 1's watch after 200 clean calls (100 steps)."""
    job, watch = _Job(seed), StragglerWatch(rank=1)
    for _ in range(200):
        watch.observe(job.call())
    return job, watch


@pytest.mark.timeout(30)
@pytest.mark.parametrize("seed", range(3))
def test_clean_jittery_calls_confirm_nobody(seed: int) -> None:
    job, watch = _Job(seed), StragglerWatch(rank=0)
    for _ in range(2000):  # 1000 steps
        watch.observe(job.call())
    assert all(watch.state(r) != "confirmed" for r in range(RANKS))


@pytest.mark.timeout(30)
@pytest.mark.parametrize("seed", range(3))
def test_a_rank_that_cannot_run_30_percent_is_confirmed_within_20_steps(seed: int) -> None:
    job, watch = _settled(seed)
    calls = 0
    while watch.stalled.state(3) != "confirmed":
        watch.observe(job.call(stopped=3))
        calls += 1
        assert calls < 40, "not confirmed within 20 steps"
    assert [watch.state(r) for r in range(3)] == ["ok"] * 3
    for _ in range(200):
        watch.observe(job.call())
    assert watch.state(3) == "ok"


@pytest.mark.timeout(30)
@pytest.mark.parametrize("seed", range(3))
def test_a_rank_stopped_for_one_sample_only_is_not_confirmed(seed: int) -> None:
    # One 100 ms sample's worth of stolen time (a rank starved for a moment) is not
    # evidence enough: confirming takes three flagged samples of the last four.
    job, watch = _settled(seed)
    for _ in range(4):  # 4 calls of 25 ms: one sample
        watch.observe(job.call(stopped=3))
    for _ in range(200):
        watch.observe(job.call())
        assert watch.stalled.state(3) != "confirmed"


@pytest.mark.timeout(30)
def test_a_rank_its_peers_wait_for_is_a_compute_straggler() -> None:
    job, watch = _Job(11), StragglerWatch(rank=2)
    for _ in range(200):
        watch.observe(job.call())
    for _ in range(200):
        watch.observe(job.call(late=1))
    assert watch.compute.state(1) == "confirmed"
    assert watch.stalled.state(1) == "ok"
    assert [watch.state(r) for r in (0, 2, 3)] == ["ok"] * 3


@pytest.mark.timeout(10)
def test_verdicts_name_job_wide_ranks_and_stand_until_cleared() -> None:
    from resilient.detect.stragglers import Verdicts

    verdicts = Verdicts()
    verdicts.add(2, "stalled", 0.7, 0.3)
    verdicts.members = (0, 1, 3)  # after rank 2 left, position 2 is rank 3
    verdicts.add(2, "link", 0.4)
    standing = [(s.rank, s.cause, s.relative, s.lost_s) for s in verdicts.standing()]
    assert standing == [(2, "stalled", 0.7, 0.3), (3, "link", 0.4, None)]
    # Judged, then measured again: the new evidence keeps the last judgement.
    verdicts.judged(3, "link", "reroute")
    verdicts.add(2, "link", 0.3)
    assert [(s.rank, s.relative, s.judged) for s in verdicts.standing()][1] == (3, 0.3, "reroute")
    verdicts.clear(2, "link")
    assert [s.rank for s in verdicts.standing()] == [2]
    verdicts.reset((0, 1))  # a new epoch: the detectors start afresh
    assert verdicts.standing() == [] and verdicts.members == (0, 1)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("seed", range(3))
def test_the_time_lost_to_a_straggler_is_what_its_peers_waited(seed: int) -> None:
    from resilient.detect.stragglers import Verdicts

    job, watch = _settled(seed)
    watch.sink = sink = Verdicts()
    calls = 0
    while watch.stalled.state(3) != "confirmed":
        watch.observe(job.call(stopped=3))
        calls += 1
        assert calls < 40
    lost = watch.lost_s(3, "stalled")
    (standing,) = sink.standing()
    assert (standing.rank, standing.cause) == (3, "stalled") and standing.lost_s == lost
    # Stopped 30 % of each 25 ms call beyond its peers' few percent: about 7.5 ms
    # per call since it was first suspected (a call or three before the first flag
    # goes unaccounted, a sample being several calls).
    assert 0.0075 * (calls - 8) <= lost <= 0.0085 * calls, (calls, lost)
    for _ in range(40):
        watch.observe(job.call(stopped=3))
    (standing,) = sink.standing()
    assert standing.lost_s == pytest.approx(lost + 40 * 0.0075, rel=0.25)
    assert [watch.lost_s(r, "stalled") for r in range(3)] == [0.0] * 3
    for _ in range(200):  # it runs again: cleared, and nothing stands
        watch.observe(job.call())
    assert sink.standing() == [] and watch.lost_s(3, "stalled") == 0.0


@pytest.mark.timeout(30)
def test_a_rank_stolen_for_a_whole_sample_is_reported_not_raised() -> None:
    # Its stolen time covers the whole sample (stopped throughout, or its meter held
    # up as long): its slowdown is the sample's span in us, its relative score rounds
    # to 0, and reporting it must not divide by that.
    job, watch = _settled(0)
    for _ in range(8):
        exchange = job.call()
        a, w, _ = exchange.clocks[3]
        exchange.clocks[3] = (a, w, a + w)  # all of its time so far, stolen
        job.clocks[3][2] = a + w
        watch.observe(exchange)
    assert watch.stalled.state(3) in ("suspected", "confirmed")
    assert [watch.state(r) for r in range(3)] == ["ok"] * 3


@pytest.mark.timeout(30)
@pytest.mark.parametrize("seed", range(3))
def test_a_suspicion_clears_only_after_several_clean_samples(seed: int) -> None:
    from resilient.detect.stragglers import STALL_CONFIG

    job, watch = _settled(seed)
    calls = 0
    while watch.stalled.state(3) != "suspected":  # one sample of a rank stopped 30 %
        watch.observe(job.call(stopped=3))
        calls += 1
        assert calls <= 8, "one stopped sample was not suspected"
    calls = 0
    while watch.stalled.state(3) == "suspected":
        watch.observe(job.call())
        calls += 1
        if calls == 4:  # one clean sample (4 calls of 25 ms) is not enough
            assert watch.stalled.state(3) == "suspected"
        assert calls <= 40
    # Cleared, not confirmed, after a clean sample per slot of the confirm window.
    assert watch.stalled.state(3) == "ok"
    assert calls >= 4 * STALL_CONFIG.confirm_window, calls


def _compute_times(rng: random.Random, slow: float) -> dict[int, float]:
    """Active seconds per 0.4 s sample, 8 % jitter; rank 1 ``slow`` times the others."""
    return {r: 0.3 * (slow if r == 1 else 1.0) * (1 + rng.gauss(0, 0.08)) for r in range(RANKS)}


@pytest.mark.timeout(30)
@pytest.mark.parametrize("seed", range(3))
def test_compute_a_few_percent_slower_is_noise_thirty_percent_a_straggler(seed: int) -> None:
    # A crowded host keeps one healthy rank active a little longer than its peers
    # for seconds (its share of the cores): 5 % with 8 % jitter per sample was
    # confirmed in 3 of 10 seeds at the default 12 % margin, in none at 15 %. A rank
    # whose compute is 30 % slower is confirmed all the same.
    from resilient.detect.straggler_scores import StragglerDetector
    from resilient.detect.stragglers import COMPUTE_CONFIG

    rng = random.Random(seed)
    det = StragglerDetector(COMPUTE_CONFIG)
    kinds = [t.kind for n in range(500) for t in det.observe(n, _compute_times(rng, 1.05))]
    assert "confirmed" not in kinds and det.state(1) != "confirmed"
    det = StragglerDetector(COMPUTE_CONFIG)
    for n in range(20):
        det.observe(n, _compute_times(rng, 1.0))
    confirmed = [
        n for n in range(20, 40)
        for t in det.observe(n, _compute_times(rng, 1.3)) if t.kind == "confirmed"
    ]  # fmt: skip
    assert confirmed and confirmed[0] - 20 <= 12, confirmed  # 6 flagged medians of 5
    assert [det.state(r) for r in (0, 2, 3)] == ["ok"] * 3


@pytest.mark.timeout(30)
def test_an_epochs_first_calls_are_not_judged() -> None:
    # Start-up (links built on first use, a crowded host's uneven turns) is no
    # evidence: a rank stalled from the first call is judged from WARMUP_CALLS on,
    # and then confirmed as any straggler is.
    from resilient.detect.stragglers import WARMUP_CALLS

    job, watch = _Job(5), StragglerWatch(rank=0)
    seen = []
    while job.seq < WARMUP_CALLS + 40:
        exchange = job.call(stopped=3)
        watch.observe(exchange)
        seen.append((exchange.seq, watch.stalled.state(3)))
    assert all(state == "ok" for seq, state in seen if seq < WARMUP_CALLS)
    confirmed = [seq for seq, state in seen if state == "confirmed"]
    assert confirmed and confirmed[0] - WARMUP_CALLS < 40, confirmed
