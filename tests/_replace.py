"""A stand-in launcher for the replace-rank tests: start ``world`` worker processes,
start the victim again as incarnation 1 once it died by SIGKILL, collect every
rank's result, reap everything (also when the test fails)."""

from __future__ import annotations

import multiprocessing as mp
import queue
import signal
import time
from collections.abc import Callable, Sequence
from typing import Any

from resilient.procs import free_port

NEVER = -(10**9)  # a kill step that never comes (a replacement's, a clean run's)


def run_with_replacement(
    worker: Callable[..., None],
    *,
    world: int,
    victim: int,
    kill_at: int,
    extra: Sequence[Any] = (),
    timeout_s: float = 200.0,
) -> dict[tuple[int, int], list[Any]]:
    """``(rank, incarnation) -> the rest of what the worker put``.

    ``worker(rank, port, incarnation, kill_at, results, *extra)`` puts one tuple
    ``(rank, incarnation, ...)`` on ``results``; the replacement is called with
    ``kill_at`` :data:`NEVER`. Ranks that reported nothing within ``timeout_s`` are
    missing from the result (the test's assertion names them).
    """
    ctx = mp.get_context("spawn")
    results: Any = ctx.Queue()
    port = free_port()
    procs = {
        r: ctx.Process(target=worker, args=(r, port, 0, kill_at, results, *extra))
        for r in range(world)
    }
    for p in procs.values():
        p.start()
    out: dict[tuple[int, int], list[Any]] = {}
    replacement = None
    try:
        deadline = time.monotonic() + timeout_s
        while len(out) < world and time.monotonic() < deadline:
            if replacement is None and procs[victim].exitcode == -signal.SIGKILL:
                args = (victim, port, 1, NEVER, results, *extra)
                replacement = ctx.Process(target=worker, args=args)
                replacement.start()
            try:
                rank, inc, *rest = results.get(timeout=0.2)
                out[(rank, inc)] = rest
            except queue.Empty:
                continue
        for p in [*procs.values(), replacement]:
            if p is not None:
                p.join(timeout=30)
    finally:
        for p in [*procs.values(), replacement]:
            if p is not None and p.is_alive():
                p.kill()
                p.join(5)
    return out
