"""The step API without a resilient group (gloo or none): commit, resume, misuse."""

from __future__ import annotations

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
