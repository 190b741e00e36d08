"""The NIC monitor: a rail's interface going down is reported within ~10 ms."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from resilient.detect.nic import NicMonitor, interface_of


def _wait_for(cond, timeout_s: float = 2.0) -> float:  # type: ignore[no-untyped-def]
    start = time.monotonic()
    while not cond():
        if time.monotonic() - start > timeout_s:
            raise AssertionError("condition not reached in time")
        time.sleep(0.002)
    return time.monotonic() - start


@pytest.mark.timeout(10)
def test_changes_of_operstate_reach_the_callbacks(tmp_path: Path) -> None:
    for name in ("eth7", "eth8"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "operstate").write_text("up\n")
    mon = NicMonitor(0, ["10.0.0.1", "10.0.1.1"], sysfs=tmp_path, interfaces=["eth7", "eth8"])
    seen: list[tuple[int, bool]] = []
    mon.on_change(lambda rail, up: seen.append((rail, up)))
    mon.start()
    try:
        (tmp_path / "eth8" / "operstate").write_text("lowerlayerdown\n")
        took = _wait_for(lambda: seen == [(1, False)])
        assert took < 0.5 and mon.up == [True, False]
        (tmp_path / "eth8" / "operstate").write_text("unknown\n")  # virtual NICs: up
        _wait_for(lambda: seen == [(1, False), (1, True)])
        # Up again, but not steady yet: no link is built on it for a while (a
        # flapping NIC); the other rail never went down.
        assert mon.up[1] and not mon.steady(1) and mon.steady(1, hold_s=0.0)
        assert mon.steady(0)
    finally:
        mon.stop()


@pytest.mark.timeout(10)
def test_loopback_rails_are_not_watched() -> None:
    assert interface_of("127.0.1.1") is None
    assert not NicMonitor(0, ["127.0.1.1", "127.0.2.1"]).start().watching


_CHILD = """
import json, sys, time
from resilient.detect.nic import NicMonitor
mon = NicMonitor(0, sys.argv[1:])
changes = []
mon.on_change(lambda rail, up: changes.append((rail, up, time.time())))
mon.start()
print(json.dumps(mon.interfaces), flush=True)
deadline = time.time() + 20
while time.time() < deadline and len(changes) < 2:
    time.sleep(0.01)
print(json.dumps(changes), flush=True)
"""


@pytest.mark.skipif(os.geteuid() != 0, reason="network namespaces need root")
@pytest.mark.timeout(60)
def test_a_real_nic_down_in_a_namespace_is_seen_within_100_ms() -> None:
    from chaos.testbed import NetnsTestbed

    tb = NetnsTestbed(1, 2).up()
    try:
        host = tb.hosts[0]
        child = subprocess.Popen(
            host.wrap([sys.executable, "-c", _CHILD, *host.rails]),
            stdout=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert child.stdout is not None
            assert json.loads(child.stdout.readline()) == ["r0", "r1"]
            time.sleep(0.2)
            down_at = time.time()
            subprocess.run(["ip", "-n", str(host.netns), "link", "set", "r1", "down"], check=True)
            time.sleep(0.3)
            subprocess.run(["ip", "-n", str(host.netns), "link", "set", "r1", "up"], check=True)
            changes = json.loads(child.stdout.readline())
        finally:
            child.kill()
            child.wait(10)
        assert [(rail, up) for rail, up, _ in changes] == [(1, False), (1, True)]
        assert changes[0][2] - down_at < 0.1
    finally:
        tb.down()
