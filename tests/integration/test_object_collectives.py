"""Object collectives and backend registration through ``init_process_group``.

Each rank imports ``resilient`` *before* torch (the order isort writes), then calls
``dist.init_process_group("resilient")``: the backend must be registered anyway
(torch's ``torch.backends`` entry point calls ``resilient.torch_autoload``). Then
``all_gather_object`` and ``broadcast_object_list`` (uint8 tensors underneath) run
on the group, as long jobs use them for configs and checkpoint metadata.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import subprocess
import sys
import time
from datetime import timedelta
from typing import Any

import pytest

from resilient.procs import free_port

WORLD = 3


def _rank_main(rank: int, port: int, results: Any) -> None:
    try:
        import resilient  # noqa: F401  (before torch, on purpose)

        os.environ["RESILIENT_RAILS"] = f"127.0.1.{rank + 1}"
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, WORLD, rank == 0, timeout=timedelta(seconds=60))
        dist.init_process_group("resilient", store=store, rank=rank, world_size=WORLD)
        try:
            gathered: list[Any] = [None] * WORLD
            mine = {"rank": rank, "name": "r" * (rank * 300 + 1), "shape": (rank, 2)}
            dist.all_gather_object(gathered, mine)
            objs: list[Any] = [None, None]
            if rank == 2:
                objs = [{"config": "lr=0.1", "step": 42}, [1, 2, 3]]
            dist.broadcast_object_list(objs, src=2)
            results.put((rank, "ok", (type(dist.group.WORLD).__name__, gathered, objs)))
        finally:
            dist.destroy_process_group()
    except BaseException as exc:  # reported to the test, which names the rank
        results.put((rank, "error", repr(exc)))


@pytest.mark.timeout(120)
def test_object_collectives_on_a_group_made_after_importing_resilient_first() -> None:
    ctx = mp.get_context("spawn")
    results: Any = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_rank_main, args=(r, port, results)) for r in range(WORLD)]
    for p in procs:
        p.start()
    try:
        seen: dict[int, Any] = {}
        deadline = time.monotonic() + 90
        while len(seen) < WORLD and time.monotonic() < deadline:
            try:
                rank, status, value = results.get(timeout=0.5)
            except queue.Empty:
                continue
            assert status == "ok", (rank, value)
            seen[rank] = value
        assert len(seen) == WORLD, f"ranks {sorted(set(range(WORLD)) - set(seen))} gave no result"
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    want = [{"rank": r, "name": "r" * (r * 300 + 1), "shape": (r, 2)} for r in range(WORLD)]
    for rank, (kind, gathered, objs) in seen.items():
        assert kind == "ResilientProcessGroup", (rank, kind)
        assert gathered == want, (rank, gathered)
        assert objs == [{"config": "lr=0.1", "step": 42}, [1, 2, 3]], (rank, objs)


def _registered(code: str, autoload: str) -> str:
    env = {**os.environ, "TORCH_DEVICE_BACKEND_AUTOLOAD": autoload}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60
    )
    assert out.returncode == 0, out.stderr
    return out.stdout.strip()


@pytest.mark.timeout(120)
def test_the_backend_is_registered_in_any_import_order() -> None:
    check = "import torch.distributed as d; print('resilient' in d.Backend.backend_list)"
    assert _registered("import resilient; " + check, "1") == "True"
    assert _registered("import torch; " + check, "1") == "True"  # no import of ours at all
    assert _registered("import torch; import resilient; " + check, "0") == "True"
    # With torch's autoload off, importing resilient first cannot register it: the
    # entry point is what does in the first case above.
    assert _registered("import resilient; " + check, "0") == "False"
