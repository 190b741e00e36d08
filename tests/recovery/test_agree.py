"""The epoch agreement after a lost rank: pure plan logic, and the store protocol on
a real TCPStore and a real etcd."""

from __future__ import annotations

import json
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from membership.epoch import EPOCH_KEY, current_epoch, epoch_history, epoch_record
from membership.etcd_client import EtcdClient
from membership.store import EtcdStore
from recovery.agree import (
    NO_STATE,
    Record,
    agree,
    join_requested,
    make_plan,
    request_join,
)
from resilient.config import EtcdConfig
from resilient.errors import RecoveryError, StaleEpoch
from resilient.procs import free_port

pytestmark = pytest.mark.timeout(30)


def _records() -> dict[int, Record]:
    # Rank 2 was replaced (no links, no state). Ranks 0 and 1 hold rail 0, 1 and 2
    # links to each other: rail 0 is idle; on rail 1 rank 0 sent one message rank 1
    # never received and rank 1 is blocked on a receive; on rail 2 rank 0 sent one
    # message rank 1 never received, and nobody waits.
    return {
        0: Record(rank=0, incarnation=0, step=9,
                  data=[(1, 0, 5, 5, 0, 0), (1, 1, 6, 4, 0, 0), (1, 2, 7, 7, 0, 1 << 3)]),
        1: Record(rank=1, incarnation=0, step=8,
                  data=[(0, 0, 5, 5, 0, 0), (0, 1, 4, 5, 1, 0), (0, 2, 7, 6, 0, 0)]),
        2: Record(rank=2, incarnation=1, step=NO_STATE, data=[], ctl=[]),
    }  # fmt: skip


def test_the_plan_keeps_links_held_at_both_ends_that_nobody_is_blocked_on() -> None:
    # Leftovers of the given-up call (rail 2) do not matter: the tags of the next
    # epoch are salted differently. A thread blocked on an op (rail 1) would close
    # the pair at its deadline.
    plan = make_plan(3, _records())
    assert plan.epoch == 4
    assert plan.keep_data == {0: [(1, 0), (1, 2)], 1: [(0, 0), (0, 2)], 2: []}


def test_a_rank_holding_shards_is_served_by_a_replica_of_them() -> None:
    # HSDP 2 x 2: ranks 0 and 2 hold shard column 0, ranks 1 and 3 column 1. Rank 0
    # is best placed (most rails up) but holds the other shards: rank 1 serves 3.
    col = {0: "[[0]]", 1: "[[1]]", 2: "[[0]]", 3: "[[1]]"}
    recs = {
        r: Record(rank=r, incarnation=0, step=5, rails_up=2 if r == 0 else 1, replica=col[r])
        for r in (0, 1, 2)
    }
    recs[3] = Record(rank=3, incarnation=1, step=NO_STATE, replica=col[3])
    plan = make_plan(0, recs)
    assert plan.donor == 0 and dict(plan.donors) == {3: 1}
    # Through the store as JSON, the key survives.
    assert Record.from_json(recs[3].to_json()).replica == "[[1]]"


def test_a_rank_whose_every_replica_was_lost_is_a_recovery_error() -> None:
    recs = {
        0: Record(rank=0, incarnation=0, step=5, replica="[[0]]"),
        1: Record(rank=1, incarnation=1, step=NO_STATE, replica="[[1]]"),
        3: Record(rank=3, incarnation=1, step=NO_STATE, replica="[[1]]"),
    }
    with pytest.raises(RecoveryError, match=r"no rank ahead holds the shards of rank 1"):
        make_plan(0, recs)


def test_a_rollback_plan_names_no_donors_and_no_receivers() -> None:
    # Every rank goes back to a checkpoint: no state is sent, so no donor is picked,
    # not even where picking one would fail (no rank ahead holds rank 1's shards).
    recs = {
        0: Record(rank=0, incarnation=0, step=5, replica="[[0]]"),
        1: Record(rank=1, incarnation=1, step=NO_STATE, replica="[[1]]"),
        2: Record(rank=2, incarnation=0, step=4, replica="[[0]]"),
    }
    plan = make_plan(0, recs, rollback=True)
    assert (plan.donors, plan.receivers) == ({}, ())
    assert (plan.epoch, plan.members, plan.step, plan.joined) == (1, (0, 1, 2), 5, (1,))
    # Otherwise the same plan as a restore from a peer makes.
    usual = make_plan(3, _records())
    rolled = make_plan(3, _records(), rollback=True)
    assert rolled.keep_data == usual.keep_data and rolled.keep_ctl == usual.keep_ctl
    assert rolled.donor == usual.donor


def test_a_link_with_leftovers_under_the_next_epochs_salt_is_not_kept() -> None:
    # Rank 0's rail-2 link has ops pending from an epoch with salt 3, which epoch
    # 19 (19 % 16 == 3) would use again.
    plan = make_plan(18, _records())
    assert plan.keep_data == {0: [(1, 0)], 1: [(0, 0)], 2: []}


def test_records_of_the_old_format_read_as_clean() -> None:
    old = json.dumps({"rank": 1, "incarnation": 0, "step": 8, "data": [[0, 0, 5, 5, 0]]})
    assert Record.from_json(old).data == [(0, 0, 5, 5, 0, 0)]


def test_the_rank_furthest_ahead_donates_to_every_rank_behind_it() -> None:
    plan = make_plan(0, _records())
    assert (plan.step, plan.donor) == (9, 0)
    assert plan.receivers == (1, 2)
    assert plan.joined == (2,)


def test_a_rank_whose_control_thread_did_not_stop_keeps_no_control_link() -> None:
    recs = _records()
    recs[0] = Record(rank=0, incarnation=0, step=9, data=[], ctl=None)
    recs[1] = Record(rank=1, incarnation=0, step=9, data=[], ctl=[(0, 0, 1, 1, 0, 0)])
    plan = make_plan(0, recs)
    assert plan.keep_ctl[0] is None
    assert plan.keep_ctl[1] == []


def test_no_state_anywhere_is_an_error() -> None:
    recs = {r: Record(rank=r, incarnation=1, step=NO_STATE) for r in range(2)}
    with pytest.raises(RecoveryError):
        make_plan(0, recs)


def test_a_loss_before_the_first_commit_restores_the_starting_state() -> None:
    # Rank 1 was lost in step 0: the survivors hold the state training started
    # from (step -1), and the replacement receives it; training resumes at step 0.
    recs = {
        0: Record(rank=0, incarnation=0, step=-1),
        1: Record(rank=1, incarnation=1, step=NO_STATE),
        2: Record(rank=2, incarnation=0, step=-1),
    }
    plan = make_plan(0, recs)
    assert (plan.step, plan.donor, plan.receivers, plan.joined) == (-1, 0, (1,), (1,))


def _store() -> dist.TCPStore:
    return dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=10))


def test_agree_moves_the_epoch_once_all_records_are_in() -> None:
    store = _store()
    store.set("recovery/e0/r1", _records()[1].to_json())
    plan = agree(store, epoch=0, world=2, record=_records()[0], timeout_s=5)
    assert plan.epoch == 1 and current_epoch(store) == 1
    # A second rank agreeing on the same records finds the counter moved already.
    assert agree(store, epoch=0, world=2, record=_records()[0], timeout_s=5) == plan
    assert [(r["epoch"], r["from"], r["members"]) for r in epoch_history(store)] == [(1, 0, [0, 1])]


def test_agree_passes_a_rollback_on_to_the_plan_and_its_history() -> None:
    store = _store()
    store.set("recovery/e0/r1", _records()[1].to_json())
    plan = agree(store, epoch=0, world=2, record=_records()[0], timeout_s=5, rollback=True)
    assert (plan.donors, plan.receivers) == ({}, ())
    assert epoch_record(store, 1)["donors"] == {}  # type: ignore[index]


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


def test_after_shrink_after_s_the_ranks_that_reported_go_on_alone() -> None:
    store = _store()
    recs = _records()
    store.set("recovery/e0/r1", recs[1].to_json())
    plan = agree(store, epoch=0, world=3, record=recs[0], timeout_s=5, shrink_after_s=0.2)
    assert plan.members == (0, 1)
    assert set(plan.keep_data) == {0, 1}
    # The decision stands for everyone: rank 2 reporting late is left out of it.
    store.set("recovery/e0/r2", recs[2].to_json())
    assert agree(store, epoch=0, world=3, record=recs[1], timeout_s=5).members == (0, 1)
    with pytest.raises(RecoveryError, match="without it"):
        agree(store, epoch=0, world=3, record=recs[2], timeout_s=5, decide=False)


def test_too_few_ranks_for_min_ranks_wait_until_the_timeout() -> None:
    store = _store()
    with pytest.raises(RecoveryError, match="min_ranks=2"):
        agree(store, epoch=0, world=3, record=_records()[0], timeout_s=0.5,
              shrink_after_s=0.1, min_ranks=2)  # fmt: skip


def test_give_up_skips_the_wait_only_once_every_other_rank_reported() -> None:
    store = _store()
    recs = _records()
    asked: list[float] = []

    def give_up() -> set[int]:
        asked.append(0.0)
        if len(asked) == 3:  # rank 1 reports while rank 0 already gave up on rank 2
            store.set("recovery/e0/r1", recs[1].to_json())
        return {2}

    plan = agree(store, epoch=0, world=3, record=recs[0], timeout_s=5, give_up=give_up)
    assert plan.members == (0, 1) and len(asked) >= 3


def test_a_join_request_is_seen_and_a_grown_epoch_takes_every_record_present() -> None:
    store = _store()
    recs = _records()
    assert not join_requested(store, 0)
    store.set("recovery/e0/r2", recs[2].to_json())
    request_join(store, 0, 2)
    assert join_requested(store, 0)
    store.set("recovery/e0/r1", recs[1].to_json())
    plan = agree(store, epoch=0, world=3, record=recs[0], timeout_s=5, expect=(0, 1))
    assert plan.members == (0, 1, 2) and plan.joined == (2,)


def test_of_the_ranks_furthest_ahead_the_one_with_more_rails_up_then_faster_donates() -> None:
    recs = {
        0: Record(rank=0, incarnation=0, step=9, rails_up=1, rate=9e9),  # a NIC down
        1: Record(rank=1, incarnation=0, step=9, rails_up=2, rate=1e8),
        2: Record(rank=2, incarnation=0, step=9, rails_up=2, rate=2e8),
        3: Record(rank=3, incarnation=1, step=NO_STATE),
    }
    assert make_plan(0, recs).donor == 2
    assert Record.from_json(recs[2].to_json()) == recs[2]
    recs[2] = Record(rank=2, incarnation=0, step=8, rails_up=2, rate=2e8)  # behind
    plan = make_plan(0, recs)
    assert plan.donor == 1 and plan.receivers == (2, 3)
    # Two ranks ahead serve the two behind at once; the replacement gets the best.
    assert plan.donors == {3: 1, 2: 0}


def test_with_one_rank_ahead_it_serves_every_rank_behind() -> None:
    plan = make_plan(0, _records())
    assert plan.donors == {1: 0, 2: 0}


def test_through_etcd_a_record_written_while_waiting_wakes_the_agreement(
    etcd_store: EtcdStore,
) -> None:
    """The waiting loop sleeps on an etcd watch there (resilient.detect.doorbell), not a poll."""
    late = threading.Timer(0.3, etcd_store.set, ("recovery/e0/r1", _records()[1].to_json()))
    late.start()
    try:
        plan = agree(etcd_store, epoch=0, world=2, record=_records()[0], timeout_s=10)
    finally:
        late.cancel()
    assert plan.epoch == 1 and plan.members == (0, 1)
    assert current_epoch(etcd_store) == 1


def test_through_etcd_agreement_moves_the_jobs_one_epoch_with_its_history(
    etcd_store: EtcdStore, etcd_config: EtcdConfig
) -> None:
    """A replacement (rank 2) admitted, then the group shrinking without rank 1: each
    agreement moves the epoch key in etcd once and leaves the record of who went on."""
    recs = _records()
    for r in (1, 2):
        etcd_store.set(f"recovery/e0/r{r}", recs[r].to_json())
    plan = agree(etcd_store, epoch=0, world=3, record=recs[0], timeout_s=10)
    assert (plan.epoch, plan.members, plan.joined) == (1, (0, 1, 2), (2,))
    etcd_store.set("recovery/e1/r2", Record(rank=2, incarnation=1, step=9).to_json())
    plan = agree(etcd_store, epoch=1, world=3, record=Record(rank=0, incarnation=0, step=9),
                 timeout_s=10, give_up=lambda: {1})  # fmt: skip
    assert (plan.epoch, plan.members) == (2, (0, 2))
    client = EtcdClient(etcd_config)
    try:
        kv = client.get(etcd_store.prefix + EPOCH_KEY)
    finally:
        client.close()
    assert kv is not None and kv.value == b"2"  # the key under /resilient/<job>/store/
    first, second = epoch_history(etcd_store)
    assert (first["epoch"], first["members"], first["joined"], first["step"]) == (
        1,
        [0, 1, 2],
        [2],
        9,
    )
    assert first["donors"] == {"1": 0, "2": 0} and first["rank"] == 0
    assert (second["epoch"], second["from"], second["members"]) == (2, 1, [0, 2])
    assert epoch_record(etcd_store, 3) is None


def test_through_etcd_the_shrink_timer_still_runs(etcd_store: EtcdStore) -> None:
    recs = _records()
    etcd_store.set("recovery/e0/r1", recs[1].to_json())
    plan = agree(etcd_store, epoch=0, world=3, record=recs[0], timeout_s=10, shrink_after_s=0.3)
    assert plan.members == (0, 1)
