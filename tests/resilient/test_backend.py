"""The backend factory torch calls: the world group or a subgroup, and what each may do."""

from __future__ import annotations

import multiprocessing as mp
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist

from resilient.backend import create_group


def _replacements_subgroup(_: int) -> tuple[Any, ...]:
    import os

    os.environ["RESILIENT_INCARNATION"] = "1"
    os.environ["RESILIENT_RAILS"] = "127.0.1.4"
    store = dist.HashStore()
    store.set("resilient/roster/0", "2:2,3")  # the survivor's claim, made long ago
    options = SimpleNamespace(
        store=store, group_rank=1, group_size=2, timeout=timedelta(seconds=5),
        global_ranks_in_group=[2, 3], group_id="1",
    )  # fmt: skip
    pg = create_group(options)
    try:
        return (pg.is_subgroup, pg.joining, pg.membership, pg.job_ranks, pg.incarnation,
                store.get("resilient/roster/1"))  # fmt: skip
    finally:
        pg.shutdown()


@pytest.mark.timeout(60)
def test_a_replacements_subgroup_waits_for_admission() -> None:
    # A replacement (incarnation 1) meets the survivors' subgroup of the same name:
    # their claims are in the store, and it runs its calls alone (joining) until
    # recovery.Session admits it (recovery.subgroups). In a process of its own: a
    # group's threads in pytest's process would be there at later tests' forks.
    with mp.get_context("spawn").Pool(1) as pool:
        got = pool.map(_replacements_subgroup, [0], chunksize=1)[0]
    assert got == (True, True, None, (2, 3), 1, b"3:2,3")


@pytest.mark.timeout(30)
def test_the_backend_is_registered_with_torchs_extended_api() -> None:
    import resilient

    resilient.torch_autoload()
    plugin = dist.Backend._plugins["RESILIENT"]
    # The extended API hands the factory the job ranks of a subgroup.
    assert plugin.extended_api is True


FENCED_RANK = """\
import sys, time
from resilient.backend import _join
from resilient.config import RankEnv

member = _join(RankEnv.from_env(), ["127.0.0.1"])
print("joined", flush=True)
time.sleep(60)
"""


@pytest.mark.timeout(90)
def test_a_rank_of_a_multi_node_job_cut_off_from_etcd_exits_fenced(
    tmp_path: Any, job_name: str
) -> None:
    # RESILIENT_FENCE=1 (node agents set it with --nnodes > 1): once etcd stops
    # answering, the rank's process ends itself with 69 and says why in its event
    # log, as its member lease (2 s) may lapse in etcd.
    import json
    import os
    import signal
    import subprocess
    import sys
    import time

    from membership.server import EmbeddedEtcd
    from resilient.config import EXIT_FENCED

    server = EmbeddedEtcd(fsync=False)
    server.start()
    pid = server.member_pid(0)
    assert pid is not None
    env = {
        **os.environ, "RANK": "1", "WORLD_SIZE": "2", "RESILIENT_ETCD": server.url,
        "RESILIENT_JOB": job_name, "RESILIENT_TOKEN": "t", "RESILIENT_LEASE_TTL_S": "2",
        "RESILIENT_FENCE": "1", "RESILIENT_RUN_DIR": str(tmp_path),
    }  # fmt: skip
    proc = subprocess.Popen(
        [sys.executable, "-c", FENCED_RANK], env=env, stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None and proc.stdout.readline() == "joined\n"
        time.sleep(1.0)  # a keep-alive or two go through
        os.kill(pid, signal.SIGSTOP)
        cut = time.monotonic()
        assert proc.wait(timeout=10) == EXIT_FENCED
        # Quietly ~1.5-2 s (the TTL, 2 s, after the last refresh etcd acknowledged).
        assert time.monotonic() - cut < 6.0
    finally:
        os.kill(pid, signal.SIGCONT)
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
        server.stop()
    (log,) = (tmp_path / "events").glob("*.jsonl")
    kinds = [json.loads(line) for line in log.read_text().splitlines()]
    (fenced,) = [e for e in kinds if e["kind"] == "rank.fenced"]
    assert fenced["rank"] == 1 and "member lease was not refreshed" in fenced["reason"], fenced
