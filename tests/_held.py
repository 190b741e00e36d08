"""A real store whose first write of some keys is held back, for publish races."""

from __future__ import annotations

import threading
from typing import Any


class HeldStore:
    """Wraps a real store. The first write of a key containing ``match`` waits
    until a second such write is tried (which then goes first) or ``hold_s``
    passed: a thread preempted between reading what it publishes and storing it,
    as on a busy core. Everything else goes straight through."""

    def __init__(self, store: Any, match: str, hold_s: float) -> None:
        self._store, self._match, self._hold_s = store, match, hold_s
        self.first_in, self._second = threading.Event(), threading.Event()

    def set(self, key: str, value: Any) -> None:
        if self._match in key and not self.first_in.is_set():
            self.first_in.set()
            self._second.wait(self._hold_s)
        elif self._match in key:
            self._store.set(key, value)
            self._second.set()
            return
        self._store.set(key, value)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._store, name)
