"""Doorbells and the health board on real stores: a TCPStore server and a real etcd.

The board used to poll its counter every 5 ms; through etcd each poll was a write.
These tests check that a peer's report still arrives within a bound, that closing
wakes a blocked watcher, and that an idle board writes nothing to etcd.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from datetime import timedelta

import pytest
import torch.distributed as dist

from membership.store import EtcdStore
from resilient.detect.doorbell import PollBell, QueueBell, WatchBell, open_bell
from resilient.detect.health_board import HealthBoard

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def tcp_store() -> Iterator[dist.TCPStore]:
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10))
    yield server


def _waiter(bell: object, timeout_s: float | None) -> tuple[threading.Thread, list[float]]:
    """Start a thread blocked in ``bell.wait``; the list gets the seconds it waited."""
    took: list[float] = []

    def run() -> None:
        start = time.monotonic()
        bell.wait(timeout_s)  # type: ignore[attr-defined]
        took.append(time.monotonic() - start)

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    return thread, took


@pytest.mark.parametrize("prefixed", [False, True])
def test_a_queue_bell_wakes_the_rung_rank_only(tcp_store: dist.TCPStore, prefixed: bool) -> None:
    store = dist.PrefixStore("job", tcp_store) if prefixed else tcp_store
    bells = [open_bell(store, "health/e0", r, poll_s=0.005) for r in range(3)]
    assert all(isinstance(b, QueueBell) for b in bells)
    t1, took1 = _waiter(bells[1], None)
    t2, took2 = _waiter(bells[2], None)
    time.sleep(0.3)
    bells[0].ring([1])
    t1.join(5.0)
    assert took1 and took1[0] < 5.0
    assert not took2, "rank 2 was not rung"
    bells[2].close()  # closing wakes its own watcher
    t2.join(5.0)
    assert took2
    for b in bells[:2]:
        b.close()


def test_rings_that_came_together_cost_one_look(tcp_store: dist.TCPStore) -> None:
    a, b = (open_bell(tcp_store, "h", r, poll_s=0.005) for r in range(2))
    for _ in range(5):
        a.ring([1])
    b.wait(None)  # drains all five
    t, took = _waiter(b, None)
    time.sleep(0.3)
    assert not took, "the drained rings woke the watcher again"
    b.close()
    t.join(5.0)
    assert took
    a.close()


def test_an_etcd_watch_bell_wakes_on_a_put_under_its_prefix(etcd_store: EtcdStore) -> None:
    bell = open_bell(etcd_store, "health/e0", 0, poll_s=0.005)
    assert isinstance(bell, WatchBell)
    try:
        t, took = _waiter(bell, 30.0)
        time.sleep(0.3)
        etcd_store.set("elsewhere/x", "1")  # outside the prefix: no ring
        time.sleep(0.3)
        assert not took
        etcd_store.set("health/e0/r1", "{}")
        t.join(10.0)
        assert took and took[0] < 10.0
    finally:
        bell.close()


def test_a_store_without_notification_is_polled() -> None:
    assert isinstance(open_bell(dist.HashStore(), "h", 0, poll_s=0.01), PollBell)


def _boards(store: dist.Store) -> list[HealthBoard]:
    return [HealthBoard(rank=r, world=2, store=store, epoch=7).start() for r in range(2)]


@pytest.mark.parametrize("kind", ["tcp", "etcd"])
def test_a_peer_learns_of_a_dead_nic_from_the_board(
    kind: str, tcp_store: dist.TCPStore, etcd_store: EtcdStore
) -> None:
    store = tcp_store if kind == "tcp" else etcd_store
    boards = _boards(store)
    try:
        time.sleep(0.2)
        assert boards[1].nic_up_both(0, 1)
        start = time.monotonic()
        boards[0].nic_changed(1, False)
        while boards[1].nic_up_both(0, 1) and time.monotonic() - start < 5.0:
            time.sleep(0.002)
        assert not boards[1].nic_up_both(0, 1), "rank 1 never saw rank 0's NIC down"
        boards[0].nic_changed(1, True)
        while not boards[1].nic_up_both(0, 1) and time.monotonic() - start < 10.0:
            time.sleep(0.002)
        assert boards[1].nic_up_both(0, 1), "rank 1 never saw rank 0's NIC back"
    finally:
        for b in boards:
            b.stop()


def test_an_idle_board_writes_nothing_to_etcd(etcd_store: EtcdStore) -> None:
    boards = _boards(etcd_store)
    try:
        boards[0].publish()
        time.sleep(0.5)
        client = etcd_store.client()
        _, before = client.get_prefix(etcd_store.prefix)
        time.sleep(1.0)
        _, after = client.get_prefix(etcd_store.prefix)
        assert after == before, f"{after - before} etcd writes in 1 s of an idle board"
    finally:
        for b in boards:
            b.stop()


def test_stopping_a_board_ends_its_watcher_at_once(tcp_store: dist.TCPStore) -> None:
    boards = _boards(tcp_store)
    start = time.monotonic()
    for b in boards:
        b.stop()
    assert time.monotonic() - start < 2.0
    threads = [b._thread for b in boards]
    assert all(t is not None and not t.is_alive() for t in threads)


def test_under_a_prefix_store_the_etcd_watch_covers_the_whole_store(
    etcd_store: EtcdStore,
) -> None:
    wrapped = dist.PrefixStore("job", etcd_store)
    bell = open_bell(wrapped, "health/e0", 0, poll_s=0.005)
    assert isinstance(bell, WatchBell)
    try:
        t, took = _waiter(bell, 30.0)
        time.sleep(0.3)
        wrapped.set("health/e0/r1", "{}")
        t.join(10.0)
        assert took and took[0] < 10.0
    finally:
        bell.close()
