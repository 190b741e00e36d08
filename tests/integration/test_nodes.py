"""Two node agents, two real ``resilient run`` processes on this machine, one job.

``--nnodes 2 --nproc-per-node 2`` against the test session's etcd: the agents meet
in etcd, node 0's agent hosts torch's init store, and the four ranks all_reduce
over the resilient backend. While the job runs, a third agent claiming node 1 is
refused (exit 2, the node named) and the job goes on untouched.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

from membership.server import EmbeddedEtcd
from resilient.procs import spawn, stop_process
from tests._procs import wait_until

REPO = Path(__file__).resolve().parents[2]

JOB_SCRIPT = """\
import json, os, sys, time
from pathlib import Path

import torch
import torch.distributed as dist

import resilient

out = Path(sys.argv[1])
torch.set_num_threads(1)
resilient.init()
rank, world = dist.get_rank(), dist.get_world_size()
t = torch.tensor([float(rank + 1)])
dist.all_reduce(t)
record = {
    "rank": rank, "world": world, "sum": t.item(), "pid": os.getpid(),
    "env": {k: os.environ[k] for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE",
                                       "RESILIENT_INCARNATION", "MASTER_ADDR")},
}
inc = os.environ["RESILIENT_INCARNATION"]
(out / f".{rank}.tmp").write_text(json.dumps(record))
(out / f".{rank}.tmp").rename(out / f"rank-{rank}-{inc}.json")
deadline = time.monotonic() + 60
while not (out / "finish").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
dist.barrier()
dist.destroy_process_group()
"""


@pytest.fixture
def agents() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Agents a test starts; each is stopped with its whole session afterwards."""
    procs: list[subprocess.Popen[bytes]] = []
    yield procs
    for proc in procs:
        stop_process(proc, grace_s=5.0)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # any rank left in its session


def _agent(
    procs: list[subprocess.Popen[bytes]], etcd: str, job: str, node: int, log: IO[bytes],
    script: Path, out: Path, *extra: str,
) -> subprocess.Popen[bytes]:  # fmt: skip
    argv = [sys.executable, "-m", "resilient", "run", "--nnodes", "2", "--node-rank", str(node)]
    argv += ["--nproc-per-node", "2", "--etcd", etcd, "--job", job, "--master-addr", "127.0.0.1"]
    argv += ["--join-timeout", "60", *extra, str(script), str(out)]
    env = {**os.environ, "RESILIENT_TOKEN": "node-test-token", "RESILIENT_OP_TIMEOUT_S": "20"}
    proc = spawn(argv, env=env, cwd=str(REPO), stdout=log, stderr=subprocess.STDOUT)
    procs.append(proc)
    return proc


@pytest.mark.timeout(180)
def test_two_agents_run_one_four_rank_job(
    tmp_path: Path,
    etcd_server: EmbeddedEtcd,
    job_name: str,
    agents: list[subprocess.Popen[bytes]],
) -> None:
    script, out = tmp_path / "job.py", tmp_path / "out"
    script.write_text(JOB_SCRIPT)
    out.mkdir()
    logs = [open(tmp_path / f"agent{k}.log", "wb") for k in range(3)]  # noqa: SIM115
    try:
        # Node 1 first: it must wait for node 0 (and its init store) in etcd.
        node1 = _agent(agents, etcd_server.url, job_name, 1, logs[1], script, out)
        node0 = _agent(agents, etcd_server.url, job_name, 0, logs[0], script, out)
        done = wait_until(lambda: len(list(out.glob("rank-*.json"))) == 4, 120.0)
        text = "\n".join((tmp_path / f"agent{k}.log").read_text() for k in range(2))
        assert done, f"the ranks did not all report:\n{text[-4000:]}"

        # A second agent for node 1 while the job runs: refused, the job untouched.
        intruder = _agent(agents, etcd_server.url, job_name, 1, logs[2], script, out)
        assert intruder.wait(timeout=60) == 2
        said = (tmp_path / "agent2.log").read_text()
        assert "node rank 1 is already held by agent pid" in said, said
        assert node0.poll() is None and node1.poll() is None

        (out / "finish").touch()
        codes = (node0.wait(timeout=60), node1.wait(timeout=60))
        text = "\n".join((tmp_path / f"agent{k}.log").read_text() for k in range(2))
        assert codes == (0, 0), text[-6000:]
    finally:
        for log in logs:
            log.close()
    records = {p.name: json.loads(p.read_text()) for p in out.glob("rank-*.json")}
    # Every global rank ran exactly once (incarnation 0), with the job's world size.
    assert sorted(records) == [f"rank-{r}-0.json" for r in range(4)]
    for name, rec in records.items():
        rank = rec["rank"]
        assert name == f"rank-{rank}-0.json"
        assert rec["world"] == 4 and rec["sum"] == 1 + 2 + 3 + 4
        assert rec["env"] == {
            "RANK": str(rank), "WORLD_SIZE": "4", "LOCAL_RANK": str(rank % 2),
            "LOCAL_WORLD_SIZE": "2", "RESILIENT_INCARNATION": "0", "MASTER_ADDR": "127.0.0.1",
        }  # fmt: skip
    assert len({rec["pid"] for rec in records.values()}) == 4
    node_logs = [(tmp_path / f"agent{k}.log").read_text() for k in range(2)]
    assert "node 0 of 2: ranks 0..1 of 4" in node_logs[0]
    assert "node 1 of 2: ranks 2..3 of 4" in node_logs[1]


RESTART_SCRIPT = """\
import json, os, sys, time
from pathlib import Path

out = Path(sys.argv[1])
keys = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "RESILIENT_INCARNATION")
env = {k: os.environ[k] for k in keys}
(out / f"rank-{env['RANK']}-{env['RESILIENT_INCARNATION']}.json").write_text(json.dumps(env))
if env["RANK"] == "3" and env["RESILIENT_INCARNATION"] == "0":
    sys.exit(3)
# As a real job's ranks do (they meet in init_process_group), every rank stays until
# all have run: an agent whose ranks all ended leaves, and its node key with it.
deadline = time.monotonic() + 60
while not (out / "finish").exists() and time.monotonic() < deadline:
    time.sleep(0.05)
"""


@pytest.mark.timeout(120)
def test_a_restarted_rank_keeps_its_global_rank_on_its_node(
    tmp_path: Path,
    etcd_server: EmbeddedEtcd,
    job_name: str,
    agents: list[subprocess.Popen[bytes]],
) -> None:
    script, out = tmp_path / "ranks.py", tmp_path / "out"
    script.write_text(RESTART_SCRIPT)
    out.mkdir()
    with open(tmp_path / "agent0.log", "wb") as log0, open(tmp_path / "agent1.log", "wb") as log1:
        node0 = _agent(agents, etcd_server.url, job_name, 0, log0, script, out)
        node1 = _agent(
            agents, etcd_server.url, job_name, 1, log1, script, out, "--max-restarts", "1"
        )
        want = {"rank-0-0.json", "rank-1-0.json", "rank-2-0.json", "rank-3-1.json"}
        wait_until(lambda: want <= {p.name for p in out.glob("rank-*.json")}, 90.0)
        (out / "finish").touch()
        codes = (node0.wait(timeout=90), node1.wait(timeout=90))
    said = (tmp_path / "agent1.log").read_text()
    assert codes == (0, 0), said
    assert "rank 3 exited with code 3; restarting as incarnation 1" in said
    names = sorted(p.name for p in out.glob("rank-*.json"))
    assert names == ["rank-0-0.json", "rank-1-0.json", "rank-2-0.json", "rank-3-0.json",
                     "rank-3-1.json"]  # fmt: skip
    again = json.loads((out / "rank-3-1.json").read_text())
    assert again == {
        "RANK": "3",
        "WORLD_SIZE": "4",
        "LOCAL_RANK": "1",
        "RESILIENT_INCARNATION": "1",
    }


@pytest.mark.timeout(60)
def test_sigterm_while_waiting_for_the_other_agents_stops_at_once(
    tmp_path: Path,
    etcd_server: EmbeddedEtcd,
    job_name: str,
    agents: list[subprocess.Popen[bytes]],
) -> None:
    from membership.etcd_client import EtcdClient
    from membership.keys import JobKeys
    from resilient.config import etcd_config

    script = tmp_path / "never.py"
    script.write_text("raise SystemExit(9)\n")
    client = EtcdClient(etcd_config(etcd_server.url))
    try:
        with open(tmp_path / "agent0.log", "wb") as log:
            node0 = _agent(agents, etcd_server.url, job_name, 0, log, script, tmp_path)
            key = JobKeys(job_name).node(0)
            assert wait_until(lambda: client.get(key) is not None, 30.0), "node 0 never registered"
            node0.send_signal(signal.SIGTERM)
            assert node0.wait(timeout=10) == 128 + signal.SIGTERM
        assert client.get(key) is None  # its lease was revoked on the way out
    finally:
        client.close()
    assert "received SIGTERM" in (tmp_path / "agent0.log").read_text()
