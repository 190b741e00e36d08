"""A subgroup's roster: one-rank groups that share a name (torch's counter) meet no
one, so they are made without a claim; larger ones still refuse a mismatch."""

from __future__ import annotations

from datetime import timedelta

import pytest
import torch
from torch._C._distributed_c10d import HashStore

from resilient.backend import create_backend
from resilient.errors import CollectiveMismatch
from resilient.group.roster import agree_roster


def test_one_rank_groups_that_share_a_store_prefix_are_both_made(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # torch's new_subgroups(group_size=1, group=[0, 2] / [1, 3]) at 4 ranks: ranks 2
    # and 3 each make "group k+1", of ranks [2] and [3], under one store prefix.
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    store = HashStore()
    two = create_backend(store, 0, 1, timedelta(seconds=30), job_ranks=(2,))
    three = create_backend(store, 0, 1, timedelta(seconds=30), job_ranks=(3,))
    try:
        assert store.num_keys() == 0
        for group, rank in ((two, 2), (three, 3)):
            assert group.job_ranks == (rank,)
            t = torch.full((4,), float(rank))
            group.allreduce([t]).wait()
            assert torch.equal(t, torch.full((4,), float(rank)))
    finally:
        two.shutdown()
        three.shutdown()


def test_two_rank_groups_under_one_name_still_refuse_each_other() -> None:
    store = HashStore()
    store.set("resilient/roster/0", "0:0,2")  # rank 0's claim of group rank 0 of [0, 2]
    with pytest.raises(CollectiveMismatch, match="claimed by rank 0 in a group of ranks"):
        agree_roster(store, 0, (1, 3), timeout_s=5)
