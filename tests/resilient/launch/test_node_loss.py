"""A node agent's ranks never outlive it: a SIGKILLed agent takes them along
(parent-death signal), and an agent cut off from etcd kills them (fencing) before
its node lease could expire there, then exits with EXIT_FENCED.

Node 1's agent is a real ``resilient run``; node 0 is stood in for by a node record
the test registers (the ranks here never use torch's init store).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from membership.nodes import NodeInfo, NodeRendezvous
from membership.server import EmbeddedEtcd
from resilient.config import EtcdConfig
from resilient.launch.launch_config import EXIT_FENCED
from resilient.procs import spawn, stop_process
from tests._procs import wait_until

REPO = Path(__file__).resolve().parents[3]
TOKEN = "node-loss-token"
TTL_S = 2.0

SLEEPER = """\
import os, sys, time
from pathlib import Path
out = Path(sys.argv[1])
(out / f"pid-{os.environ['RANK']}").write_text(str(os.getpid()))
time.sleep(120)
"""


def running(pid: int) -> bool:
    """Whether ``pid`` runs: a zombie (killed, not reaped yet by its agent) does not."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


@pytest.fixture
def procs() -> Iterator[list[subprocess.Popen[bytes]]]:
    """Agents a test starts, and (by pid) the ranks they started: all gone after it."""
    started: list[subprocess.Popen[bytes]] = []
    yield started
    for proc in started:
        stop_process(proc, grace_s=2.0)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)


def _node0(etcd: EtcdConfig, job: str) -> NodeRendezvous:
    me = NodeInfo(
        node_rank=0, nnodes=2, nproc_per_node=2, rails=1, host="stand-in", pid=1,
        store="127.0.0.1:29500",
    )  # fmt: skip
    node0 = NodeRendezvous(etcd, job, TOKEN, me, lease_ttl_s=30.0)
    node0.register()
    return node0


def _node1(
    procs: list[subprocess.Popen[bytes]], url: str, job: str, tmp: Path
) -> tuple[subprocess.Popen[bytes], list[int]]:
    """Start node 1's agent; returns it and its two ranks' pids once they run."""
    script, out = tmp / "sleeper.py", tmp / "out"
    script.write_text(SLEEPER)
    out.mkdir()
    argv = [sys.executable, "-m", "resilient", "run", "--nnodes", "2", "--node-rank", "1"]
    argv += ["--nproc-per-node", "2", "--etcd", url, "--job", job, "--join-timeout", "30"]
    argv += ["--lease-ttl", str(TTL_S), "--grace", "1", str(script), str(out)]
    env = {**os.environ, "RESILIENT_TOKEN": TOKEN}
    with open(tmp / "agent1.log", "wb") as log:
        agent = spawn(argv, env=env, cwd=str(REPO), stdout=log, stderr=subprocess.STDOUT)
    procs.append(agent)
    ran = wait_until(lambda: len(list(out.glob("pid-*"))) == 2, 60.0)
    assert ran, (tmp / "agent1.log").read_text()[-3000:]
    time.sleep(0.1)  # the pid files are written whole
    return agent, [int((out / f"pid-{r}").read_text()) for r in (2, 3)]


@pytest.mark.timeout(120)
def test_a_sigkilled_agent_takes_its_ranks_along(
    tmp_path: Path,
    etcd_server: EmbeddedEtcd,
    etcd_config: EtcdConfig,
    job_name: str,
    procs: list[subprocess.Popen[bytes]],
) -> None:
    with _node0(etcd_config, job_name):
        agent, ranks = _node1(procs, etcd_server.url, job_name, tmp_path)
        assert all(running(pid) for pid in ranks)
        agent.kill()
        agent.wait(10)
        gone = wait_until(lambda: not any(running(pid) for pid in ranks), 5.0)
        assert gone, f"orphan ranks left behind: {[p for p in ranks if running(p)]}"


@pytest.mark.timeout(120)
def test_an_agent_cut_off_from_etcd_kills_its_ranks_before_its_lease_expires(
    tmp_path: Path, job_name: str, procs: list[subprocess.Popen[bytes]]
) -> None:
    with EmbeddedEtcd(fsync=False) as server:
        etcd = EtcdConfig(endpoints=server.endpoints, request_timeout_s=2.0, retry_budget_s=5.0)
        etcd_pid = server.member_pid(0)
        assert etcd_pid is not None
        try:
            with _node0(etcd, job_name):
                agent, ranks = _node1(procs, server.url, job_name, tmp_path)
                time.sleep(1.0)  # keep-alives go through
                cut = time.monotonic()
                os.kill(etcd_pid, signal.SIGSTOP)  # cut off: etcd answers nothing
                gone = wait_until(lambda: not any(running(pid) for pid in ranks), TTL_S + 1.0)
                took = time.monotonic() - cut
                os.kill(etcd_pid, signal.SIGCONT)
                assert gone, "the ranks of a cut-off agent still ran after the lease TTL"
                # The last keep-alive etcd acknowledged was at most TTL/3 before the
                # cut; the node key lives at least TTL after it. The ranks died first.
                assert took < TTL_S, took
                code = agent.wait(timeout=20)
        finally:
            with contextlib.suppress(ProcessLookupError):
                os.kill(etcd_pid, signal.SIGCONT)
    said = (tmp_path / "agent1.log").read_text()
    assert code == EXIT_FENCED, said[-3000:]
    assert "node 1 fenced: its node lease was not refreshed for" in said, said[-3000:]
