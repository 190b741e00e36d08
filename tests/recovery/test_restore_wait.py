"""A rank with no part in a state transfer waits for the receivers to load it
before it replays the step (real etcd store; the session's own wait)."""

from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import pytest

from recovery.agree import Plan
from recovery.session import Session, _restored_key
from resilient.config import RecoveryConfig
from resilient.errors import PeerLost

pytestmark = pytest.mark.timeout(30)


def _plan(receivers: tuple[int, ...]) -> Plan:
    return Plan(
        epoch=3, members=(0, 1, 2, 3), step=14, donor=0, receivers=receivers,
        donors={r: 0 for r in receivers}, joined=receivers, keep_data={}, keep_ctl={},
    )  # fmt: skip


def _bystander(store: Any, *, wait_s: float = 20.0) -> Session:
    """Rank 1's session with only what the wait reads."""
    s = Session.__new__(Session)
    s.pg = SimpleNamespace(store=store, lost=None)  # type: ignore[assignment]
    s.config = RecoveryConfig(replace_timeout_s=wait_s)
    s._rank = 1
    return s


def _later(delay_s: float, fn: Any) -> threading.Thread:
    t = threading.Thread(target=lambda: (time.sleep(delay_s), fn()), daemon=True)
    t.start()
    return t


def test_it_replays_once_every_receiver_restored(etcd_store: Any) -> None:
    session, plan = _bystander(etcd_store), _plan((2, 3))
    _later(0.3, lambda: etcd_store.set(_restored_key(3, 2), "1"))
    _later(0.6, lambda: etcd_store.set(_restored_key(3, 3), "1"))
    began = time.monotonic()
    session._await_restored(plan)
    took = time.monotonic() - began
    assert 0.55 < took < 5.0, took  # the second receiver's word, not before


def test_a_key_of_another_epoch_does_not_count(etcd_store: Any) -> None:
    etcd_store.set(_restored_key(2, 2), "1")  # the last recovery's
    session = _bystander(etcd_store, wait_s=0.5)
    began = time.monotonic()
    session._await_restored(_plan((2,)))
    assert time.monotonic() - began >= 0.5  # waited to its bound


def test_a_loss_ends_the_wait(etcd_store: Any) -> None:
    session = _bystander(etcd_store)
    lost = PeerLost("rank 2 gone", peer=2, epoch=3)
    _later(0.3, lambda: setattr(session.pg, "lost", lost))
    began = time.monotonic()
    session._await_restored(_plan((2,)))
    assert time.monotonic() - began < 5.0
