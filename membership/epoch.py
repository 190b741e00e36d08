"""The job's epoch: one counter, in the job's store, moved only by compare-and-swap.

The epoch numbers the job's membership views: 0 when the job starts, one more each
time recovery decides who goes on (a replacement admitted, a lost rank left out,
a rank taken back in). Every event carries it and the data plane salts its
message tags with it. There is exactly one such counter per run of a job:

* it lives in the store the job's links rendezvous through: with ``RESILIENT_ETCD``
  that is an :class:`~membership.store.EtcdStore` under
  ``/resilient/<job>/store/run-<run id>/g0/`` (``resilient run``'s RESILIENT_RUN_ID)
  or, without a run id, ``/resilient/<job>/store/links-<nonce>/`` (the nonce agreed
  through torch's init store); either is new per run, so a second run under the
  same job name starts again at 0. The counter is the key
  ``epoch`` there and the history record of epoch ``n`` is ``epochs/<n>``
  (twelve digits). Without etcd it is the store torch gave the group (a TCPStore),
  under the same two names.
* only :func:`recovery.agree.agree` moves it, through :func:`advance_epoch`: once
  the ranks of the next epoch are decided, every rank of it tries the same swap
  ``n -> n + 1``; the first wins, the others find ``n + 1`` already there.
  Through etcd the swap and the history record are one transaction; elsewhere the
  record follows the swap (the first writer's stands).

Reading it (:func:`current_epoch`, :func:`epoch_history`) needs only the store. The
data plane never reads it to move bytes (a process group keeps the epoch it entered
in memory): only recovery, which needs the store anyway, reads and moves it.
"""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any, Final

from torch._C._distributed_c10d import Store

from membership.store import EtcdStore

__all__ = [
    "EPOCH_KEY",
    "HISTORY_PREFIX",
    "advance_epoch",
    "current_epoch",
    "epoch_history",
    "epoch_record",
    "history_key",
]

EPOCH_KEY: Final = "epoch"
HISTORY_PREFIX: Final = "epochs/"


def history_key(epoch: int) -> str:
    """The store key of epoch ``epoch``'s history record (zero-padded: lists in order)."""
    return f"{HISTORY_PREFIX}{epoch:012d}"


def current_epoch(store: Store) -> int:
    """The job's epoch as ``store`` holds it (0 before the first move)."""
    if not store.check([EPOCH_KEY]):
        return 0
    return int(bytes(store.get(EPOCH_KEY)).decode() or 0)


def advance_epoch(store: Store, epoch: int, record: Mapping[str, Any]) -> int:
    """Move the epoch from ``epoch`` to ``epoch + 1`` by compare-and-swap, writing
    ``record`` (with ``epoch`` and ``ts`` added) as the new epoch's history record.

    Returns the epoch after the call: ``epoch + 1`` when it moved, by this call or
    by another rank's identical one; anything else means ``epoch`` is stale (the
    caller decides what that means; :func:`recovery.agree.agree` raises StaleEpoch).
    """
    new = epoch + 1
    expected = "" if epoch == 0 else str(epoch)
    blob = json.dumps({**record, "epoch": new, "ts": time.time()}, sort_keys=True)
    if isinstance(store, EtcdStore):
        # One etcd transaction: the counter never moves without its record.
        now = store.compare_set(EPOCH_KEY, expected, str(new), also={history_key(new): blob})
    else:
        now = store.compare_set(EPOCH_KEY, expected, str(new))
        if bytes(now).decode() == str(new):
            store.compare_set(history_key(new), "", blob)  # the first writer's stands
    return int(bytes(now).decode() or 0)


def epoch_record(store: Store, epoch: int) -> dict[str, Any] | None:
    """What was recorded when ``epoch`` began (members, joined, step, who, when), if any."""
    key = history_key(epoch)
    if not store.check([key]):
        return None
    loaded: dict[str, Any] = json.loads(bytes(store.get(key)).decode())
    return loaded


def epoch_history(store: Store) -> list[dict[str, Any]]:
    """The history records of epochs 1 .. current, oldest first (missing ones skipped)."""
    out = []
    for n in range(1, current_epoch(store) + 1):
        rec = epoch_record(store, n)
        if rec is not None:
            out.append(rec)
    return out
