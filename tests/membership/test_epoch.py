"""The job's one epoch (membership.epoch): compare-and-swap with its history record,
in one etcd transaction on a real etcd, and on torch's own stores."""

from __future__ import annotations

import json
import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from membership.epoch import (
    EPOCH_KEY,
    advance_epoch,
    current_epoch,
    epoch_history,
    epoch_record,
    history_key,
)
from membership.etcd_client import EtcdClient
from membership.store import EtcdStore
from resilient.config import EtcdConfig

pytestmark = pytest.mark.timeout(60)


def test_the_epoch_moves_with_its_record_in_etcd(
    etcd_store: EtcdStore, etcd_config: EtcdConfig, job_name: str
) -> None:
    assert current_epoch(etcd_store) == 0 and epoch_history(etcd_store) == []
    assert advance_epoch(etcd_store, 0, {"members": [0, 1], "rank": 1}) == 1
    assert advance_epoch(etcd_store, 1, {"members": [0, 1, 2], "rank": 0}) == 2
    assert current_epoch(etcd_store) == 2
    assert [(r["epoch"], r["members"]) for r in epoch_history(etcd_store)] == [
        (1, [0, 1]),
        (2, [0, 1, 2]),
    ]
    # Where it lives in etcd: the store's prefix, keys ``epoch`` and ``epochs/<n>``;
    # the counter and the record were written by the same transaction.
    client = EtcdClient(etcd_config)
    try:
        counter = client.get(etcd_store.prefix + EPOCH_KEY)
        record = client.get(etcd_store.prefix + history_key(2))
    finally:
        client.close()
    assert counter is not None and record is not None
    assert counter.value == b"2" and json.loads(record.value)["epoch"] == 2
    assert counter.mod_revision == record.mod_revision


def test_a_stale_swap_moves_nothing_and_writes_no_record(etcd_store: EtcdStore) -> None:
    assert advance_epoch(etcd_store, 0, {"rank": 0}) == 1
    assert advance_epoch(etcd_store, 0, {"rank": 1}) == 1  # another rank won: same result
    assert advance_epoch(etcd_store, 5, {"rank": 1}) == 1  # stale: the caller raises
    assert current_epoch(etcd_store) == 1
    assert epoch_record(etcd_store, 6) is None
    rec = epoch_record(etcd_store, 1)
    assert rec is not None and rec["rank"] == 0  # the winner's record stands


def test_ranks_racing_on_etcd_move_the_epoch_once_per_round(etcd_store: EtcdStore) -> None:
    rounds, ranks = 10, 3
    for n in range(rounds):
        barrier = threading.Barrier(ranks)
        seen: list[int] = []

        def race(
            rank: int, n: int = n, barrier: threading.Barrier = barrier, seen: list[int] = seen
        ) -> None:
            barrier.wait(5)
            seen.append(advance_epoch(etcd_store, n, {"rank": rank}))

        threads = [threading.Thread(target=race, args=(r,)) for r in range(ranks)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(10)
        assert seen == [n + 1] * ranks
    history = epoch_history(etcd_store)
    assert [r["epoch"] for r in history] == list(range(1, rounds + 1))
    assert sum(1 for k in etcd_store.list_keys() if k.startswith("epochs/")) == rounds


def test_on_a_tcp_store_the_record_follows_the_swap() -> None:
    from resilient.procs import free_port

    store = dist.TCPStore("127.0.0.1", free_port(), 1, True, timeout=timedelta(seconds=10))
    assert advance_epoch(store, 0, {"rank": 0, "members": [0, 1]}) == 1
    assert advance_epoch(store, 0, {"rank": 1, "members": [0, 1]}) == 1
    assert advance_epoch(store, 3, {"rank": 1}) == 1
    assert [(r["epoch"], r["rank"]) for r in epoch_history(store)] == [(1, 0)]


def test_a_prefixed_hash_store_works_too() -> None:
    store = dist.PrefixStore("job/", dist.HashStore())
    assert current_epoch(store) == 0
    assert advance_epoch(store, 0, {"rank": 0}) == 1
    assert current_epoch(store) == 1 and epoch_record(store, 1) is not None
