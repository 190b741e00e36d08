"""DDP over "resilient" when a peer is SIGKILLed in the middle of a backward pass.

Survivors must get an exception from ``backward()`` (DDP's reducer reads the failed
collective's future from C++), not die: a future failed with
``Future.set_exception`` used to crash them with SIGSEGV.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import time
from datetime import timedelta
from typing import Any

import pytest

from resilient.procs import free_port

WORLD = 3
VICTIM = 2
KILL_AT_STEP = 4


def _rank_main(rank: int, port: int, results: Any) -> None:
    import torch
    import torch.distributed as dist
    from torch import nn

    import resilient

    os.environ["RESILIENT_RAILS"] = f"127.0.1.{rank + 1}"
    os.environ["RESILIENT_OP_TIMEOUT_S"] = "3"
    resilient.register()
    torch.set_num_threads(1)
    store = dist.TCPStore("127.0.0.1", port, WORLD, rank == 0, timeout=timedelta(seconds=60))
    dist.init_process_group("resilient", store=store, rank=rank, world_size=WORLD)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(256, 256), nn.ReLU(), nn.Linear(256, 8))
    ddp = nn.parallel.DistributedDataParallel(model)
    at = {"step": 0}

    def die_in_backward(grad: torch.Tensor) -> torch.Tensor:
        # Other ranks are inside backward too: their bucket all_reduce meets a dead peer.
        if rank == VICTIM and at["step"] == KILL_AT_STEP:
            os.kill(os.getpid(), signal.SIGKILL)
        return grad

    model[0].weight.register_hook(die_in_backward)
    try:
        for step in range(50):
            at["step"] = step
            x = torch.randn(16, 256)
            ddp(x).square().mean().backward()
        results.put((rank, "no error"))
    except Exception as exc:  # the survivor's view of the lost peer
        results.put((rank, type(exc).__name__))


@pytest.mark.timeout(120)
def test_survivors_get_an_exception_from_backward_not_a_crash() -> None:
    ctx = mp.get_context("spawn")
    results: Any = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, results)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        seen: dict[int, str] = {}
        deadline = time.monotonic() + 60
        while len(seen) < WORLD - 1 and time.monotonic() < deadline:
            try:
                rank, outcome = results.get(timeout=0.5)
            except queue.Empty:
                # A survivor that crashed reports nothing: stop waiting once all are gone.
                if not any(p.is_alive() for r, p in enumerate(procs) if r != VICTIM):
                    break
                continue
            seen[rank] = outcome
        for p in procs:
            p.join(timeout=30)
        codes = {r: p.exitcode for r, p in enumerate(procs)}
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    assert codes[VICTIM] == -signal.SIGKILL
    for rank in range(WORLD):
        if rank == VICTIM:
            continue
        assert codes[rank] == 0, f"rank {rank} died with {codes[rank]} (expected an exception)"
        assert seen.get(rank) not in (None, "no error"), seen
