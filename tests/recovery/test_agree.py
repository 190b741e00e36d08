"""The epoch agreement after a lost rank: pure plan logic, and the store protocol on
a real TCPStore."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch.distributed as dist

from recovery.agree import EPOCH_KEY, Record, agree, current_epoch, make_plan
from resilient._proc import free_port
from resilient.errors import RecoveryError, StaleEpoch

pytestmark = pytest.mark.timeout(30)


def _records() -> dict[int, Record]:
    # Rank 2 was replaced (no links, step -1). Ranks 0 and 1 hold rail 0 and 1
    # links to each other: rail 0 matches, rail 1 has a send rank 1 never received.
    return {
        0: Record(rank=0, incarnation=0, step=9, data=[(1, 0, 5, 5, 0), (1, 1, 6, 4, 0)]),
        1: Record(rank=1, incarnation=0, step=8, data=[(0, 0, 5, 5, 0), (0, 1, 4, 5, 1)]),
        2: Record(rank=2, incarnation=1, step=-1, data=[], ctl=[]),
    }


def test_the_plan_keeps_only_links_idle_and_matched_at_both_ends() -> None:
    plan = make_plan(3, _records())
    assert plan.epoch == 4
    assert plan.keep_data == {0: [(1, 0)], 1: [(0, 0)], 2: []}


def test_the_rank_furthest_ahead_donates_to_every_rank_behind_it() -> None:
    plan = make_plan(0, _records())
    assert (plan.step, plan.donor) == (9, 0)
    assert plan.receivers == (1, 2)
    assert plan.joined == (2,)


def test_a_rank_whose_control_thread_did_not_stop_keeps_no_control_link() -> None:
    recs = _records()
    recs[0] = Record(rank=0, incarnation=0, step=9, data=[], ctl=None)
    recs[1] = Record(rank=1, incarnation=0, step=9, data=[], ctl=[(0, 0, 1, 1, 0)])
    plan = make_plan(0, recs)
    assert plan.keep_ctl[0] is None
    assert plan.keep_ctl[1] == []


def test_no_committed_state_anywhere_is_an_error() -> None:
    recs = {r: Record(rank=r, incarnation=1, step=-1) for r in range(2)}
    with pytest.raises(RecoveryError):
        make_plan(0, recs)


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=10))


def test_agree_moves_the_epoch_once_all_records_are_in() -> None:
    store = _store()
    store.set("recovery/e0/r1", _records()[1].to_json())
    plan = agree(store, epoch=0, world=2, record=_records()[0], timeout_s=5)
    assert plan.epoch == 1 and current_epoch(store) == 1
    # A second rank agreeing on the same records finds the counter moved already.
    assert agree(store, epoch=0, world=2, record=_records()[0], timeout_s=5) == plan


def test_agree_names_the_ranks_that_never_reported() -> None:
    store = _store()
    with pytest.raises(RecoveryError, match=r"\[1\]"):
        agree(store, epoch=0, world=2, record=_records()[0], timeout_s=0.3)


def test_agree_refuses_an_epoch_the_job_has_left() -> None:
    store = _store()
    store.set(EPOCH_KEY, "5")
    store.set("recovery/e2/r1", _records()[1].to_json())
    with pytest.raises(StaleEpoch):
        agree(store, epoch=2, world=2, record=_records()[0], timeout_s=5)
