"""One host's NIC throttled to a quarter of the others': every rank agrees on the
same call to leave it out of the reduction, and the results stay identical.

Real parts: a netns testbed (one host per rank, a veth each), the chaos
``throttle`` injector (tbf both ways), three spawned ranks over gloo links.
"""

from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import queue
import traceback
from datetime import timedelta
from typing import Any

import pytest

WORLD = 3
CALLS = 40  # the vote starts after 20 calls (WARMUP_CALLS), then needs 6 votes
NUMEL = 1 << 18  # 1 MiB of float32: above LAG_MIN_BYTES, under the mesh limit


def _rank(rank: int, netns: str, rails: list[str], mgmt: str, port: int, out: Any) -> None:
    from chaos._netns import enter_netns

    try:
        enter_netns(netns)  # first: threads started later inherit the namespace
        import torch
        from torch._C._distributed_c10d import TCPStore

        from resilient.config import DataPlaneConfig
        from resilient.process_group import ResilientProcessGroup

        store = TCPStore(mgmt, port, WORLD, rank == 0, timeout=timedelta(seconds=60))
        pg = ResilientProcessGroup(
            rank=rank, world_size=WORLD, rails=[rails[rank]], store=store,
            config=DataPlaneConfig(topology="mesh", op_timeout_floor_s=30.0),
        )  # fmt: skip
        seen, digests = [], []
        try:
            for call in range(CALLS):
                t = torch.randn(NUMEL, generator=torch.Generator().manual_seed(rank * 100 + call))
                pg.allreduce([t]).wait(timedelta(seconds=60))
                seen.append(pg.engine.slow_rank)
                digests.append(hashlib.sha256(t.numpy().tobytes()).hexdigest())
        finally:
            pg.shutdown()
        out.put((rank, "ok", (seen, digests)))
    except BaseException:
        out.put((rank, "error", traceback.format_exc()))


@pytest.mark.skipif(os.geteuid() != 0, reason="the netns testbed needs root")
@pytest.mark.timeout(180)
def test_a_throttled_rank_is_left_out_of_the_reduction_by_agreement() -> None:
    from chaos.injector_kinds import make_injector
    from chaos.injectors import InjectionContext
    from chaos.scenario import Fault
    from chaos.testbed import NetnsTestbed

    testbed = NetnsTestbed(WORLD, 1).up()
    procs: list[Any] = []
    throttles = []
    try:
        ctx = InjectionContext(testbed=testbed, pid_of=lambda r: 0)
        for r, rate in enumerate((400, 400, 100)):
            fault = Fault(kind="throttle", params={"rank": r, "rail": 0, "rate_mbit": rate})
            throttles.append(make_injector(fault, ctx))
            throttles[-1].start()
        hosts = testbed.hosts
        mp_ctx = mp.get_context("spawn")
        out = mp_ctx.Queue()
        port = 29500 + os.getpid() % 1000
        rails = [h.rails[0] for h in hosts]
        procs = [
            mp_ctx.Process(
                target=_rank,
                args=(r, str(hosts[r].netns), rails, hosts[0].mgmt_addr, port, out),
                daemon=True,
            )
            for r in range(WORLD)
        ]
        for p in procs:
            p.start()
        results: dict[int, Any] = {}
        for _ in range(WORLD):
            try:
                rank, status, value = out.get(timeout=150)
            except queue.Empty:
                pytest.fail(f"ranks {sorted(set(range(WORLD)) - set(results))} gave no result")
            assert status == "ok", value
            results[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
        for t in throttles:
            t.stop()
        testbed.down()
    seen = [results[r][0] for r in range(WORLD)]
    assert seen[0] == seen[1] == seen[2], seen  # every rank switched on the same call
    assert seen[0][-1] == 2, seen[0]
    assert seen[0][0] is None  # nothing is known before the first measurement
    digests = [results[r][1] for r in range(WORLD)]
    assert digests[0] == digests[1] == digests[2]
