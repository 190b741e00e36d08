"""The testbeds: netns hosts reach each other on every rail and the control plane
reaches every host; down() and the sweep of dead owners leave nothing behind;
loopback rail addresses; bad sizes."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from chaos import testbed as testbed_mod
from chaos.testbed import LoopbackTestbed, NetnsTestbed, sweep_leftovers
from chaos.testbed import Testbed as AnyTestbed
from resilient.errors import ChaosError
from tests.chaos import _net

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture
def netns_2x2() -> Iterator[NetnsTestbed]:
    testbed = NetnsTestbed(2, 2)
    try:
        yield testbed.up()
    finally:
        testbed.down()


def _leftovers(testbed_id: str) -> tuple[list[str], list[str]]:
    """Namespaces and root-namespace links that still carry this testbed's id."""
    names = [n for n in _net.netns_names() if n.startswith(f"rsl-{testbed_id}-")]
    links = [n for n in _net.link_names() if n.startswith(f"rsl{testbed_id}")]
    return names, links


@pytest.mark.timeout(10)
@pytest.mark.parametrize("cls", [AnyTestbed, LoopbackTestbed, NetnsTestbed])
@pytest.mark.parametrize(("hosts", "rails"), [(0, 1), (1, 0), (-1, 1), (201, 1), (1, 9)])
def test_bad_sizes_are_rejected(cls: type[AnyTestbed], hosts: int, rails: int) -> None:
    with pytest.raises(ChaosError):
        cls(hosts, rails)


@pytest.mark.timeout(10)
def test_loopback_rails() -> None:
    with LoopbackTestbed(3, 2) as testbed:
        assert testbed.kind == "loopback" and testbed.switch_netns is None
        assert [h.rails for h in testbed.hosts] == [
            ("127.0.1.1", "127.0.2.1"),
            ("127.0.1.2", "127.0.2.2"),
            ("127.0.1.3", "127.0.2.3"),
        ]
        assert all(h.netns is None for h in testbed.hosts)
        # Nothing to wrap: hosts run in the current namespace.
        assert testbed.hosts[0].wrap(["true"]) == ["true"]
    assert testbed.hosts == ()


@_net.requires_root
@pytest.mark.timeout(30)
def test_hosts_reach_each_other_on_every_rail(netns_2x2: NetnsTestbed, procs: _net.Procs) -> None:
    h0, h1 = netns_2x2.hosts
    assert h0.rails == ("10.100.0.1", "10.101.0.1") and h1.rails == ("10.100.0.2", "10.101.0.2")
    for host in (h0, h1):
        _net.accept_server(procs, host)
    for rail in range(2):
        assert _net.tcp_connect(h0, h1.rails[rail], timeout_s=5.0) == "ok"
        assert _net.tcp_connect(h1, h0.rails[rail], timeout_s=5.0) == "ok"


@_net.requires_root
@pytest.mark.timeout(30)
def test_control_plane_reaches_every_host_and_back(
    netns_2x2: NetnsTestbed, procs: _net.Procs
) -> None:
    # etcd and the launcher stay in the root namespace: it must reach every host's
    # mgmt address, and every host must reach control_addr.
    for host in netns_2x2.hosts:
        _net.accept_server(procs, host)
        assert host.mgmt_addr.rsplit(".", 1)[0] == netns_2x2.control_addr.rsplit(".", 1)[0]
        assert _net.tcp_connect(None, host.mgmt_addr, timeout_s=5.0) == "ok"
    _net.accept_server(procs, None, netns_2x2.control_addr)
    for host in netns_2x2.hosts:
        assert _net.tcp_connect(host, netns_2x2.control_addr, timeout_s=5.0) == "ok"


@_net.requires_root
@pytest.mark.timeout(30)
def test_down_leaves_nothing_behind() -> None:
    testbed = NetnsTestbed(2, 3)
    try:
        testbed.up()
        names, links = _leftovers(testbed.id)
        assert sorted(names) == sorted(
            [testbed.switch_netns, testbed.host_netns(0), testbed.host_netns(1)]
        )
        assert len(links) == 1  # the root namespace's leg on the management bridge
        owner = testbed_mod._owner_dir() / f"{testbed.id}.json"
        assert json.loads(owner.read_text())["netns"] == [
            testbed.switch_netns,
            testbed.host_netns(0),
            testbed.host_netns(1),
        ]
    finally:
        testbed.down()
    assert _leftovers(testbed.id) == ([], [])
    assert not owner.exists()
    testbed.down()  # a second down() is harmless


# Builds a testbed, prints its id and waits to be killed: a run that cannot clean up.
_BUILD_AND_WAIT = """
import sys, time
from chaos.testbed import NetnsTestbed
t = NetnsTestbed(2, 1).up()
print(t.id, flush=True)
time.sleep(60)
"""


@_net.requires_root
@pytest.mark.timeout(60)
def test_sweep_removes_a_testbed_whose_owner_was_killed(netns_2x2: NetnsTestbed) -> None:
    child = subprocess.Popen(
        [sys.executable, "-c", _BUILD_AND_WAIT], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    orphan = ""
    try:
        orphan = _net.read_line(child, 30.0)
        assert len(_leftovers(orphan)[0]) == 3
    finally:
        _net.sigkill(child)
        assert child.stdout is not None
        child.stdout.close()
        if not orphan:  # the child died before it said which testbed it built
            sweep_leftovers()
    try:
        assert sweep_leftovers() >= 3
        assert _leftovers(orphan) == ([], [])
        assert not (testbed_mod._owner_dir() / f"{orphan}.json").exists()
        # The testbed of a live owner (this process) is kept.
        assert len(_leftovers(netns_2x2.id)[0]) == 3
    finally:
        sweep_leftovers()


@_net.requires_root
@pytest.mark.timeout(30)
def test_sweep_removes_a_testbed_whose_owner_pid_is_dead() -> None:
    testbed = NetnsTestbed(1, 1)
    try:
        testbed.up()
        owner = testbed_mod._owner_dir() / f"{testbed.id}.json"
        record = json.loads(owner.read_text())
        record["pid"] = _net.dead_pid()
        owner.write_text(json.dumps(record))
        # At least the switch and the one host (a crashed run elsewhere may add more).
        assert sweep_leftovers() >= 2
        assert _leftovers(testbed.id) == ([], [])
        assert not owner.exists()
    finally:
        testbed.down()


@_net.requires_root
@pytest.mark.timeout(30)
def test_concurrent_testbeds_get_distinct_ids_and_subnets() -> None:
    first, second = NetnsTestbed(1, 1), NetnsTestbed(1, 1)
    # Same random id for both: the second must draw another rather than take over
    # (and later delete) the first one's owner file.
    second._set_id(first.id)
    try:
        first.up()
        second.up()
        assert first.id != second.id
        assert first.control_addr != second.control_addr
        assert len(_leftovers(first.id)[0]) == 2 and len(_leftovers(second.id)[0]) == 2
    finally:
        second.down()
        first.down()
    assert _leftovers(first.id) == ([], []) and _leftovers(second.id) == ([], [])
