"""A replacement that comes after the job finished without it (issue 43): when the
job counts as finished (every other member committed every step *and* shut its
group down) and when not (a peer that failed and shut down, one still training,
one recovering), on a real TCPStore; and how agree and the session act on it."""

from __future__ import annotations

import time
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from membership.epoch import advance_epoch
from recovery.agree import NO_STATE, Record, agree
from recovery.joining import finished_check, job_finished, mark_finished
from recovery.session import Session, TrainState
from resilient.detect.health_board import HealthBoard
from resilient.errors import JobFinished, RecoveryError
from resilient.procs import free_port

pytestmark = pytest.mark.timeout(30)

WORLD = 4
ME = 3  # the replacement's rank


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=10))


def _finish(store: Any, epoch: int, rank: int, pos: int, *, steps: bool, left: bool) -> None:
    """What a member writes: the marker when its steps() ran to the end, its health
    record's departure (HealthBoard.leave, as its group's shutdown writes it)."""
    if steps:
        mark_finished(store, epoch=epoch, rank=rank, step=9)
    if left:
        HealthBoard(rank=pos, world=WORLD, store=store, epoch=epoch).leave(42)


def test_every_other_member_finished_and_left_is_a_finished_job() -> None:
    store = _store()
    for r in (0, 1):
        _finish(store, 0, r, r, steps=True, left=True)
    assert not job_finished(store, epoch=0, world=WORLD, me=ME)  # rank 2 still runs
    _finish(store, 0, 2, 2, steps=True, left=True)
    assert job_finished(store, epoch=0, world=WORLD, me=ME)


def test_a_peer_that_shut_down_after_an_error_is_no_finish() -> None:
    # leave() runs at every shutdown, atexit included: a rank that failed mid-job
    # has `left` in its health record, but its steps() never ran to the end.
    store = _store()
    for r in (0, 1):
        _finish(store, 0, r, r, steps=True, left=True)
    _finish(store, 0, 2, 2, steps=False, left=True)
    assert not job_finished(store, epoch=0, world=WORLD, me=ME)


def test_a_peer_that_finished_its_steps_but_has_not_left_may_still_train() -> None:
    store = _store()
    for r in range(3):
        _finish(store, 0, r, r, steps=True, left=r != 1)
    assert not job_finished(store, epoch=0, world=WORLD, me=ME)


def test_a_peer_recovering_at_the_epoch_is_no_finish_another_replacement_is_skipped() -> None:
    store = _store()
    for r in (0, 1):
        _finish(store, 0, r, r, steps=True, left=True)
    store.set("recovery/e0/r2", Record(rank=2, incarnation=0, step=5).to_json())
    assert not job_finished(store, epoch=0, world=WORLD, me=ME)  # a survivor recovering
    store.set("recovery/e0/r2", Record(rank=2, incarnation=1, step=NO_STATE).to_json())
    assert job_finished(store, epoch=0, world=WORLD, me=ME)  # a replacement, like this one


def test_only_replacements_left_is_no_finish() -> None:
    store = _store()
    for r in range(3):
        store.set(f"recovery/e0/r{r}", Record(rank=r, incarnation=1, step=NO_STATE).to_json())
    assert not job_finished(store, epoch=0, world=WORLD, me=ME)


def test_after_a_shrink_the_epochs_members_and_their_positions_count() -> None:
    # Epoch 1 went on with ranks (0, 2, 3): rank 2's health record is at position 1.
    store = _store()
    assert not job_finished(store, epoch=1, world=WORLD, me=ME)  # no history record yet
    advance_epoch(store, 0, {"members": [0, 2, 3]})
    _finish(store, 1, 0, 0, steps=True, left=True)
    _finish(store, 1, 2, 2, steps=True, left=True)  # position 2 is rank 3's, not rank 2's
    assert not job_finished(store, epoch=1, world=WORLD, me=ME)
    HealthBoard(rank=1, world=3, store=store, epoch=1).leave(7)
    assert job_finished(store, epoch=1, world=WORLD, me=ME)


def test_a_store_that_fails_is_no_finish() -> None:
    class Broken:
        def check(self, keys: list[str]) -> bool:
            raise RuntimeError("etcd is down")

    assert not job_finished(Broken(), epoch=0, world=WORLD, me=ME)


def test_the_check_looks_at_most_every_interval() -> None:
    store = _store()
    looks: list[list[str]] = []
    real = store.check

    class Counting:
        def check(self, keys: list[str]) -> bool:
            looks.append(keys)
            return bool(real(keys))

    check = finished_check(Counting(), epoch=0, world=WORLD, me=ME, every_s=10.0)
    assert not check()
    first = len(looks)
    assert first > 0 and not check()
    assert len(looks) == first  # the second call came within the interval: no look


def test_a_waiting_replacement_raises_job_finished_promptly() -> None:
    store = _store()
    for r in range(3):
        _finish(store, 0, r, r, steps=True, left=True)
    record = Record(rank=ME, incarnation=1, step=NO_STATE, data=[], ctl=[])
    finished = finished_check(store, epoch=0, world=WORLD, me=ME)
    began = time.monotonic()
    with pytest.raises(JobFinished, match="finished the job"):
        agree(store, epoch=0, world=WORLD, record=record, timeout_s=20, decide=False,
              finished=finished)  # fmt: skip
    assert time.monotonic() - began < 2.0
    assert issubclass(JobFinished, RecoveryError)


def test_a_decision_already_taken_wins_over_finished() -> None:
    # Members that took this replacement in and then finished did admit it.
    store = _store()
    recs = {r: Record(rank=r, incarnation=0, step=9) for r in range(3)}
    recs[ME] = Record(rank=ME, incarnation=1, step=NO_STATE, data=[], ctl=[])
    for r, rec in recs.items():
        store.set(f"recovery/e0/r{r}", rec.to_json())
    store.set("recovery/e0/members", "[0, 1, 2, 3]")
    plan = agree(store, epoch=0, world=WORLD, record=recs[ME], timeout_s=5, decide=False,
                 finished=lambda: True)  # fmt: skip
    assert plan.joined == (ME,)


def test_members_that_decide_never_ask_finished() -> None:
    store = _store()
    asked: list[int] = []

    def finished() -> bool:
        asked.append(1)
        return True

    with pytest.raises(RecoveryError, match="did not report") as raised:
        agree(store, epoch=0, world=2, record=Record(rank=0, incarnation=0, step=1),
              timeout_s=0.3, finished=finished)  # fmt: skip
    assert not asked and not isinstance(raised.value, JobFinished)


def _state() -> TrainState:
    model = torch.nn.Linear(2, 1)
    return TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))


def test_a_session_whose_steps_ran_to_the_end_marks_the_job_finished() -> None:
    store = dist.HashStore()
    session = Session(None, _state())
    session.pg = SimpleNamespace(store=store, epoch=2, joining=False, members=(0, 1))
    session._rank, session._world = 1, 2
    steps = session.steps(3)
    for step in steps:
        with session.step(step):
            if step < 2:  # not before the last step committed
                assert not store.check(["recovery/e2/done/r1"])
    assert store.check(["recovery/e2/done/r1"])


def test_a_session_left_early_marks_nothing() -> None:
    store = dist.HashStore()
    session = Session(None, _state())
    session.pg = SimpleNamespace(store=store, epoch=0, joining=False, members=(0, 1))
    session._world = 2
    for step in session.steps(3):
        with session.step(step):
            pass
        break
    assert not store.check(["recovery/e0/done/r0"])


def test_a_replacement_that_finds_the_job_finished_exits_0(
    emitted: list[tuple[str, dict[str, Any]]],
) -> None:
    def admission() -> None:
        raise JobFinished("rank 1 (epoch 0): every other member finished the job and left")

    session = Session(None, _state())
    session.pg = SimpleNamespace(
        store=dist.HashStore(), engine=None, incarnation=1, join_members=lambda: None
    )
    session._rank = 1
    session._admission = admission  # type: ignore[assignment,method-assign]
    with pytest.raises(SystemExit) as exit_:
        session._join()
    assert exit_.value.code == 0
    assert [k for k, _ in emitted] == ["recovery.job_finished"]
    assert "finished the job" in emitted[0][1]["reason"]
