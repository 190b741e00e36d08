"""The slow-rank vote: a quorum, fresh measurements, hysteresis and a cooldown."""

from __future__ import annotations

from typing import Any

import pytest

from resilient.detect.slow_rank import (
    COOLDOWN_CALLS,
    ENTER_VOTES,
    LEAVE_VOTES,
    WARMUP_CALLS,
    SlowRankVote,
    named,
    quorum,
)


def _table(world: int, slow: int | None, share: int, count: int) -> list[tuple[int, int, int]]:
    """Every other rank names ``slow`` at ``share`` permille; ``slow`` names rank 0."""
    rows = []
    for r in range(world):
        if slow is None or r == slow:
            rows.append(((r + 1) % world, 900, count))
        else:
            rows.append((slow, share, count))
    return rows


def test_quorum_is_two_thirds_of_the_others_and_at_least_two() -> None:
    assert [quorum(w) for w in (3, 4, 5, 8, 16)] == [2, 2, 3, 5, 10]


def test_named_needs_a_quorum_below_the_threshold() -> None:
    assert named(_table(4, 3, 300, 1), 500) == 3
    assert named(_table(4, 3, 600, 1), 500) is None
    lone = [(3, 100, 1), (0, 900, 1), (0, 900, 1), (0, 900, 1)]
    assert named(lone, 500) is None  # one rank's word is not enough
    assert named([(0, 0, 1), (0, 900, 1), (0, 900, 1)], 500) is None  # nobody names itself


def test_enters_after_fresh_votes_only_and_leaves_with_hysteresis() -> None:
    vote, seq, count = SlowRankVote(0, 4), WARMUP_CALLS, 0

    def step(slow: int | None, share: int, *, fresh: bool = True) -> int | None:
        nonlocal seq, count
        seq, count = seq + 1, count + (1 if fresh else 0)
        return vote.decide(seq, _table(4, slow, share, count))

    assert step(2, 300) is None
    for _ in range(10):  # the same measurement seen again is not a new vote
        assert step(2, 300, fresh=False) is None
    for _ in range(ENTER_VOTES - 2):
        assert step(2, 300) is None
    assert step(2, 300) == 2
    # Between the thresholds it stays (hysteresis), however long.
    for _ in range(20):
        assert step(2, 650) == 2
    for _ in range(LEAVE_VOTES - 1):
        assert step(None, 0) == 2
    assert step(None, 0) is None
    left_at = seq
    # Cooldown: even a clear verdict does not switch back at once.
    while seq < left_at + COOLDOWN_CALLS - 1:
        assert step(1, 100) is None
    for _ in range(ENTER_VOTES):
        got = step(1, 100)
    assert got == 1


def test_no_rank_is_named_slow_in_the_first_calls_of_an_epoch() -> None:
    vote = SlowRankVote(0, 4)
    for seq in range(1, WARMUP_CALLS):
        assert vote.decide(seq, _table(4, 2, 100, seq)) is None
    for seq in range(WARMUP_CALLS, WARMUP_CALLS + ENTER_VOTES):
        got = vote.decide(seq, _table(4, 2, 100, seq))
    assert got == 2


@pytest.mark.parametrize("world", [1, 2])
def test_small_worlds_never_switch(world: int) -> None:
    vote = SlowRankVote(0, world)
    for seq in range(10):
        assert vote.decide(seq, [(0, 0, seq)] * world) is None


@pytest.mark.timeout(10)
def test_the_vote_reports_a_link_straggler_and_its_clearing(
    tmp_path: Any, monkeypatch: Any
) -> None:
    """What tells a link straggler from a compute one: ``cause: link``, from the
    peers' send rates (resilient.detect.stragglers judges the exchange clocks)."""
    import resilient.events as ev_mod

    log = ev_mod.EventLog(tmp_path, job="j", rank=0)
    monkeypatch.setattr(ev_mod, "default_log", lambda: log)
    vote = SlowRankVote(0, 4)
    seq = WARMUP_CALLS
    for _ in range(ENTER_VOTES):
        seq += 1
        vote.decide(seq, _table(4, 2, 300, seq))
    for _ in range(LEAVE_VOTES):
        seq += 1
        vote.decide(seq, _table(4, None, 0, seq))
    log.close()
    found = [e for e in ev_mod.read_events(tmp_path) if e["kind"].startswith("straggler.")]
    assert [(e["kind"], e["rank"], e["cause"]) for e in found] == [
        ("straggler.confirmed", 2, "link"),
        ("straggler.cleared", 2, "link"),
    ]
    assert found[0]["relative"] == pytest.approx(0.3)


@pytest.mark.timeout(10)
def test_a_rank_the_clocks_already_show_slow_is_not_also_a_link_straggler(
    tmp_path: Any, monkeypatch: Any
) -> None:
    import resilient.events as ev_mod

    log = ev_mod.EventLog(tmp_path, job="j", rank=0)
    monkeypatch.setattr(ev_mod, "default_log", lambda: log)
    vote = SlowRankVote(0, 4, explained=lambda r: r == 2)
    seq = WARMUP_CALLS
    for _ in range(ENTER_VOTES):
        seq += 1
        got = vote.decide(seq, _table(4, 2, 300, seq))
    assert got == 2  # the schedule still spares it the reduction work
    for _ in range(LEAVE_VOTES):
        seq += 1
        vote.decide(seq, _table(4, None, 0, seq))
    log.close()
    kinds = [e["kind"] for e in ev_mod.read_events(tmp_path)]
    assert not [k for k in kinds if k.startswith("straggler.")], kinds
    assert "link.rerouted" in kinds


class _Link:
    """A link whose kernel counters grow by ``rate`` bytes per busy microsecond."""

    def __init__(self, rate: float) -> None:
        self.rate, self.busy = rate, 0

    def sent(self) -> tuple[int, int]:
        self.busy += 10_000
        return int(self.rate * self.busy), self.busy


class _Table:
    def __init__(self, links: dict[tuple[int, int], _Link]) -> None:
        self._links, self.rails, self.relayed = links, ["r0"], set()

    def links(self) -> dict[tuple[int, int], _Link]:
        return dict(self._links)


@pytest.mark.timeout(10)
def test_a_rank_cut_off_from_a_peer_abstains_instead_of_naming_another() -> None:
    from resilient.detect.slow_rank import SendRates

    # Rank 1 of 4: rank 3 reads slow, but rank 2 is reachable on no rail (the pair
    # goes through the store), so the call's pace says nothing about rank 3.
    cut_off = _Table({(0, 0): _Link(100.0), (3, 0): _Link(30.0)})
    meter = SendRates()
    for _ in range(3):
        meter.measure(cut_off, [0, 2, 3])  # type: ignore[arg-type]
    assert meter.lagging == (-1, 1000, 3)
    # With every peer reached, the same rates name rank 3 (30 % of the others).
    whole = _Table({(0, 0): _Link(100.0), (2, 0): _Link(100.0), (3, 0): _Link(30.0)})
    meter = SendRates()
    for _ in range(3):
        meter.measure(whole, [0, 2, 3])  # type: ignore[arg-type]
    peer, share, count = meter.lagging
    assert (peer, count) == (3, 2) and 280 <= share <= 320
    # A relayed pair anywhere in the table also means abstaining.
    whole.relayed.add((2, 0))
    meter.measure(whole, [0, 2, 3])  # type: ignore[arg-type]
    assert meter.lagging == (-1, 1000, 3)
