"""The step API without a resilient group (gloo or none): commit, resume, misuse."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from recovery.session import Session, TrainState
from resilient.errors import RecoveryError

pytestmark = pytest.mark.timeout(10)


def _state() -> TrainState:
    model = torch.nn.Linear(2, 1)
    return TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_a_step_commits_only_when_its_block_ends_without_an_error() -> None:
    state = _state()
    session = Session(None, state)
    before = state.model.weight.detach().clone()
    with pytest.raises(ValueError), session.step(0):
        state.model(torch.ones(1, 2)).sum().backward()
        raise ValueError("the step failed before its commit")
    assert torch.equal(state.model.weight, before) and session.committed == -1
    with session.step(0):
        state.model(torch.ones(1, 2)).sum().backward()
    assert not torch.equal(state.model.weight, before) and session.committed == 0


def test_steps_resume_after_a_checkpoint_and_count_it_committed() -> None:
    session = Session(None, _state())
    seen = []
    for step in session.steps(5, start=3):
        with session.step(step):
            seen.append(step)
    assert seen == [3, 4] and session.committed == 4


def test_a_step_outside_the_context_is_an_error_not_an_endless_loop() -> None:
    session = Session(None, _state())
    with pytest.raises(RecoveryError):
        for _ in session.steps(3):
            pass


def test_the_policy_prices_a_straggler_against_the_step_time_without_it() -> None:
    import time

    session = Session(None, _state())
    for step in session.steps(40):
        with session.step(step):
            # 30 steps of ~10 ms, then every step waits ~30 ms for a straggler.
            time.sleep(0.01 if step < 30 else 0.03)
    smoothed, unslowed = session._step_s, session._unslowed_step_s()
    assert smoothed > 0.02, smoothed  # mostly the slowed steps by now
    assert 0.008 < unslowed < 0.025 < smoothed, (unslowed, smoothed)


def _claimant(store: object, rank: int, epoch: int) -> Session:
    """A session of ``rank`` at ``epoch`` with only what claiming an eviction reads."""
    from types import SimpleNamespace

    s = Session.__new__(Session)
    s.pg = SimpleNamespace(store=store, epoch=epoch)
    s._rank, s._next = rank, 0
    return s


@pytest.mark.timeout(30)
def test_only_the_first_straggler_of_an_epoch_may_leave(etcd_store: object) -> None:
    # Two stragglers confirmed together both choose to leave; the launcher may have
    # a restart for one only, so the first claim in the store wins the epoch.
    assert _claimant(etcd_store, 3, epoch=0)._first_to_leave()
    assert not _claimant(etcd_store, 1, epoch=0)._first_to_leave()
    assert _claimant(etcd_store, 3, epoch=0)._first_to_leave()  # asking again is fine
    assert _claimant(etcd_store, 1, epoch=1)._first_to_leave()


@pytest.mark.timeout(30)
def test_a_store_that_cannot_be_reached_keeps_the_straggler_in() -> None:
    class Down:
        def compare_set(self, *args: object) -> bytes:
            raise ConnectionError("store down")

    assert not _claimant(Down(), 2, epoch=0)._first_to_leave()


class _Judging:
    """A session whose straggler verdicts are judged without a group: what it
    decides and which steps it left at are recorded."""

    def __init__(
        self, monkeypatch: pytest.MonkeyPatch, members: tuple[int, ...], **config: Any
    ) -> None:
        from types import SimpleNamespace

        from resilient.config import RecoveryConfig
        from resilient.detect.stragglers import Verdicts

        self.left: list[int] = []
        self.decisions: list[Any] = []
        monkeypatch.setattr(Session, "_leave", lambda _s, n, why: self.left.append(n))
        monkeypatch.setattr(Session, "_first_to_leave", lambda _s: True)
        self.session = Session(
            None, _state(), config=RecoveryConfig(evict_stragglers=True, **config)
        )
        monkeypatch.setattr(
            self.session.policy, "record", lambda choice, **kw: self.decisions.append(choice)
        )
        self.verdicts = Verdicts()
        # No membership (as under torchrun, where an exit would restart every worker)
        # until a test gives the group one.
        self.session.pg = SimpleNamespace(
            verdicts=self.verdicts, members=members, epoch=0,
            engine=SimpleNamespace(rail_rates=()),
        )  # fmt: skip
        self.session._rank, self.session._step_s, self.session._total = 2, 0.1, 1000

    def publish(self, budget: dict[str, Any]) -> None:
        from types import SimpleNamespace

        self.session.pg.membership = SimpleNamespace(supervisor=lambda: budget)


def test_a_straggler_leaves_only_where_a_launcher_publishes_a_restart_left(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    j = _Judging(monkeypatch, (0, 1, 2, 3))
    # Rank 2 at half speed for long enough: 10 s lost already.
    j.verdicts.add(2, "compute", 0.5, 10.0)
    j.session._judge_stragglers(10)
    assert [c.action for c in j.decisions] == ["tolerate"] and not j.left
    j.session._judge_stragglers(11)  # the same choice is not logged again
    assert len(j.decisions) == 1
    # A launcher that publishes a restart left and a warm spare: the same verdict evicts.
    j.publish({"restarts_left": 1, "warm_spares": True})
    j.session._judge_stragglers(12)
    assert j.decisions[-1].action == "evict" and j.left == [12]


@pytest.mark.timeout(10)
def test_a_straggler_is_evicted_once_it_has_cost_what_its_replacement_would(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    j = _Judging(monkeypatch, (0, 1, 2), warm_eta_s=0.5, cold_eta_s=5.0)
    session, verdicts, decisions, left = j.session, j.verdicts, j.decisions, j.left
    # Rank 1's spare stands ready, rank 2's is still warming up: a cold start's price.
    budget: dict[str, Any] = {"restarts_left": 1, "warm_spares": True, "ready": [1]}
    j.publish(budget)
    verdicts.add(2, "stalled", 0.5, 0.3)  # half speed, 0.3 s lost so far
    session._judge_stragglers(10)
    assert [c.action for c in decisions] == ["tolerate"]
    verdicts.add(2, "stalled", 0.5, 4.0)  # still slow: 4 s lost, under 5.2 s
    session._judge_stragglers(20)
    assert len(decisions) == 1 and not left
    budget["ready"] = [1, 2]  # its spare stands ready: 0.7 s to replace it
    session._judge_stragglers(21)
    assert decisions[-1].action == "evict" and left == [21]
    # A straggler cleared before it cost that much is never evicted.
    left.clear()
    verdicts.clear(2, "stalled")
    verdicts.add(1, "stalled", 0.5, 0.2)
    session._rank = 1
    session._judge_stragglers(22)
    assert decisions[-1].action == "tolerate" and not left


@pytest.mark.parametrize("rolls_back", [False, True])
def test_a_rollback_packs_no_state_to_send(
    monkeypatch: pytest.MonkeyPatch, rolls_back: bool
) -> None:
    # Every rank loads the checkpoint in a rollback: a packed state would be thrown away.
    from types import SimpleNamespace

    packed: list[int] = []
    monkeypatch.setattr(Session, "_pack", lambda s: packed.append(s.committed) or "packed")
    session = Session(None, _state())
    session.pg = SimpleNamespace(
        quiesce=lambda _t: {"data": [], "ctl": []}, incarnation=0, rails=["127.0.0.1"],
        engine=SimpleNamespace(rail_rates=()),
    )  # fmt: skip
    session._rolls_back = rolls_back
    record, _ = session._stop_and_report()
    assert record.step == -1
    assert (packed, session._payload) == (([], None) if rolls_back else ([-1], "packed"))
