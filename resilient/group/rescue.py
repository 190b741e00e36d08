"""Finishing a small call that a lost peer left complete on some survivors only.

A signature exchange is an all-gather of one row per rank over the control mesh.
A rank killed in the middle of one may have sent its row to some peers and not to
others: those that got it complete the call (an inline all_reduce, typically a
step's last one: the loss), commit the step and move on; the others fail it, do
not commit, and would have to load the whole training state from a peer before
the replayed step (a second transfer beside the replacement's, on the same CPUs).

Every rank that completed the exchange holds the table that decided it, and every
survivor's table for that call is the same. So each survivor, as it learns of a
loss, publishes the last table it completed under a key of the epoch; a survivor
whose exchange failed waits (bounded) for every other survivor's record and, if
one of them completed that very exchange, finishes the call from that table: the
same bits the others computed. It then commits like them, and only the lost rank
needs a state transfer. Anything else (no record in time, nobody completed it)
leaves the failure as it was: the recovery then restores that rank from a peer.
"""

from __future__ import annotations

import logging
import struct
from collections.abc import Sequence
from datetime import timedelta
from typing import Final

import torch
from torch._C._distributed_c10d import Store

__all__ = ["WAIT_S", "decode", "encode", "fetch", "publish"]

logger = logging.getLogger(__name__)

# How long a rank whose exchange failed waits for the other survivors' records
# (they publish as they learn of the loss, within tens of milliseconds).
WAIT_S: Final = 1.0
_HEAD: Final = struct.Struct("<qqq")  # seq, rows, columns


def _key(epoch: int, pos: int) -> str:
    return f"rescue/e{epoch}/p{pos}"


def encode(seq: int, table: torch.Tensor | None) -> bytes:
    """``seq`` of the last exchange completed and its int64 table (None: none yet)."""
    if table is None:
        return _HEAD.pack(0, 0, 0)
    rows, cols = table.shape
    return _HEAD.pack(seq, rows, cols) + table.contiguous().numpy().tobytes()


def decode(raw: bytes) -> tuple[int, torch.Tensor | None]:
    """Inverse of :func:`encode`.

    Raises:
        ValueError: the record is truncated or its sizes do not add up.
    """
    if len(raw) < _HEAD.size:
        raise ValueError(f"rescue record of {len(raw)} B is shorter than its header")
    seq, rows, cols = _HEAD.unpack_from(raw)
    body = raw[_HEAD.size :]
    if rows == 0:
        return seq, None
    if len(body) != rows * cols * 8:
        raise ValueError(f"rescue record: {len(body)} B for a {rows}x{cols} int64 table")
    table = torch.frombuffer(bytearray(body), dtype=torch.int64).view(rows, cols)
    return seq, table


def publish(store: Store, epoch: int, pos: int, seq: int, table: torch.Tensor | None) -> None:
    """Publish this rank's last completed exchange for ``epoch`` (never raises: a
    survivor that cannot read it only falls back to a state transfer)."""
    try:
        store.set(_key(epoch, pos), encode(seq, table))  # type: ignore[arg-type]  # bytes work
    except Exception as exc:  # the store is the only channel left; nothing to retry
        logger.warning("rank at position %d (epoch %d): publishing its last exchange failed: %s",
                       pos, epoch, exc)  # fmt: skip


def fetch(
    store: Store, epoch: int, others: Sequence[int], seq: int, timeout_s: float = WAIT_S
) -> torch.Tensor | None:
    """The table of exchange ``seq`` if one of ``others`` (positions) completed it.

    Waits up to ``timeout_s`` for all of their records; None when a record is
    missing by then, none of them completed ``seq``, or the store failed.
    """
    keys = [_key(epoch, p) for p in others]
    try:
        store.wait(keys, timedelta(seconds=timeout_s))
        records = [decode(store.get(k)) for k in keys]
    except Exception as exc:  # no rescue; the caller's own error stands
        logger.info("epoch %d: no rescue of exchange %d: %s", epoch, seq, exc)
        return None
    for done, table in records:
        if done == seq and table is not None:
            return table
    return None
