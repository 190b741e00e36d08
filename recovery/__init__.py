"""Recovery: the step API (commit, replay, state restore from a live peer), the
agreement on the next epoch after a rank is lost, and the event log.

:mod:`resilient.events` writes and reads the recovery event log (JSON lines per
writer under ``RUN_DIR/events/``); docs/EVENTS.md describes it.
:mod:`recovery.session` holds :class:`Session` and :class:`TrainState` (importing
it imports torch); :mod:`recovery.agree` the epoch agreement;
:mod:`recovery.policy` picks a remedy by estimated cost and logs why;
:mod:`recovery.shards` deals the data of ranks that left over the members.
"""

from typing import Any

from recovery.policy import Choice, Policy
from recovery.shards import Piece
from resilient.events import EVENT_KINDS, SCHEMA_VERSION, EventLog, read_events

__all__ = [
    "EVENT_KINDS",
    "SCHEMA_VERSION",
    "Choice",
    "EventLog",
    "Piece",
    "Policy",
    "Rollback",
    "Session",
    "StateHook",
    "TrainState",
    "read_events",
]

_LAZY = {"Rollback", "Session", "StateHook", "TrainState"}


def __getattr__(name: str) -> Any:
    # Lazy: the events CLI must not import torch.
    if name in _LAZY:
        from recovery import session

        return getattr(session, name)
    raise AttributeError(f"module 'recovery' has no attribute {name!r}")
