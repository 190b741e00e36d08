"""Cleanup of kernel state: ``resilient chaos --cleanup`` removes what dead owners left
(testbeds, root veths, qdiscs with our handle, iptables rules with our comment) and
nothing else; a process holding a testbed, or ``resilient chaos`` itself, removes
everything on SIGTERM.

The objects are real (root). The sweep runs on the machine's real owner records, as
every chaos run does: only objects of dead owners and our own test objects go.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from chaos import _sh, cleanup
from chaos.cleanup import QDISC_MAJOR, Leftover, owner_dir
from chaos.cli import run_command
from chaos.testbed import NetnsTestbed, sweep_leftovers
from tests.chaos import _kernel, _net

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def objects() -> Iterator[_kernel.Objects]:
    objs = _kernel.Objects()
    try:
        yield objs
    finally:
        objs.close()


def _testbed_left(testbed_id: str) -> list[str]:
    """Namespaces, root links and the owner record that still carry this testbed's id."""
    names = [n for n in _net.netns_names() if n.startswith(f"rsl-{testbed_id}-")]
    links = [n for n in _net.link_names() if n == f"rsl{testbed_id}m"]
    record = owner_dir() / f"{testbed_id}.json"
    return names + links + ([str(record)] if record.exists() else [])


def _orphan(testbed: NetnsTestbed) -> int:
    """Make ``testbed``'s owner record name a dead process, as after a SIGKILL."""
    path = owner_dir() / f"{testbed.id}.json"
    record = json.loads(path.read_text())
    record["pid"] = _net.dead_pid()
    path.write_text(json.dumps(record))
    return int(record["pid"])


def _cleanup_cli() -> tuple[int, list[str]]:
    done = subprocess.run(
        [sys.executable, "-m", "resilient", "chaos", "--cleanup"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=45,
        check=False,
    )
    return done.returncode, done.stdout.splitlines()


@_net.requires_root
@_net.requires_iptables
def test_cleanup_removes_what_dead_owners_left_and_nothing_else(
    objects: _kernel.Objects,
) -> None:
    tag, dead = objects.tag, _net.dead_pid()
    orphan, live = NetnsTestbed(1, 1), NetnsTestbed(1, 1)
    try:
        orphan.up()
        live.up()
        orphan_pid = _orphan(orphan)
        foreign_ns = objects.netns(f"{tag}-ns")
        stray_veth = objects.veth(f"rsl{os.urandom(2).hex()}m")  # our name, no record
        shaped, foreign_shaped = objects.veth(f"{tag}q"), objects.veth(f"{tag}f")
        _kernel.add_qdisc(shaped, f"{QDISC_MAJOR}:")
        _kernel.add_qdisc(foreign_shaped, "1:")
        qdisc_record = {"kind": "qdisc", "pid": dead, "dev": shaped}
        record = objects.record(f"qdisc-{shaped}.json", qdisc_record)
        drop = ["-s", "192.0.2.1/32", "-m", "comment", "--comment"]
        chain = objects.chain(
            [[*drop, f"rsl-{dead}", "-j", "DROP"], [*drop, f"rsl-{os.getpid()}", "-j", "DROP"],
             [*drop, f"{tag}-foreign", "-j", "DROP"], ["-s", "192.0.2.1/32", "-j", "DROP"]]
        )  # fmt: skip

        code, lines = _cleanup_cli()

        assert code == 0, lines
        assert f"removed netns {orphan.switch_netns} (owner pid {orphan_pid})" in lines
        assert f"removed link {stray_veth} (no owner record)" in lines
        assert f"removed qdisc {QDISC_MAJOR}: on {shaped} (owner pid {dead})" in lines
        assert any(f"--comment rsl-{dead}" in line for line in lines), lines
        assert _testbed_left(orphan.id) == []
        assert stray_veth not in _net.link_names()
        assert not _kernel.ours(shaped) and not record.exists()
        assert shaped in _net.link_names()  # the device is not ours: only its qdisc went
        assert _kernel.root_qdisc(foreign_shaped) == "htb 1:"
        assert foreign_ns in _net.netns_names()
        assert len(_testbed_left(live.id)) == 4  # switch, host, root veth, record
        rules = _kernel.chain_rules(chain)
        assert len(rules) == 3 and not any(f"rsl-{dead}" in r for r in rules), rules
    finally:
        live.down()
        orphan.down()


@_net.requires_root
def test_an_unreadable_record_is_skipped_and_live_testbeds_kept(objects: _kernel.Objects) -> None:
    testbed = NetnsTestbed(1, 1)
    try:
        testbed.up()
        bad = objects.record(f"{objects.tag}.json", {"pid": "not a pid"})
        sweep_leftovers()
        assert len(_testbed_left(testbed.id)) == 4 and bad.exists()
    finally:
        testbed.down()
    assert _testbed_left(testbed.id) == []


def test_force_counts_live_owners_as_dead() -> None:
    assert cleanup._Sweep(True, [], [], [], []).dead(os.getpid())
    assert not cleanup._Sweep(False, [], [], [], []).dead(os.getpid())
    assert str(Leftover("netns", "rsl-ab12-sw", None)) == "netns rsl-ab12-sw (no owner record)"


def test_cleanup_needs_root_and_a_scenario_needs_a_file(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setattr(_sh, "is_root", lambda: False)
    args = {"cleanup": True, "force": False, "scenario": None, "soak": None}
    assert run_command(argparse.Namespace(**args)) == 2
    assert "needs root" in capsys.readouterr().err
    assert run_command(argparse.Namespace(**{**args, "cleanup": False})) == 2
    both = {**args, "cleanup": False, "scenario": "x", "soak": 60.0}
    assert run_command(argparse.Namespace(**both)) == 2
    assert "a scenario file or --soak is needed, not both" in capsys.readouterr().err
    forced = {**args, "cleanup": False, "force": True, "scenario": "x"}
    assert run_command(argparse.Namespace(**forced)) == 2
    assert "--force needs --cleanup" in capsys.readouterr().err


# Holds a testbed under the same guard as `resilient chaos` and the benchmarks.
_HOLD_TESTBED = """
import time
from chaos.signals import SignalGuard
from chaos.testbed import NetnsTestbed
SignalGuard().install()
with NetnsTestbed(2, 1) as t:
    print(t.id, flush=True)
    time.sleep(60)
"""


@_net.requires_root
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_to_a_process_holding_a_testbed_leaves_nothing(sig: signal.Signals) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _HOLD_TESTBED], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    testbed_id = ""
    try:
        testbed_id = _net.read_line(child, 30.0)
        assert len(_testbed_left(testbed_id)) == 5  # switch, 2 hosts, root veth, record
        child.send_signal(sig)
        # An uncaught KeyboardInterrupt ends Python by SIGINT itself (returncode -2).
        assert child.wait(30.0) == (-sig if sig == signal.SIGINT else 128 + sig)
        assert _testbed_left(testbed_id) == []
    finally:
        _net.sigkill(child)
        assert child.stdout is not None
        child.stdout.close()
        sweep_leftovers()  # whatever the killed child left


# A rank that only waits: the run is stopped long before it would end.
_SLEEPER = "import time\ntime.sleep(120)\n"


def _owned_by(pid: int) -> str | None:
    """The id of the testbed whose owner record names ``pid``, if any yet."""
    for path in owner_dir().glob("*.json"):
        try:
            if json.loads(path.read_text()).get("pid") == pid:
                return path.stem
        except (OSError, ValueError, AttributeError):
            continue
    return None


@_net.requires_root
@pytest.mark.timeout(150)
def test_sigterm_to_resilient_chaos_in_its_reference_run_leaves_nothing(tmp_path: Path) -> None:
    script = tmp_path / "sleeper.py"
    script.write_text(_SLEEPER)
    scenario = tmp_path / "scenario.toml"
    scenario.write_text(
        f'name = "cleanup"\n[job]\nscript = "{script}"\nnproc = 2\nrails = 1\nsteps = 10\n'
        'topology = "netns"\ntimeout_s = 120.0\n[expect]\nparams_equal_fault_free = true\n'
    )
    out = tmp_path / "out"
    proc = subprocess.Popen(
        [sys.executable, "-m", "resilient", "chaos", str(scenario), "--out", str(out),
         "--no-cache", "--quiet"],
        cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        start_new_session=True,
    )  # fmt: skip
    testbed_id: str | None = None
    try:
        # The ranks of the fault-free reference run are up: the launcher holds the
        # signal handlers now, and the run must not go on to the faulty run after it.
        ref_logs = out / "reference" / "logs"
        assert _net.wait_for(lambda: len(list(ref_logs.glob("rank*.log"))) >= 2, 90.0, 0.2)
        testbed_id = _owned_by(proc.pid)
        assert testbed_id is not None and len(_testbed_left(testbed_id)) == 5
        time.sleep(1.0)
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=60)
        assert proc.returncode == 143, stderr[-2000:]
        assert _testbed_left(testbed_id) == []
        assert not (out / "logs").exists()  # the faulty run never started
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate(timeout=30)
        sweep_leftovers()
