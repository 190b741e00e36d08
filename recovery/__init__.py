"""Recovery: the step API (commit, replay, state restore from a live peer), the
agreement on the next epoch after a rank is lost, and the event log.

:mod:`resilient.events` writes and reads the recovery event log (JSON lines per
writer under ``RUN_DIR/events/``); docs/EVENTS.md describes it.
:mod:`recovery.session` holds :class:`Session` and :class:`TrainState` (importing
it imports torch); :mod:`recovery.agree` the epoch agreement;
:mod:`recovery.policy` picks a remedy by estimated cost and logs why;
:mod:`recovery.shards` deals the data of ranks that left over the members;
:mod:`recovery.checkpoints` keeps DCP checkpoints and the :class:`Rollback` to them.
"""

from typing import Any

from recovery.policy import Choice, Policy
from recovery.shards import Piece
from resilient.events import EVENT_KINDS, SCHEMA_VERSION, EventLog, read_events

__all__ = [
    "EVENT_KINDS",
    "SCHEMA_VERSION",
    "Choice",
    "DcpCheckpoints",
    "EventLog",
    "ModelOptimizer",
    "Piece",
    "Policy",
    "Rollback",
    "Session",
    "StateHook",
    "TrainState",
    "read_events",
]

# Lazy: the events CLI must not import torch. Name -> the module that holds it.
_LAZY = {
    "DcpCheckpoints": "recovery.checkpoints",
    "ModelOptimizer": "recovery.checkpoints",
    "Rollback": "recovery.session",
    "Session": "recovery.session",
    "StateHook": "recovery.session",
    "TrainState": "recovery.session",
}


def __getattr__(name: str) -> Any:
    if name in _LAZY:
        import importlib

        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'recovery' has no attribute {name!r}")
