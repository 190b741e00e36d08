"""`resilient chaos` with `[job] nodes`: one `resilient run` agent per testbed host.

The shipped node-loss-shrink scenario (2 nodes x 2 ranks, node 1 killed whole at
step 40, the survivors shrink to 2 ranks) and etcd-leader-loss-during-recovery (the
same, with the etcd leader of three killed at once) and node-loss-spare (a spare
node takes node 1 over, bitwise equal to the fault-free run) must pass, and a run interrupted with
SIGINT while the agents train must leave no agent, rank or namespace behind.
Those need root (the netns testbed; CI runs as root); a node kill on the loopback
testbed runs anywhere.
"""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from chaos.cleanup import PREFIX

ROOT = Path(__file__).resolve().parents[2]
SHRINK = ROOT / "examples" / "scenarios" / "node-loss-shrink.toml"
LEADER = ROOT / "examples" / "scenarios" / "etcd-leader-loss-during-recovery.toml"
SPARE = ROOT / "examples" / "scenarios" / "node-loss-spare.toml"
needs_root = pytest.mark.skipif(os.geteuid() != 0, reason="the netns testbed needs root")


def _chaos(scenario: Path, out: Path, *extra: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "resilient", "chaos", str(scenario), "--out", str(out), *extra],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
        cwd=str(ROOT),
    )  # fmt: skip


def _finish(proc: subprocess.Popen[str], timeout_s: float) -> tuple[int, str, str]:
    try:
        out, err = proc.communicate(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        pytest.fail(f"resilient chaos did not finish in {timeout_s} s:\n{err[-3000:]}")
    return proc.returncode, out, err


def _processes_of(out: Path) -> list[str]:
    """Live processes whose command line or environment names ``out``: the agents
    (``--log-dir``) and their ranks (``RESILIENT_RUN_DIR``)."""
    found = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            cmd = Path("/proc", entry, "cmdline").read_bytes().replace(b"\0", b" ").decode()
            cmd += Path("/proc", entry, "environ").read_bytes().decode(errors="replace")
            state = Path("/proc", entry, "stat").read_text().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if str(out) in cmd and state != "Z":
            found.append(f"{entry}: {cmd}")
    return found


def _testbed_namespaces(stderr: str) -> list[str]:
    found = re.search(rf"testbed netns ({PREFIX}[0-9a-f]+)-\*", stderr)
    assert found, stderr[-2000:]
    listed = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=False)
    return [n for n in listed.stdout.split() if n.startswith(found.group(1) + "-")]


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


@needs_root
@pytest.mark.timeout(330)
@pytest.mark.parametrize("scenario", [SHRINK, LEADER, SPARE], ids=lambda p: p.stem)
def test_node_loss_scenario_passes(scenario: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    code, stdout, stderr = _finish(_chaos(scenario, out, "--json", "--quiet"), 300)
    report: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
    logs = "".join(
        f"\n--- {log.name}:\n" + "\n".join(log.read_text().splitlines()[-20:])
        for log in sorted((out / "logs").glob("*.log"))
    )
    failed = [row for row in report["expectations"] if not row["passed"]]
    if code != 0 or not report["passed"]:
        pytest.fail(f"exit {code}; failed: {failed}\n{stderr[-2000:]}{logs[-6000:]}")
    # With a spare node, ranks 2 and 3 come back on it; else the job shrinks to 0 and 1.
    spare = scenario == SPARE
    assert report["steps"]["left_out"] == ([] if spare else [2, 3])
    trained = range(4) if spare else range(2)
    assert [report["steps"]["completed"][str(r)] for r in trained] == [200] * len(trained)
    fault, *more = report["faults"]
    assert fault["kind"] == "node-kill" and fault["error"] is None
    # The agent, its two ranks (and their helpers) went in one kill; none is left.
    killed = fault["detail"]["killed_pids"]
    assert killed[0] == fault["detail"]["agent_pid"] and len(killed) >= 3
    assert not [pid for pid in killed if _alive(pid)]
    assert fault["detected"] in ("link.down", "rank.lost"), fault
    for other in more:  # the etcd leader, killed while the survivors recover
        assert other["kind"] == "etcd-leader-kill" and other["error"] is None, other
        assert other["detail"]["member"] in (0, 1, 2) and other["stopped_s"] is not None
    assert _testbed_namespaces(stderr) == []
    assert _processes_of(out) == []


@pytest.mark.timeout(200)
def test_node_kill_on_the_loopback_testbed_needs_no_root(tmp_path: Path) -> None:
    """The same job and kill with the agents in the root namespace, loopback rails."""
    scenario = tmp_path / "loopback.toml"
    text = SHRINK.read_text().replace('topology = "netns"', 'topology = "loopback"')
    scenario.write_text(text.replace('"examples/train_ddp.py"', f'"{ROOT}/examples/train_ddp.py"'))
    out = tmp_path / "out"
    code, stdout, stderr = _finish(_chaos(scenario, out, "--json", "--quiet"), 170)
    report: dict[str, Any] = json.loads(stdout.strip().splitlines()[-1])
    failed = [row for row in report["expectations"] if not row["passed"]]
    assert code == 0 and report["passed"], f"{failed}\n{stderr[-3000:]}"
    assert report["topology"] == "loopback" and report["steps"]["left_out"] == [2, 3]
    assert _processes_of(out) == []


@needs_root
@pytest.mark.timeout(200)
def test_sigint_while_node_agents_train_leaves_nothing_behind(tmp_path: Path) -> None:
    scenario = tmp_path / "long.toml"
    text = SHRINK.read_text().replace("steps = 200", "steps = 5000")
    text = text[: text.index("[[fault]]")] + text[text.index("[expect]") :]  # no fault
    scenario.write_text(text.replace('"examples/train_ddp.py"', f'"{ROOT}/examples/train_ddp.py"'))
    out = tmp_path / "out"
    proc = _chaos(scenario, out, "--quiet")
    try:
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline and len(list((out / "logs").glob("rank*.log"))) < 4:
            assert proc.poll() is None, proc.communicate()[1][-3000:]
            time.sleep(0.2)
        assert len(_processes_of(out)) >= 2, "the agents never started"
        time.sleep(2.0)  # the ranks import torch and meet
    finally:
        os.kill(proc.pid, signal.SIGINT)
    code, _, stderr = _finish(proc, 90)
    assert code == 130, stderr[-3000:]
    assert _processes_of(out) == []
    assert _testbed_namespaces(stderr) == []
