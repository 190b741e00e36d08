"""Node faults (chaos.node_faults) and the node agents' command lines and exit codes
(chaos.multinode): a real process tree killed whole, a real node cut off on the
netns testbed, and the pure logic around them."""

from __future__ import annotations

import contextlib
import itertools
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from chaos._progress_watch import RankTrack
from chaos.attribution import attribute
from chaos.etcd_leader import is_leader, leader_of
from chaos.injector_kinds import make_injector
from chaos.injectors import InjectionContext, Injector
from chaos.multinode import agent_argv, excused_nodes, job_exit_code
from chaos.node_faults import descendants, kill_tree
from chaos.report import FaultRecord, RunFacts, build_report, left_out
from chaos.scenario import Fault, parse
from chaos.testbed import Host, LoopbackTestbed, NetnsTestbed
from chaos.testbed import Testbed as AnyTestbed
from membership.server import EtcdCluster
from resilient.errors import ChaosError
from resilient.launch.launch_config import EXIT_FENCED
from resilient.launch.launcher import LaunchConfig
from tests.chaos import _net

ROOT = Path(__file__).resolve().parents[2]

# A parent with two children, each in a session of its own (as the launcher starts
# ranks), one of which has a child too; prints the pids, then waits.
_TREE = """
import os, subprocess, sys, time
kids = [subprocess.Popen([sys.executable, "-c", code], start_new_session=True)
        for code in ("import time; time.sleep(120)",
                     "import subprocess, sys, time; "
                     "subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(120)']); "
                     "time.sleep(120)")]
time.sleep(0.5)
print(os.getpid(), *(k.pid for k in kids), flush=True)
time.sleep(120)
"""


def _alive(pid: int) -> bool:
    """Running (not a zombie, not gone)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (OSError, IndexError):
        return False
    return state != "Z"


@pytest.fixture
def tree() -> Iterator[subprocess.Popen[str]]:
    proc = subprocess.Popen(
        [sys.executable, "-c", _TREE], stdout=subprocess.PIPE, text=True, start_new_session=True
    )
    found: list[int] = []
    try:
        yield proc
    finally:
        found = [proc.pid, *descendants(proc.pid)]
        for pid in found:
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)
        proc.wait(10)


@pytest.mark.timeout(30)
def test_kill_tree_kills_every_descendant_across_sessions(tree: subprocess.Popen[str]) -> None:
    assert tree.stdout is not None
    top, *kids = (int(x) for x in tree.stdout.readline().split())
    assert _net.wait_for(lambda: len(descendants(top)) == 3, 10.0), descendants(top)
    below = descendants(top)
    killed = kill_tree(top)
    assert sorted(killed) == sorted([top, *below])
    assert set(kids) <= set(below)
    tree.wait(10)
    assert _net.wait_for(lambda: not any(_alive(p) for p in below), 10.0)
    with pytest.raises(ChaosError, match="is gone"):
        kill_tree(top)


def _injector(
    kind: str,
    testbed: AnyTestbed,
    agent_pid: Any = None,
    etcd: EtcdCluster | None = None,
    **params: Any,
) -> Injector:
    ctx = InjectionContext(testbed=testbed, pid_of=lambda r: 0, agent_pid=agent_pid, etcd=etcd)
    return make_injector(Fault(kind=kind, at_s=0.0, params=params), ctx)


@pytest.mark.timeout(30)
def test_node_kill_kills_the_agent_of_that_node(tree: subprocess.Popen[str]) -> None:
    assert tree.stdout is not None
    top = int(tree.stdout.readline().split()[0])
    asked: list[int] = []

    def agent(node: int) -> int:
        asked.append(node)
        return top

    inj = _injector("node-kill", LoopbackTestbed(2, 1).up(), agent, node=1, ranks=(2, 3))
    inj.start()
    assert asked == [1, 1] and not inj.active  # checked, then killed: nothing to undo
    assert tree.wait(10) == -signal.SIGKILL
    detail, fired_at = getattr(inj, "detail", {}), getattr(inj, "fired_at", None)
    assert detail["agent_pid"] == top and len(detail["killed_pids"]) == 4
    assert fired_at is not None and abs(fired_at - time.time()) < 10


@pytest.mark.timeout(10)
def test_node_faults_without_agents_or_netns_are_rejected() -> None:
    loopback = LoopbackTestbed(2, 1).up()
    with pytest.raises(ChaosError, match="runs no node agents"):
        _injector("node-kill", loopback, node=0).start()

    def gone(node: int) -> int:
        raise ChaosError(f"node {node}'s agent is not running")

    with pytest.raises(ChaosError, match="not running"):
        _injector("node-kill", loopback, gone, node=0).start()
    partition = _injector("node-partition", loopback, node=1)
    with pytest.raises(ChaosError, match="netns testbed"):
        partition.start()
    assert not partition.active
    partition.stop()  # nothing to undo


@_net.requires_root
@_net.requires_iptables
@pytest.mark.timeout(60)
def test_node_partition_cuts_every_rail_and_the_management_link_until_stopped(
    netns_2x2: NetnsTestbed, procs: _net.Procs
) -> None:
    h0, h1 = netns_2x2.hosts
    for host in netns_2x2.hosts:
        _net.accept_server(procs, host)
    _net.accept_server(procs, None, netns_2x2.control_addr)  # where etcd would listen
    inj = _injector("node-partition", netns_2x2, node=1, ranks=(2, 3))
    inj.start()
    try:
        for addr in (*h1.rails, h1.mgmt_addr):
            assert _net.tcp_connect(h0, addr, timeout_s=1.0) == "timeout", addr
        assert _net.tcp_connect(h1, h0.rails[1], timeout_s=1.0) == "timeout"
        assert _net.tcp_connect(h1, netns_2x2.control_addr, timeout_s=1.0) == "timeout"
        # The node's own ranks still reach each other; the other node, the control plane.
        assert _net.tcp_connect(h1, h1.rails[0], timeout_s=5.0) == "ok"
        assert _net.tcp_connect(h0, netns_2x2.control_addr, timeout_s=5.0) == "ok"
    finally:
        inj.stop()
    rules = _sh_rules(str(h1.netns))
    assert rules == [], rules
    for addr in (*h1.rails, h1.mgmt_addr):
        assert _net.tcp_connect(h0, addr, timeout_s=5.0) == "ok", addr
    assert _net.tcp_connect(h1, netns_2x2.control_addr, timeout_s=5.0) == "ok"


def _sh_rules(netns: str) -> list[str]:
    out = subprocess.run(
        ["ip", "netns", "exec", netns, "iptables", "-w", "5", "-S"],
        capture_output=True, text=True, check=True, timeout=10,
    )  # fmt: skip
    return [line for line in out.stdout.splitlines() if line.startswith("-A")]


@pytest.mark.timeout(10)
def test_agent_argv_runs_node_k_on_host_k_with_its_rails(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    config = LaunchConfig(
        nproc=2, nnodes=2, script=str(script), script_args=("--steps", "5"), rails=2,
        etcd="http://10.213.7.254:2379", job="job-0badc0de", max_restarts=1, min_ranks=2,
        shrink_after_s=2.0, log_dir=str(tmp_path / "logs"), run_dir=str(tmp_path / "run"),
        master_addr="10.213.7.1",
    )  # fmt: skip

    class Bed(AnyTestbed):
        kind = "netns"

    bed = Bed(2, 2, ranks_per_host=2)
    bed.hosts = tuple(
        Host(
            index=i,
            netns=f"rsl-x-h{i}",
            rails=(f"10.100.0.{i + 1}", f"10.101.0.{i + 1}"),
            mgmt_addr=f"10.213.7.{i + 1}",
        )
        for i in range(2)
    )
    argv = agent_argv(config, bed, 1)
    assert argv[:4] == ["ip", "netns", "exec", "rsl-x-h1"]
    flags = dict(itertools.pairwise(argv[4:]))
    assert flags["--nnodes"] == "2" and flags["--node-rank"] == "1"
    assert flags["--nproc-per-node"] == "2" and flags["--rails"] == "10.100.0.2,10.101.0.2"
    assert flags["--master-addr"] == "10.213.7.1" and flags["--etcd"] == config.etcd
    assert flags["--min-ranks"] == "2" and flags["--shrink-after"] == "2"
    assert flags["--max-restarts"] == "1" and flags["--run-dir"] == config.run_dir
    assert argv[-3:] == [str(script), "--steps", "5"]
    bed.hosts = (*bed.hosts, Host(index=2, netns="rsl-x-h2", rails=("10.100.0.3", "10.101.0.3")))
    spare = agent_argv(config, bed, 2)  # past the job's nodes: a spare node's agent
    assert "--spare" in spare and "--node-rank" not in spare and spare[3] == "rsl-x-h2"
    assert dict(itertools.pairwise(spare))["--rails"] == "10.100.0.3,10.101.0.3"
    loop = agent_argv(config, LoopbackTestbed(2, 2, ranks_per_host=2).up(), 0)
    assert loop[:4] == [sys.executable, "-m", "resilient", "run"]
    assert dict(itertools.pairwise(loop))["--rails"] == "2"


def test_job_exit_code_excuses_only_the_nodes_a_fault_killed() -> None:
    assert job_exit_code({0: 0, 1: 0}) == 0
    assert job_exit_code({0: 0, 1: -9}) == 137
    assert job_exit_code({0: 0, 1: -9}, killed={1}) == 0
    assert job_exit_code({0: 3, 1: -9}, killed={1}) == 3
    assert job_exit_code({0: None, 1: 0}) is None


def _record(kind: str, node: int, *, fired: bool = True, error: str | None = None) -> FaultRecord:
    return FaultRecord(
        index=0, kind=kind, params={"node": node, "ranks": (2 * node, 2 * node + 1)},
        at_step=1, at_s=None, duration_s=None, fired_s=1.0 if fired else None, error=error,
    )  # fmt: skip


def test_nodes_a_fault_meant_to_fail_are_excused() -> None:
    codes = {0: 0, 1: -9, 2: EXIT_FENCED}
    assert excused_nodes([_record("node-kill", 1)], codes) == {1}
    assert excused_nodes([_record("node-kill", 1, fired=False)], codes) == set()
    assert excused_nodes([_record("node-kill", 1, error="agent gone")], codes) == set()
    # A partitioned node is excused only when its agent fenced itself.
    assert excused_nodes([_record("node-partition", 2)], codes) == {2}
    assert excused_nodes([_record("node-partition", 1)], codes) == set()
    assert job_exit_code(codes, excused_nodes([_record("node-kill", 1)], codes)) == EXIT_FENCED


def test_ranks_of_a_lost_node_are_left_out_once_an_epoch_goes_on_without_them() -> None:
    epoch1 = {"kind": "epoch.changed", "epoch": 1, "members": [0, 1], "ts": 1.0}
    assert left_out([epoch1], node_lost=[2, 3]) == {2, 3}
    assert left_out([epoch1]) == set()  # only a lost node's ranks, never a guess
    back = {"kind": "epoch.changed", "epoch": 2, "members": [0, 1, 2, 3], "ts": 2.0}
    assert left_out([back, epoch1], node_lost=[2, 3]) == set()
    assert left_out([], node_lost=[2, 3]) == set()


def test_a_node_fault_is_detected_by_an_event_naming_any_of_its_ranks() -> None:
    params = {"node": 1, "ranks": (2, 3)}
    other = {"kind": "link.down", "rank": 0, "links": [[0, 1, 0]], "ts": 1.1}
    hit = {"kind": "link.down", "rank": 1, "links": [[1, 3, 0]], "ts": 1.2}
    att = attribute("node-kill", params, [other, hit], start=1.0)
    assert att.detection == hit and att.unrelated == [other]
    lost = {"kind": "rank.lost", "rank": 2, "links": [], "ts": 1.3}
    assert attribute("node-partition", params, [lost], start=1.0).detection == lost


def test_is_leader_reads_the_metric() -> None:
    text = "# HELP etcd_server_is_leader ...\netcd_server_is_leader 1\netcd_x 2\n"
    assert is_leader(text)
    assert not is_leader(text.replace("is_leader 1", "is_leader 0"))
    assert not is_leader("etcd_x 1\n")


@pytest.mark.timeout(90)
def test_etcd_leader_kill_kills_the_leader_and_restarts_it_on_stop() -> None:
    with EtcdCluster(3, fsync=False) as etcd:
        leader = leader_of(etcd.endpoints)
        pids = [etcd.member_pid(i) for i in range(3)]
        inj = _injector("etcd-leader-kill", LoopbackTestbed(1, 1).up(), etcd=etcd)
        inj.start()
        try:
            assert getattr(inj, "detail", {}) == {"member": leader}
            assert etcd.member_pid(leader) is None
            assert all(etcd.member_pid(i) == pids[i] for i in range(3) if i != leader)
            others = tuple(e for i, e in enumerate(etcd.endpoints) if i != leader)

            def elected() -> bool:
                with contextlib.suppress(ChaosError):
                    return leader_of(others) >= 0
                return False

            assert _net.wait_for(elected, 30.0), "the two left elected no leader"
        finally:
            inj.stop()
        assert etcd.member_pid(leader) not in (None, pids[leader])


@pytest.mark.timeout(30)
def test_etcd_leader_kill_needs_three_members() -> None:
    with EtcdCluster(1, fsync=False) as etcd:
        inj = _injector("etcd-leader-kill", LoopbackTestbed(1, 1).up(), etcd=etcd)
        with pytest.raises(ChaosError, match="needs 3"):
            inj.start()
        assert etcd.member_pid(0) is not None
    with pytest.raises(ChaosError, match="no etcd cluster"):
        _injector("etcd-leader-kill", LoopbackTestbed(1, 1).up()).start()


def _ranks_track(end_step: int, *, done: bool) -> RankTrack:
    samples = [(1000.0 + 0.02 * s, s, 0) for s in range(end_step)]
    last = {"step": end_step - 1, "done": done, "params_sha256": "abc" if done else None}
    return RankTrack(samples=samples, last=last)


@pytest.mark.timeout(10)
def test_a_node_kill_report_leaves_its_ranks_out_and_keeps_its_detection() -> None:
    scenario = parse(
        '[job]\nscript = "t.py"\nnodes = 2\nranks_per_node = 2\nsteps = 100\nmin_ranks = 2\n'
        '[[fault]]\nkind = "node-kill"\nnode = 1\nat_step = 40\nmax_detect_ms = 500\n'
        '[[fault]]\nkind = "etcd-leader-kill"\nat_step = 40\nduration_s = 5.0\n'
        "[expect]\ncompletes = true\nparams_equal_across_ranks = true\n"
    )
    kill, leader = (
        FaultRecord(
            index=i,
            kind=f.kind,
            params=dict(f.params),
            at_step=40,
            at_s=None,
            duration_s=f.duration_s,
            fired_s=0.8 + i * 1e-4,
            fired_step=40,
            max_detect_ms=f.max_detect_ms,
        )
        for i, f in enumerate(scenario.faults)
    )
    leader.stopped_s = 5.8
    events = [
        # 50 ms after the kill, after the etcd fault fired: still the kill's detection.
        {"kind": "link.down", "rank": 0, "links": [[0, 3, 0]], "ts": 1000.85},
        {"kind": "epoch.changed", "epoch": 1, "members": [0, 1], "ts": 1003.0},
    ]
    progress = {r: _ranks_track(100 if r < 2 else 40, done=r < 2) for r in range(4)}
    facts = RunFacts(
        t0=1000.0, duration_s=10.0, exit_code=0, timed_out=False, faults=[kill, leader],
        progress=progress, events=events, reference=None,
    )  # fmt: skip
    report = build_report(scenario, facts)
    assert report["steps"]["left_out"] == [2, 3]
    assert report["faults"][0]["detected"] == "link.down"
    assert report["faults"][0]["detect_ms"] == pytest.approx(50.0, abs=1.0)
    assert report["passed"], report["expectations"]
