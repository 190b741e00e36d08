"""The remedy policy's choices (pure cost estimates)."""

from __future__ import annotations

import math

import pytest

from recovery.policy import JobView, Policy
from resilient.config import RecoveryConfig
from resilient.errors import ConfigError

# 4 ranks, 100 ms steps, 100 MB of state at 1 GB/s (0.1 s to send).
JOB = JobView(
    world=4, members=4, step_s=0.1, steps_left=1000, state_bytes=100_000_000,
    link_bytes_per_s=1e9,
)  # fmt: skip


def _costs(choice: object) -> dict[str, float]:
    return {o.action: o.cost_s for o in choice.options}  # type: ignore[attr-defined]


@pytest.mark.timeout(10)
def test_no_replacement_coming_means_shrink_at_once_or_stop() -> None:
    policy = Policy()
    shrink = policy.rank_lost(JOB, replacement="none", shrink_allowed=True)
    assert shrink.action == "shrink"
    assert math.isinf(_costs(shrink)["replace"])
    # Three ranks do four's work for the 1000 steps left: +1/3 of 100 s.
    assert _costs(shrink)["shrink"] == pytest.approx(1000 * 0.1 / 3)
    stop = policy.rank_lost(JOB, replacement="none", shrink_allowed=False)
    assert stop.action == "stop"


@pytest.mark.timeout(10)
def test_replace_first_waits_for_a_coming_replacement_cost_may_not() -> None:
    cold = Policy().rank_lost(JOB, replacement="cold", shrink_allowed=True)
    assert cold.action == "replace"
    costs = _costs(cold)
    # Waiting 5 s + 0.1 s of transfer, against 50 slower steps (+1/3 each) + 0.1 s.
    assert costs["replace"] == pytest.approx(5.1)
    assert costs["shrink"] == pytest.approx(50 * 0.1 / 3 + 0.1)
    by_cost = Policy(RecoveryConfig(policy="cost"))
    assert by_cost.rank_lost(JOB, replacement="cold", shrink_allowed=True).action == "shrink"
    # Three ranks, a warm spare in 0.5 s: two ranks do 1.5x their work for the
    # 5 steps until it joins (0.25 s), cheaper than all waiting 0.5 s.
    three = JobView(world=3, members=3, step_s=0.1, steps_left=1000, state_bytes=0)
    warm = by_cost.rank_lost(three, replacement="warm", shrink_allowed=True)
    assert _costs(warm) == {"replace": pytest.approx(0.5), "shrink": pytest.approx(0.25)}
    assert warm.action == "shrink"
    # Two ranks: the survivor alone does twice the work while it waits: a tie, and
    # waiting wins ties (the run stays reproducible).
    two = JobView(world=2, members=2, step_s=0.1, steps_left=1000, state_bytes=0)
    assert by_cost.rank_lost(two, replacement="warm", shrink_allowed=True).action == "replace"


@pytest.mark.timeout(10)
def test_a_job_near_its_end_shrinks_rather_than_wait_under_cost() -> None:
    ending = JobView(world=4, members=4, step_s=0.1, steps_left=3, state_bytes=0)
    choice = Policy(RecoveryConfig(policy="cost")).rank_lost(
        ending, replacement="cold", shrink_allowed=True
    )
    assert choice.action == "shrink"
    assert _costs(choice)["shrink"] == pytest.approx(3 * 0.1 / 3)


@pytest.mark.timeout(10)
def test_only_a_link_straggler_is_rerouted() -> None:
    policy = Policy()
    link = policy.straggler(JOB, slowdown=1.5, cause="link")
    assert link.action == "reroute"
    assert _costs(link)["tolerate"] == pytest.approx(0.05 * 1000)
    stalled = policy.straggler(JOB, slowdown=1.5, cause="stalled")
    assert stalled.action == "tolerate" and math.isinf(_costs(stalled)["reroute"])


@pytest.mark.timeout(10)
def test_a_straggler_is_evicted_only_when_enabled_and_cheaper_than_waiting() -> None:
    # Off by default: never evicted, however slow.
    off = Policy().straggler(JOB, slowdown=2.0, cause="stalled")
    assert off.action == "tolerate" and math.isinf(_costs(off)["evict"])
    policy = Policy(RecoveryConfig(evict_stragglers=True))
    # 1000 steps each 100 ms late (100 s) against a cold replacement in 5 s, the
    # state in 0.1 s and one step replayed.
    slow = policy.straggler(JOB, slowdown=2.0, cause="compute")
    assert slow.action == "evict"
    assert _costs(slow)["evict"] == pytest.approx(5.0 + 0.1 + 0.1)
    # Near the end of the job waiting is cheaper: 20 steps x 50 ms = 1 s.
    ending = JobView(world=4, members=4, step_s=0.1, steps_left=20, state_bytes=0)
    assert policy.straggler(ending, slowdown=1.5, cause="stalled").action == "tolerate"
    # A warm spare is priced at warm_eta_s; with no restart left, no eviction.
    warm = policy.straggler(JOB, slowdown=2.0, cause="compute", replacement="warm")
    assert _costs(warm)["evict"] == pytest.approx(0.5 + 0.1 + 0.1)
    spent = policy.straggler(JOB, slowdown=2.0, cause="compute", replacement="none")
    assert spent.action == "tolerate" and math.isinf(_costs(spent)["evict"])
    # Unless the others may go on without it: 3 ranks do 4's work (+1/3 of 100 ms
    # per step) for the 1000 steps left, plus one replayed step, against 100 ms
    # lost on every step.
    alone = policy.straggler(
        JOB, slowdown=2.0, cause="compute", replacement="none", shrink_allowed=True
    )
    assert alone.action == "evict"
    assert _costs(alone)["evict"] == pytest.approx(1000 * 0.1 / 3 + 0.1)
    # A mild straggler costs less than a shrink: it stays.
    mild = policy.straggler(
        JOB, slowdown=1.2, cause="compute", replacement="none", shrink_allowed=True
    )
    assert mild.action == "tolerate"
    # A slow link is routed around for less than a replacement costs.
    assert policy.straggler(JOB, slowdown=1.2, cause="link").action == "reroute"


@pytest.mark.timeout(10)
def test_a_straggler_is_tolerated_until_it_has_cost_what_evicting_it_would() -> None:
    policy = Policy(RecoveryConfig(evict_stragglers=True))
    # Half speed with 1000 steps left would cost 100 s, but it was seen slow for
    # only 1 s so far: as much again is assumed, less than a 5.2 s cold replacement.
    young = policy.straggler(JOB, slowdown=2.0, cause="stalled", lost_s=1.0)
    assert young.action == "tolerate" and _costs(young)["tolerate"] == pytest.approx(1.0)
    old = policy.straggler(JOB, slowdown=2.0, cause="stalled", lost_s=6.0)
    assert old.action == "evict"
    # Capped at its cost to the job's end: 20 steps x 100 ms.
    ending = JobView(world=4, members=4, step_s=0.1, steps_left=20, state_bytes=0)
    late = policy.straggler(ending, slowdown=2.0, cause="compute", lost_s=60.0)
    assert late.action == "tolerate" and _costs(late)["tolerate"] == pytest.approx(2.0)
    # A warm spare costs less to bring in: evicted sooner.
    warm = policy.straggler(JOB, slowdown=2.0, cause="stalled", lost_s=1.0, replacement="warm")
    assert warm.action == "evict"


@pytest.mark.timeout(10)
def test_evict_stragglers_is_read_from_the_environment() -> None:
    assert RecoveryConfig.from_env({"RESILIENT_EVICT_STRAGGLERS": "1"}).evict_stragglers
    assert not RecoveryConfig.from_env({}).evict_stragglers
    with pytest.raises(ConfigError):
        RecoveryConfig.from_env({"RESILIENT_EVICT_STRAGGLERS": "maybe"})


@pytest.mark.timeout(10)
def test_bad_policy_settings_are_refused() -> None:
    with pytest.raises(ConfigError):
        RecoveryConfig(policy="fastest")
    with pytest.raises(ConfigError):
        RecoveryConfig(cold_eta_s=-1.0)
