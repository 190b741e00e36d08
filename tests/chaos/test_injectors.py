"""Every injector has its real effect, measured from outside, and stop() undoes it:
throttled throughput, a dead link, flaps, killed/stopped/slowed processes, lost
datagrams, a partition on one rail only, a killed etcd member."""

from __future__ import annotations

import os
import signal
import time
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import pytest

from chaos import _sh
from chaos.injector_kinds import make_injector
from chaos.injectors import Flap, InjectionContext, Injector
from chaos.scenario import Fault
from chaos.testbed import LoopbackTestbed, NetnsTestbed
from chaos.testbed import Testbed as AnyTestbed
from membership import EtcdCluster
from membership.etcd_client import EtcdClient
from resilient.config import EtcdConfig
from resilient.errors import ChaosError
from tests.chaos import _net

MB = 1_000_000


def _no_pid(rank: int) -> int:
    raise AssertionError(f"a network fault asked for the pid of rank {rank}")


class Injectors:
    """Builds injectors and stops every one of them at teardown, even after a failure."""

    def __init__(self) -> None:
        self._made: list[Injector] = []

    def make(
        self,
        kind: str,
        testbed: AnyTestbed,
        params: Mapping[str, Any],
        *,
        pid_of: Callable[[int], int] = _no_pid,
        etcd: EtcdCluster | None = None,
    ) -> Injector:
        ctx = InjectionContext(testbed=testbed, pid_of=pid_of, etcd=etcd)
        injector = make_injector(Fault(kind=kind, at_s=0.0, params=dict(params)), ctx)
        self._made.append(injector)
        return injector

    def stop_all(self) -> None:
        errors: list[Exception] = []
        for injector in reversed(self._made):
            try:
                injector.stop()
            except Exception as exc:  # stop the others first, then fail
                errors.append(exc)
        if errors:
            raise errors[0]


@pytest.fixture
def injectors() -> Iterator[Injectors]:
    made = Injectors()
    try:
        yield made
    finally:
        made.stop_all()


def _qdiscs(netns: str) -> str:
    return _sh.run(["tc", "-n", netns, "qdisc", "show"])


def _iptables_rules(netns: str) -> list[str]:
    """The rules of the namespace's filter table (``iptables -S`` minus the policies)."""
    out = _sh.run(_sh.in_netns(netns, ["iptables", "-w", "5", "-S"]))
    return [line for line in out.splitlines() if not line.startswith("-P ")]


# -- network faults ------------------------------------------------------------------


@_net.requires_root
@pytest.mark.timeout(60)
def test_throttle_limits_both_directions_until_stopped(
    netns_2x2: NetnsTestbed, procs: _net.Procs, injectors: Injectors
) -> None:
    h0, h1 = netns_2x2.hosts
    throttle = injectors.make("throttle", netns_2x2, {"rank": 1, "rail": 0, "rate_mbit": 100.0})
    throttle.start()
    assert "tbf" in _qdiscs(str(h1.netns)) and "tbf" in _qdiscs(netns_2x2.switch_netns)
    # 5 MB take ~0.4 s at 100 Mbit/s: long enough that the tbf burst does not count.
    to_rank1 = _net.throughput_mbit(procs, h0, h1, 0, 5 * MB)
    from_rank1 = _net.throughput_mbit(procs, h1, h0, 0, 5 * MB)
    assert 70.0 <= to_rank1 <= 110.0
    assert 70.0 <= from_rank1 <= 110.0
    # The other rail of the same host is not throttled.
    assert _net.throughput_mbit(procs, h0, h1, 1, 5 * MB) > 300.0

    throttle.stop()
    assert "tbf" not in _qdiscs(str(h1.netns))
    assert "tbf" not in _qdiscs(netns_2x2.switch_netns)
    assert _net.throughput_mbit(procs, h0, h1, 0, 5 * MB) > 300.0
    assert _net.throughput_mbit(procs, h1, h0, 0, 5 * MB) > 300.0


def _wait_operstate(netns: str, iface: str, states: set[str], timeout_s: float) -> float:
    """Seconds until ``iface`` is in one of ``states``; fails after ``timeout_s``."""
    t0 = time.monotonic()
    seen: list[str] = []

    def reached() -> bool:
        seen.append(_net.operstate(netns, iface))
        return seen[-1] in states

    assert _net.wait_for(reached, timeout_s, interval_s=0.01), (
        f"{iface} in {netns} stayed {seen[-1]!r}, wanted one of {sorted(states)}"
    )
    return time.monotonic() - t0


@_net.requires_root
@pytest.mark.timeout(60)
def test_nic_down_cuts_one_rail_until_stopped(
    netns_2x2: NetnsTestbed, procs: _net.Procs, injectors: Injectors
) -> None:
    h0, h1 = netns_2x2.hosts
    sw, port = netns_2x2.switch_netns, h1.switch_ports[0]
    _net.accept_server(procs, h1)
    assert _net.operstate(sw, port) == "up"
    assert _net.tcp_connect(h0, h1.rails[0], timeout_s=5.0) == "ok"

    nic_down = injectors.make("nic-down", netns_2x2, {"rank": 1, "rail": 0})
    nic_down.start()
    # The switch sees the cable die: what a real peer's link detection would see.
    assert _wait_operstate(sw, port, {"down", "lowerlayerdown"}, 5.0) < 1.0
    assert _net.tcp_connect(h0, h1.rails[0], timeout_s=1.0) != "ok"
    assert _net.tcp_connect(h0, h1.rails[1], timeout_s=5.0) == "ok"

    nic_down.stop()
    _wait_operstate(sw, port, {"up"}, 5.0)
    assert _net.tcp_connect(h0, h1.rails[0], timeout_s=5.0) == "ok"


@_net.requires_root
@pytest.mark.timeout(60)
def test_flap_takes_the_link_down_and_up_count_times(
    netns_2x2: NetnsTestbed, procs: _net.Procs, injectors: Injectors
) -> None:
    h1 = netns_2x2.hosts[1]
    period_s, count = 0.2, 3
    # Records every state change of the host's rail 0 while the flaps run (~0.6 s).
    watch = _net.watch_operstate(procs, h1, h1.rail_ifaces[0])
    flap = injectors.make(
        "flap", netns_2x2, {"rank": 1, "rail": 0, "period_s": period_s, "count": count}
    )
    assert isinstance(flap, Flap)  # for its flap counter
    flap.start()
    assert _net.wait_for(lambda: flap.flaps == count, 10.0)
    time.sleep(2 * period_s)  # the last up, and time for a flap too many to show
    assert flap.flaps == count
    states = _net.operstate_changes(watch)
    # Up, then (not up, up) once per flap; "not up" may pass through several states.
    is_up = [state == "up" for state in states]
    runs = [up for i, up in enumerate(is_up) if i == 0 or up != is_up[i - 1]]
    assert runs == [True] + [False, True] * count, states
    assert _net.operstate(str(h1.netns), h1.rail_ifaces[0]) == "up"
    flap.stop()
    assert _net.operstate(str(h1.netns), h1.rail_ifaces[0]) == "up"


@_net.requires_root
@_net.requires_iptables
@pytest.mark.timeout(60)
def test_drop_loses_about_percent_of_datagrams_until_stopped(
    netns_2x2: NetnsTestbed, procs: _net.Procs, injectors: Injectors
) -> None:
    h0, h1 = netns_2x2.hosts
    sent = 400
    drop = injectors.make("drop", netns_2x2, {"rank": 1, "rail": 0, "percent": 50.0})
    drop.start()
    # Only the INPUT rule of rank 1 acts on this direction: ~half arrive (binomial,
    # sd 2.5 %, so the bounds never flake).
    got = _net.udp_delivered(procs, h0, h1, 0, sent)
    assert 0.1 * sent < got < 0.8 * sent
    # The other rail loses nothing.
    assert _net.udp_delivered(procs, h0, h1, 1, sent) >= 0.98 * sent

    drop.stop()
    assert _iptables_rules(str(h1.netns)) == []
    assert _net.udp_delivered(procs, h0, h1, 0, sent) >= 0.98 * sent


@_net.requires_root
@_net.requires_iptables
@pytest.mark.timeout(60)
def test_partition_blocks_one_pair_on_one_rail_until_stopped(
    netns_3x2: NetnsTestbed, procs: _net.Procs, injectors: Injectors
) -> None:
    h0, h1, h2 = netns_3x2.hosts
    for host in netns_3x2.hosts:
        _net.accept_server(procs, host)
    partition = injectors.make("partition", netns_3x2, {"rank": 1, "peer": 2, "rail": 0})
    partition.start()
    # Dropped packets: the connect neither succeeds nor is refused; it times out.
    assert _net.tcp_connect(h1, h2.rails[0], timeout_s=1.0) == "timeout"
    assert _net.tcp_connect(h2, h1.rails[0], timeout_s=1.0) == "timeout"
    assert _net.tcp_connect(h1, h2.rails[1], timeout_s=5.0) == "ok"
    assert _net.tcp_connect(h2, h1.rails[1], timeout_s=5.0) == "ok"
    assert _net.tcp_connect(h0, h1.rails[0], timeout_s=5.0) == "ok"
    assert _net.tcp_connect(h1, h0.rails[0], timeout_s=5.0) == "ok"
    assert _net.tcp_connect(h0, h2.rails[0], timeout_s=5.0) == "ok"

    partition.stop()
    assert _iptables_rules(str(h1.netns)) == []
    assert _net.tcp_connect(h1, h2.rails[0], timeout_s=5.0) == "ok"
    assert _net.tcp_connect(h2, h1.rails[0], timeout_s=5.0) == "ok"


_NETWORK_FAULTS: list[tuple[str, dict[str, Any]]] = [
    ("nic-down", {"rank": 0, "rail": 0}),
    ("nic-up", {"rank": 0, "rail": 0}),
    ("flap", {"rank": 0, "rail": 0, "period_s": 0.2, "count": 1}),
    ("throttle", {"rank": 0, "rail": 0, "rate_mbit": 100.0}),
    ("drop", {"rank": 0, "rail": 0, "percent": 50.0}),
    ("partition", {"rank": 0, "peer": 1, "rail": 0}),
]


@pytest.mark.timeout(10)
@pytest.mark.parametrize(("kind", "params"), _NETWORK_FAULTS)
def test_network_faults_need_the_netns_testbed(
    kind: str, params: dict[str, Any], injectors: Injectors
) -> None:
    with LoopbackTestbed(2, 1) as testbed:
        injector = injectors.make(kind, testbed, params)
        with pytest.raises(ChaosError):
            injector.start()
        # Nothing was injected, so there is nothing to undo (and stop() does not fail).
        assert not injector.active
        injector.stop()


@_net.requires_root
@pytest.mark.timeout(30)
@pytest.mark.parametrize(
    ("kind", "params"),
    [
        ("nic-down", {"rank": 2, "rail": 0}),
        ("nic-down", {"rank": -1, "rail": 0}),
        ("nic-down", {"rank": 0, "rail": 2}),
        ("flap", {"rank": 0, "rail": 0, "period_s": 0.0}),
        ("throttle", {"rank": 0, "rail": 0, "rate_mbit": 0.0}),
        ("partition", {"rank": 0, "peer": 0, "rail": 0}),
        ("partition", {"rank": 0, "peer": 5, "rail": 0}),
    ],
)
def test_network_faults_on_what_does_not_exist_are_rejected(
    kind: str, params: dict[str, Any], netns_2x2: NetnsTestbed, injectors: Injectors
) -> None:
    injector = injectors.make(kind, netns_2x2, params)
    with pytest.raises(ChaosError):
        injector.start()
    assert not injector.active


@pytest.mark.timeout(10)
def test_unknown_kind_is_rejected() -> None:
    ctx = InjectionContext(testbed=LoopbackTestbed(1, 1).up(), pid_of=_no_pid)
    with pytest.raises(ChaosError):
        make_injector(Fault(kind="meteor-strike", at_s=0.0, params={}), ctx)


# -- process faults ------------------------------------------------------------------


@pytest.fixture
def loopback() -> LoopbackTestbed:
    return LoopbackTestbed(2, 1).up()


@pytest.mark.timeout(30)
def test_kill_sigkills_the_rank(
    loopback: LoopbackTestbed, procs: _net.Procs, injectors: Injectors
) -> None:
    # Its own session, as ranks run: the pid is the process group the injector signals.
    sleeper = procs.spawn(["sleep", "60"], new_session=True)
    kill = injectors.make("kill", loopback, {"rank": 1}, pid_of=lambda rank: sleeper.pid)
    kill.start()
    assert sleeper.wait(10.0) == -signal.SIGKILL
    assert not kill.active  # nothing to undo
    # The rank is gone now: a second kill says so.
    with pytest.raises(ChaosError):
        injectors.make("kill", loopback, {"rank": 1}, pid_of=lambda rank: sleeper.pid).start()


@pytest.mark.timeout(30)
def test_hang_stops_progress_until_stopped(
    loopback: LoopbackTestbed, procs: _net.Procs, injectors: Injectors, tmp_path: Path
) -> None:
    ticker, ticks = _net.start_ticker(procs, tmp_path / "ticks")
    hang = injectors.make("hang", loopback, {"rank": 0}, pid_of=lambda rank: ticker.pid)
    hang.start()
    time.sleep(0.1)  # SIGSTOP is asynchronous: let a tick already under way land
    frozen = ticks()
    time.sleep(0.5)
    assert ticks() == frozen
    assert ticker.poll() is None  # stopped, not dead

    hang.stop()
    assert _net.wait_for(lambda: ticks() > frozen + 10, 5.0)


@pytest.mark.timeout(30)
def test_slow_runs_the_rank_a_fraction_of_the_time_until_stopped(
    loopback: LoopbackTestbed, procs: _net.Procs, injectors: Injectors, tmp_path: Path
) -> None:
    ticker, ticks = _net.start_ticker(procs, tmp_path / "ticks")
    free = _net.tick_rate(ticks, 1.0)
    assert free > 100.0, "the ticker is too slow to measure anything"
    slow = injectors.make(
        "slow", loopback, {"rank": 0, "factor": 0.25}, pid_of=lambda rank: ticker.pid
    )
    slow.start()
    slowed = _net.tick_rate(ticks, 1.0)
    # Runs 25 ms of every 100 ms; loose bounds, as a loaded machine stretches both.
    assert 0.1 * free < slowed < 0.5 * free, (free, slowed)

    slow.stop()
    assert ticker.poll() is None
    assert _net.tick_rate(ticks, 0.5) > 0.7 * free


@pytest.mark.timeout(30)
def test_a_pinned_slow_spares_the_process_that_replaces_the_rank(
    loopback: LoopbackTestbed, procs: _net.Procs, injectors: Injectors, tmp_path: Path
) -> None:
    first, first_ticks = _net.start_ticker(procs, tmp_path / "first")
    second, second_ticks = _net.start_ticker(procs, tmp_path / "second")
    rank_pid = {"now": first.pid}
    slow = injectors.make(
        "slow", loopback, {"rank": 0, "factor": 0.25, "pin": True},
        pid_of=lambda rank: rank_pid["now"],
    )  # fmt: skip
    slow.start()
    rank_pid["now"] = second.pid  # the rank was handed to another process
    full = _net.tick_rate(second_ticks, 1.0)
    slowed = _net.tick_rate(first_ticks, 1.0)
    assert slowed < 0.5 * full, (slowed, full)
    # The pinned process ends: the injector ends with it, without an error, and
    # never stopped the replacement.
    first.kill()
    first.wait(5.0)
    assert slow._thread is not None
    slow._thread.join(5.0)
    assert not slow._thread.is_alive() and slow.error is None
    assert _net.tick_rate(second_ticks, 0.5) > 0.7 * full
    slow.stop()


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("kind", "params"),
    [("kill", {"rank": 0}), ("hang", {"rank": 0}), ("slow", {"rank": 0, "factor": 0.5})],
)
def test_process_faults_on_a_gone_rank_are_rejected(
    kind: str, params: dict[str, Any], loopback: LoopbackTestbed, injectors: Injectors
) -> None:
    gone = _net.dead_pid()
    injector = injectors.make(kind, loopback, params, pid_of=lambda rank: gone)
    with pytest.raises(ChaosError):
        injector.start()


@pytest.mark.timeout(10)
@pytest.mark.parametrize("factor", [0.0, 1.0, 1.5, -0.2])
def test_slow_rejects_a_factor_outside_0_1(
    factor: float, loopback: LoopbackTestbed, procs: _net.Procs, injectors: Injectors
) -> None:
    sleeper = procs.spawn(["sleep", "60"], new_session=True)
    slow = injectors.make(
        "slow", loopback, {"rank": 0, "factor": factor}, pid_of=lambda rank: sleeper.pid
    )
    with pytest.raises(ChaosError):
        slow.start()
    assert not slow.active


# -- etcd faults ---------------------------------------------------------------------


@pytest.fixture
def etcd3() -> Iterator[EtcdCluster]:
    cluster = EtcdCluster(3, fsync=False)
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def _client(endpoint: str) -> EtcdClient:
    # A budget well above an election (~1-2 s) after the leader was killed.
    return EtcdClient(EtcdConfig(endpoints=(endpoint,), request_timeout_s=1.0, retry_budget_s=20.0))


def _healthy(endpoint: str) -> bool:
    with urllib.request.urlopen(f"{endpoint}/health", timeout=2.0) as resp:
        return b'"true"' in resp.read()


@pytest.mark.timeout(90)
def test_etcd_kill_kills_one_member_and_restarts_it_on_stop(
    etcd3: EtcdCluster, loopback: LoopbackTestbed, injectors: Injectors
) -> None:
    pid = etcd3.member_pid(1)
    assert pid is not None
    etcd_kill = injectors.make("etcd-kill", loopback, {"member": 1}, etcd=etcd3)
    etcd_kill.start()
    assert etcd3.member_pid(1) is None
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)
    # Two of three members are a quorum: each survivor serves (once they elected a
    # new leader, if member 1 led). One client per survivor, because a client given
    # all three endpoints can stay stuck on the dead one (pyetcd's failover only
    # leaves an endpoint within time_retry of its last failure).
    for survivor in (0, 2):
        client = _client(etcd3.endpoints[survivor])
        try:
            client.put(f"/chaos/k{survivor}", "during")
            kv = client.get(f"/chaos/k{survivor}")
            assert kv is not None and kv.value == b"during"
        finally:
            client.close()

    etcd_kill.stop()
    assert etcd3.member_pid(1) not in (None, pid)
    assert _healthy(etcd3.endpoints[1])
    # The restarted member caught up with what was written while it was down.
    only_1 = _client(etcd3.endpoints[1])
    try:
        for survivor in (0, 2):
            kv = only_1.get(f"/chaos/k{survivor}")
            assert kv is not None and kv.value == b"during"
    finally:
        only_1.close()


@pytest.mark.timeout(10)
@pytest.mark.parametrize("member", [3, -1])
def test_etcd_kill_of_a_member_that_does_not_exist_is_rejected(
    member: int, loopback: LoopbackTestbed, injectors: Injectors
) -> None:
    cluster = EtcdCluster(3, fsync=False)  # never started: only its size matters
    try:
        etcd_kill = injectors.make("etcd-kill", loopback, {"member": member}, etcd=cluster)
        with pytest.raises(ChaosError):
            etcd_kill.start()
        assert not etcd_kill.active
    finally:
        cluster.stop()


@pytest.mark.timeout(10)
def test_etcd_kill_without_a_cluster_is_rejected(
    loopback: LoopbackTestbed, injectors: Injectors
) -> None:
    etcd_kill = injectors.make("etcd-kill", loopback, {"member": 0})
    with pytest.raises(ChaosError):
        etcd_kill.start()
    assert not etcd_kill.active
