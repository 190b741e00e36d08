"""A rank with no part in a state transfer waits for the receivers to load it
before it replays the step (real etcd store; recovery.restore's wait)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from recovery.agree import Plan
from recovery.restore import await_restored, restored_key
from resilient.errors import PeerLost

pytestmark = pytest.mark.timeout(30)


def _plan(receivers: tuple[int, ...]) -> Plan:
    return Plan(
        epoch=3, members=(0, 1, 2, 3), step=14, donor=0, receivers=receivers,
        donors={r: 0 for r in receivers}, joined=receivers, keep_data={}, keep_ctl={},
    )  # fmt: skip


def _pg(store: Any) -> Any:
    """Rank 1's group with only what the wait reads."""
    return SimpleNamespace(store=store, lost=None)


def _later(delay_s: float, fn: Any) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(delay_s), fn()), daemon=True)
    t.start()
    return t


def test_it_replays_once_every_receiver_restored(etcd_store: Any) -> None:
    pg, plan = _pg(etcd_store), _plan((2, 3))
    _later(0.3, lambda: etcd_store.set(restored_key(3, 2), "1"))
    _later(0.6, lambda: etcd_store.set(restored_key(3, 3), "1"))
    began = time.monotonic()
    await_restored(pg, plan, 1, 20.0)
    took = time.monotonic() - began
    assert 0.55 < took < 5.0, took  # the second receiver's word, not before


def test_a_key_of_another_epoch_does_not_count(etcd_store: Any) -> None:
    etcd_store.set(restored_key(2, 2), "1")  # the last recovery's
    began = time.monotonic()
    await_restored(_pg(etcd_store), _plan((2,)), 1, 0.5)
    assert time.monotonic() - began >= 0.5  # waited to its bound


def test_a_loss_ends_the_wait(etcd_store: Any) -> None:
    pg = _pg(etcd_store)
    lost = PeerLost("rank 2 gone", peer=2, epoch=3)
    _later(0.3, lambda: setattr(pg, "lost", lost))
    began = time.monotonic()
    await_restored(pg, _plan((2,)), 1, 20.0)
    assert time.monotonic() - began < 5.0
