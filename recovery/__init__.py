"""Recovery: the event log now; policy, state restore and step replay to come.

:mod:`recovery.events` writes and reads the recovery event log (JSON lines per
writer under ``RUN_DIR/events/``); docs/EVENTS.md describes it.
"""

from recovery.events import EVENT_KINDS, SCHEMA_VERSION, EventLog, read_events

__all__ = ["EVENT_KINDS", "SCHEMA_VERSION", "EventLog", "read_events"]
