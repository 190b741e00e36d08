"""Two node agents, two real ``resilient run`` processes on this machine, one job.

``--nnodes 2 --nproc-per-node 2`` against the test session's etcd: the agents meet
in etcd, node 0's agent hosts torch's init store, and the four ranks all_reduce
over the resilient backend. While the job runs, a third agent claiming node 1 is
refused (exit 2, the node named) and the job goes on untouched.

Node loss: the four ranks train (DDP under ``recovery.Session``) beside a spare
node agent (``--spare``); node 1's agent is SIGKILLed mid-run, its ranks die with
it, the spare takes node 1 over (its ranks at incarnation 1, in one epoch), and
every rank ends bitwise equal to a fault-free run of the same job. The same for
node 0, whose agent hosted torch's init store (the ranks use resilient.init()).
Without a spare the survivors shrink by the whole node in one epoch as soon as
node 0's agent finds node 1 lost. The agents' node events are checked in each.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import IO

import pytest

from membership.server import EmbeddedEtcd
from resilient.launch.launch_config import EXIT_FENCED
from resilient.procs import spawn, stop_process
from tests._procs import gone, wait_until

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


TRAIN_SCRIPT = """\
import functools, hashlib, json, os, sys, time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

import resilient
from recovery.session import Session, TrainState

out, steps = Path(sys.argv[1]), int(sys.argv[2])
short_pause = float(sys.argv[3]) if len(sys.argv) > 3 else 0.1  # while ranks are missing
rank, inc = int(os.environ["RANK"]), os.environ["RESILIENT_INCARNATION"]
(out / f"pid-{rank}-{inc}").write_text(str(os.getpid()))
torch.set_num_threads(1)
pg = resilient.init()
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
ddp = nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.05)


def train_step(step, ddp=ddp, opt=opt):
    gen = torch.Generator().manual_seed(rank * 1_000 + step)
    loss = ddp(torch.randn(16, 64, generator=gen)).square().mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    return loss.detach()


session = Session(pg, TrainState(model, opt), warmup=functools.partial(train_step, 0), ddp=ddp)
for step in session.steps(steps):
    with session.step(step):
        loss = train_step(step)
        dist.all_reduce(loss)
    (out / f"step-{rank}").write_text(str(step))
    # A run long enough to lose a node in (and, shrunk, for it to come back).
    time.sleep(short_pause if len(session.members) < dist.get_world_size() else 0.1)
h = hashlib.sha256()
for p in model.parameters():
    h.update(p.detach().numpy().tobytes())
record = {"digest": h.hexdigest(), "replayed": session.replayed, "epoch": pg.epoch,
          "members": list(session.members)}
(out / f"digest-{rank}-{inc}.json").write_text(json.dumps(record))
del session, train_step, ddp, opt
dist.barrier()
dist.destroy_process_group()
"""
TRAIN_STEPS = 40


def _train(
    tmp: Path, etcd: str, job: str, agents: list[subprocess.Popen[bytes]], *, spare: bool,
    more: tuple[str, ...] = (), etcd1: str | None = None, short_pause_s: float = 0.1,
) -> tuple[Path, list[subprocess.Popen[bytes]]]:  # fmt: skip
    """Start nodes 0 and 1 (and a spare node) training, 0.1 s apart (``short_pause_s``
    while the group is short of ranks), each with flags ``more`` too (node 1 on
    etcd ``etcd1``, if given); returns where the ranks write and the agents."""
    script, out = tmp / "train.py", tmp / "out"
    script.write_text(TRAIN_SCRIPT)
    out.mkdir()
    started = []
    for name in ["0", "1"] + (["spare"] if spare else []):
        url = etcd1 if etcd1 is not None and name == "1" else etcd
        argv = _train_argv(tmp, url, job, name, more, short_pause_s)
        started.append(_start_agent(tmp, agents, name, argv))
    return out, started


def _train_argv(
    tmp: Path, etcd: str, job: str, name: str, more: tuple[str, ...], short_pause_s: float = 0.1
) -> list[str]:
    """An agent's command line (``name``: a node rank, or "spare"; its ranks pause
    ``short_pause_s`` between steps while the group is short of ranks)."""
    node = ["--spare"] if name == "spare" else ["--node-rank", name]
    argv = [sys.executable, "-m", "resilient", "run", "--nnodes", "2", *node]
    argv += ["--nproc-per-node", "2", "--etcd", etcd, "--job", job]
    argv += ["--lease-ttl", "2", "--run-dir", str(tmp / "run"), *more]
    argv += ["--master-addr", "127.0.0.1", "--join-timeout", "60"]
    return [*argv, str(tmp / "train.py"), str(tmp / "out"), str(TRAIN_STEPS), str(short_pause_s)]


def _start_agent(
    tmp: Path, agents: list[subprocess.Popen[bytes]], name: str, argv: list[str]
) -> subprocess.Popen[bytes]:
    """Start one agent, its output in ``tmp/agent<name>.log``."""
    with open(tmp / f"agent{name}.log", "wb") as log:
        env = {**os.environ, "RESILIENT_TOKEN": "node-test-token"}
        env["RESILIENT_OP_TIMEOUT_S"] = "20"
        proc = spawn(argv, env=env, cwd=str(REPO), stdout=log, stderr=subprocess.STDOUT)
    agents.append(proc)
    return proc


def _digests(out: Path) -> dict[tuple[int, int], dict[str, object]]:
    found = {}
    for path in out.glob("digest-*.json"):
        _, rank, inc = path.stem.split("-")
        found[(int(rank), int(inc))] = json.loads(path.read_text())
    return found


def _events(tmp: Path) -> list[dict[str, object]]:
    """Every event the agents and ranks wrote under ``tmp/run``, by time."""
    from resilient.events import read_events

    return read_events(tmp / "run")


def _node_events(tmp: Path, kind: str) -> list[dict[str, object]]:
    return [e for e in _events(tmp) if e["kind"] == kind]


def _logs(tmp: Path) -> str:
    return "\n".join(
        f"--- {p.name}\n{p.read_text()[-3000:]}" for p in sorted(tmp.glob("agent*.log"))
    )


def _stepped(out: Path, at: int) -> bool:
    """Whether rank 0 finished step ``at``."""
    with contextlib.suppress(OSError, ValueError):
        return int((out / "step-0").read_text() or -1) >= at
    return False


@pytest.fixture(scope="module")
def fault_free(etcd_server: EmbeddedEtcd, tmp_path_factory: pytest.TempPathFactory) -> str:
    """The parameters' digest of a fault-free run of the training job (every rank's).
    Its spare node is not needed, and leaves when the nodes are done."""
    import uuid

    tmp = tmp_path_factory.mktemp("fault-free")
    agents: list[subprocess.Popen[bytes]] = []
    try:
        out, (node0, node1, spare) = _train(
            tmp, etcd_server.url, f"test-{uuid.uuid4().hex[:12]}", agents, spare=True
        )
        codes = (node0.wait(timeout=150), node1.wait(timeout=150), spare.wait(timeout=30))
        assert codes == (0, 0, 0), _logs(tmp)
    finally:
        for proc in agents:
            stop_process(proc, grace_s=5.0)
    said = (tmp / "agentspare.log").read_text()
    assert "finished (node 0 is done); this spare was not needed" in said, said
    found = _digests(out)
    assert sorted(found) == [(r, 0) for r in range(4)], _logs(tmp)
    digests = {str(rec["digest"]) for rec in found.values()}
    assert len(digests) == 1, found
    return digests.pop()


@pytest.mark.timeout(300)
def test_a_spare_node_takes_a_killed_node_over_and_the_job_matches_a_fault_free_run(
    tmp_path: Path,
    etcd_server: EmbeddedEtcd,
    job_name: str,
    agents: list[subprocess.Popen[bytes]],
    fault_free: str,
) -> None:
    out, (node0, node1, spare) = _train(tmp_path, etcd_server.url, job_name, agents, spare=True)
    assert wait_until(lambda: _stepped(out, 5), 120.0), _logs(tmp_path)
    victims = [int((out / f"pid-{r}-0").read_text()) for r in (2, 3)]
    node1.kill()  # the machine is gone: its agent and, with it, its ranks
    assert node1.wait(timeout=10) == -signal.SIGKILL
    assert wait_until(lambda: all(gone(pid) for pid in victims), 5.0), "orphan ranks"
    codes = (node0.wait(timeout=180), spare.wait(timeout=60))
    assert codes == (0, 0), _logs(tmp_path)

    found = _digests(out)
    assert sorted(found) == [(0, 0), (1, 0), (2, 1), (3, 1)], _logs(tmp_path)
    for who, rec in found.items():
        assert rec["digest"] == fault_free, f"rank {who} differs from the fault-free run"
        # One epoch for the whole node: both replacements were admitted together.
        assert rec["epoch"] == 1, (who, rec)
        assert int(str(rec["replayed"])) <= (1 if who[1] == 0 else 0), (who, rec)
    # One line each for the node: lost (named by its old agent), taken over by the spare.
    (lost,) = _node_events(tmp_path, "node.lost")
    assert (lost["node"], lost["ranks"], lost["pid"]) == (1, [2, 3], node1.pid), lost
    # Its agent died, which its machine tells at once (the beacon); a starved spare
    # may look only after the short test lease lapsed (membership.node_probe).
    assert any(why in str(lost["reason"]) for why in ("beacon", "lease lapsed")), lost
    assert lost["host"], lost
    (took,) = _node_events(tmp_path, "node.taken_over")
    assert (took["node"], took["ranks"], took["pid"]) == (1, [2, 3], spare.pid), took
    assert took["lost_pid"] == node1.pid and took["incarnations"] == {"2": 1, "3": 1}, took
    said = (tmp_path / "agentspare.log").read_text()
    assert "spare node: node 1 was lost; taking it over: ranks 2 (incarnation 1), " in said


@pytest.mark.timeout(300)
def test_a_spare_node_takes_node_0_over_under_the_run_id(
    tmp_path: Path,
    etcd_server: EmbeddedEtcd,
    job_name: str,
    agents: list[subprocess.Popen[bytes]],
    fault_free: str,
) -> None:
    # Node 0's agent hosted torch's init store; the ranks use resilient.init(), so
    # under the run id nothing of theirs needs it, and the spare hosts its own.
    out, (node0, node1, spare) = _train(tmp_path, etcd_server.url, job_name, agents, spare=True)
    assert wait_until(lambda: _stepped(out, 5), 120.0), _logs(tmp_path)
    node0.kill()
    assert node0.wait(timeout=10) == -signal.SIGKILL
    codes = (node1.wait(timeout=180), spare.wait(timeout=60))
    assert codes == (0, 0), _logs(tmp_path)
    found = _digests(out)
    assert sorted(found) == [(0, 1), (1, 1), (2, 0), (3, 0)], _logs(tmp_path)
    for who, rec in found.items():
        assert rec["digest"] == fault_free, f"rank {who} differs from the fault-free run"
        assert rec["epoch"] == 1, (who, rec)
    (took,) = _node_events(tmp_path, "node.taken_over")
    assert (took["node"], took["ranks"], took["lost_pid"]) == (0, [0, 1], node0.pid), took


SHRINK = ("--min-nodes", "1", "--shrink-after", "30")


def _lose_node_1(
    tmp: Path, etcd: str, job: str, agents: list[subprocess.Popen[bytes]],
    more: tuple[str, ...] = SHRINK, short_pause_s: float = 0.1,
) -> tuple[Path, list[subprocess.Popen[bytes]], float]:  # fmt: skip
    """Two nodes train with flags ``more`` (no spare; ``short_pause_s``: see _train)
    and node 1's agent is SIGKILLed after step 5; returns where the ranks write,
    both agents, and when node 1's was killed (``time.time()``)."""
    out, (node0, node1) = _train(
        tmp, etcd, job, agents, spare=False, more=more, short_pause_s=short_pause_s
    )
    assert wait_until(lambda: _stepped(out, 5), 120.0), _logs(tmp)
    killed_at = time.time()
    node1.kill()
    assert node1.wait(timeout=10) == -signal.SIGKILL
    return out, [node0, node1], killed_at


@pytest.mark.timeout(240)
def test_without_a_spare_the_job_shrinks_by_the_lost_node(
    tmp_path: Path,
    etcd_server: EmbeddedEtcd,
    job_name: str,
    agents: list[subprocess.Popen[bytes]],
) -> None:
    # --shrink-after far beyond the loss's detection: node 0's agent finds node 1
    # lost (its lease, 2 s, lapsed), announces that no one replaces ranks 2 and 3,
    # and the survivors give both up at once rather than waiting 30 s.
    out, (node0, node1), killed_at = _lose_node_1(tmp_path, etcd_server.url, job_name, agents)
    assert node0.wait(timeout=120) == 0, _logs(tmp_path)
    found = _digests(out)
    assert sorted(found) == [(0, 0), (1, 0)], _logs(tmp_path)
    assert found[(0, 0)]["digest"] == found[(1, 0)]["digest"]
    for who, rec in found.items():
        # Both of node 1's ranks were left out in one epoch.
        assert rec["epoch"] == 1 and rec["members"] == [0, 1], (who, rec)
    (lost,) = _node_events(tmp_path, "node.lost")
    assert (lost["node"], lost["ranks"], lost["pid"], lost["seen_by"]) == (1, [2, 3], node1.pid, 0)
    assert lost["host"], lost
    assert "goes on without ranks [2, 3]" in str(lost["action"]), lost
    left = {e["rank"] for e in _node_events(tmp_path, "rank.lost") if e.get("left")}
    assert left == {2, 3}, _events(tmp_path)
    changed = [e for e in _node_events(tmp_path, "epoch.changed") if e["rank"] in (0, 1)]
    assert [e["epoch"] for e in changed] == [1, 1], changed
    # Quietly ~3 s (2 s leases, a 0.5 s poll); bound 3x, far below --shrink-after.
    after = max(float(str(e["ts"])) for e in changed) - killed_at
    assert after < 10.0, (after, _events(tmp_path))


@pytest.mark.timeout(300)
def test_a_lost_node_whose_agent_starts_again_rejoins_the_shrunk_job(
    tmp_path: Path,
    etcd_server: EmbeddedEtcd,
    job_name: str,
    agents: list[subprocess.Popen[bytes]],
) -> None:
    # As above, the survivors shrink by node 1; then node 1's agent is started
    # again with its first command line (as a supervisor restarting it would). It
    # claims node 1 back and its ranks join the shrunk group (the grow path): the
    # job ends with all four ranks in one group, their parameters equal. The
    # first step after a rank was admitted used to hang where the links its
    # background build made were in one end's table and not yet in the other's
    # (LinkTable.has_all; 1 run in 1 here before the fix, 1 in 4 under load).
    # 1 s between steps while shrunk: node 1's ranks have ~35 s to start (cold) and
    # join, where they take ~9 s quietly.
    out, (node0, _), _ = _lose_node_1(
        tmp_path, etcd_server.url, job_name, agents, short_pause_s=1.0
    )
    shrunk = lambda: bool(_node_events(tmp_path, "epoch.changed"))  # noqa: E731
    assert wait_until(shrunk, 30.0), _logs(tmp_path)
    argv = _train_argv(tmp_path, etcd_server.url, job_name, "1", SHRINK, short_pause_s=1.0)
    again = _start_agent(tmp_path, agents, "1-again", argv)
    assert again.wait(timeout=180) == 0, _logs(tmp_path)
    assert node0.wait(timeout=60) == 0, _logs(tmp_path)
    found = _digests(out)
    assert sorted(found) == [(0, 0), (1, 0), (2, 1), (3, 1)], _logs(tmp_path)
    assert len({rec["digest"] for rec in found.values()}) == 1, found
    for who, rec in found.items():
        # Shrunk in epoch 1, grown back in epoch 2, or 3 where rank 3 asked to join
        # after rank 2 was admitted (each is, at the first step boundary after it asks).
        assert rec["epoch"] in (2, 3) and rec["members"] == [0, 1, 2, 3], (who, rec)
    (back,) = _node_events(tmp_path, "node.returned")
    assert (back["node"], back["ranks"], back["pid"]) == (1, [2, 3], again.pid), back
    assert back["incarnations"] == {"2": 1, "3": 1}, back
    said = (tmp_path / "agent1-again.log").read_text()
    assert "node 1 was lost and comes back: ranks 2 (incarnation 1)" in said, said


@pytest.mark.timeout(300)
def test_a_lost_node_whose_agent_starts_again_is_waited_for_and_matches_a_fault_free_run(
    tmp_path: Path,
    etcd_server: EmbeddedEtcd,
    job_name: str,
    agents: list[subprocess.Popen[bytes]],
    fault_free: str,
) -> None:
    # No spare and no --min-nodes: the survivors wait for replacements (60 s). Node
    # 1's agent, started again once its loss was found, takes node 1 back and its
    # ranks are admitted as replacements, the whole node in one epoch.
    out, (node0, _), _ = _lose_node_1(tmp_path, etcd_server.url, job_name, agents, more=())
    assert wait_until(lambda: bool(_node_events(tmp_path, "node.lost")), 30.0), _logs(tmp_path)
    argv = _train_argv(tmp_path, etcd_server.url, job_name, "1", ())
    again = _start_agent(tmp_path, agents, "1-again", argv)
    assert again.wait(timeout=180) == 0, _logs(tmp_path)
    assert node0.wait(timeout=60) == 0, _logs(tmp_path)
    found = _digests(out)
    assert sorted(found) == [(0, 0), (1, 0), (2, 1), (3, 1)], _logs(tmp_path)
    assert {rec["digest"] for rec in found.values()} == {fault_free}, found
    for who, rec in found.items():
        assert rec["epoch"] == 1 and rec["members"] == [0, 1, 2, 3], (who, rec)
    (back,) = _node_events(tmp_path, "node.returned")
    assert (back["node"], back["ranks"], back["pid"]) == (1, [2, 3], again.pid), back


class _Blackhole:
    """A TCP forwarder to etcd that can be cut: after :meth:`cut` it forwards
    nothing more, leaving every connection open and unanswered, as a network
    partition does (no reset, no error: calls just time out)."""

    def __init__(self, upstream: str) -> None:
        host, _, port = upstream.removeprefix("http://").rpartition(":")
        self._upstream = (host, int(port))
        self._server = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self._server.getsockname()[1]}"
        self._cut = threading.Event()
        self._closed = threading.Event()
        self._socks: list[socket.socket] = [self._server]
        threading.Thread(target=self._accept, daemon=True).start()

    def cut(self) -> None:
        self._cut.set()

    def close(self) -> None:
        self._closed.set()
        for s in self._socks:
            with contextlib.suppress(OSError):
                s.close()

    def _accept(self) -> None:
        while not self._closed.is_set():
            try:
                down, _ = self._server.accept()
                up = socket.create_connection(self._upstream)
            except OSError:
                return
            self._socks += [down, up]
            for a, b in ((down, up), (up, down)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        while not self._closed.is_set():
            if self._cut.is_set():
                time.sleep(0.1)
                continue
            try:
                ready, _, _ = select.select([a], [], [], 0.1)
                if not ready or self._cut.is_set():
                    continue
                data = a.recv(65536)
                if not data:
                    return
                b.sendall(data)
            except OSError:
                return


@pytest.mark.timeout(300)
def test_a_node_cut_off_from_etcd_is_fenced_before_the_spare_replaces_it(
    tmp_path: Path,
    etcd_server: EmbeddedEtcd,
    job_name: str,
    agents: list[subprocess.Popen[bytes]],
    fault_free: str,
) -> None:
    # Node 1 (its agent and its ranks) reaches etcd only through the blackhole.
    hole = _Blackhole(etcd_server.url)
    try:
        out, (node0, node1, spare) = _train(
            tmp_path, etcd_server.url, job_name, agents, spare=True, etcd1=hole.url
        )
        assert wait_until(lambda: _stepped(out, 5), 120.0), _logs(tmp_path)
        victims = [int((out / f"pid-{r}-0").read_text()) for r in (2, 3)]
        cut = time.monotonic()
        hole.cut()
        assert wait_until(lambda: all(gone(pid) for pid in victims), 2.0 + 1.0), "not fenced"
        fenced_at, fenced_after = time.time(), time.monotonic() - cut
        assert node1.wait(timeout=60) == EXIT_FENCED, _logs(tmp_path)
        codes = (node0.wait(timeout=180), spare.wait(timeout=60))
        assert codes == (0, 0), _logs(tmp_path)
    finally:
        hole.close()
    assert (
        "node 1 fenced: its node lease was not refreshed" in (tmp_path / "agent1.log").read_text()
    )
    found = _digests(out)
    assert sorted(found) == [(0, 0), (1, 0), (2, 1), (3, 1)], _logs(tmp_path)
    for who, rec in found.items():
        assert rec["digest"] == fault_free, f"rank {who} differs from the fault-free run"
        assert rec["epoch"] == 1, (who, rec)
    # No split brain: node 1's ranks were dead before the spare took node 1 over
    # (so before any replacement could be admitted).
    events = [
        json.loads(line)
        for path in (tmp_path / "run" / "events").glob("*.jsonl")
        for line in path.read_text().splitlines()
    ]
    took = [e["ts"] for e in events if "spare node took lost node 1" in str(e.get("action"))]
    assert took and min(took) > fenced_at, (fenced_after, min(took) - fenced_at)
    (fenced,) = _node_events(tmp_path, "node.fenced")
    assert (fenced["node"], fenced["ranks"], fenced["pid"]) == (1, [2, 3], node1.pid), fenced
    assert "not refreshed" in str(fenced["reason"]), fenced
    (over,) = _node_events(tmp_path, "node.taken_over")
    assert float(str(over["ts"])) > float(str(fenced["ts"])), (fenced, over)
