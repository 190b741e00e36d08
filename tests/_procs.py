"""Waiting on processes in tests: whether one is gone, and polling for a condition."""

from __future__ import annotations

import time
from collections.abc import Callable

import psutil


def gone(pid: int) -> bool:
    """Whether process ``pid`` has exited (a zombie nobody reaped yet counts)."""
    try:
        return psutil.Process(pid).status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def wait_until(predicate: Callable[[], bool], timeout_s: float) -> bool:
    """Poll ``predicate`` every 20 ms until it holds (True) or ``timeout_s`` passed."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True
