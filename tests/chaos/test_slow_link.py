"""The slow-link fault on a real netns testbed: one pair slowed on one rail, both
ways; the rank's other peers and the pair's other rail at full speed; undone on stop
(chaos.slow_link)."""

from __future__ import annotations

import pytest

from chaos import _sh
from chaos.injector_kinds import make_injector
from chaos.injectors import InjectionContext
from chaos.scenario import Fault
from chaos.testbed import LoopbackTestbed, NetnsTestbed
from resilient.errors import ChaosError
from tests.chaos import _net

pytestmark = pytest.mark.timeout(90)

MB = 1_000_000


def _no_pid(rank: int) -> int:
    raise AssertionError(f"a network fault asked for the pid of rank {rank}")


@_net.requires_root
def test_one_pair_on_one_rail_is_slowed_both_ways_until_stopped(
    netns_3x2: NetnsTestbed, procs: _net.Procs
) -> None:
    h0, h1, h2 = netns_3x2.hosts
    params = {"rank": 0, "peer": 1, "rail": 0, "rate_mbit": 100.0}
    slow = make_injector(
        Fault(kind="slow-link", at_s=0.0, params=params),
        InjectionContext(testbed=netns_3x2, pid_of=_no_pid),
    )
    slow.start()
    try:
        # 5 MB take ~0.4 s at 100 Mbit/s: long enough that the tbf burst does not count.
        assert 70.0 <= _net.throughput_mbit(procs, h0, h1, 0, 5 * MB) <= 110.0
        assert 70.0 <= _net.throughput_mbit(procs, h1, h0, 0, 5 * MB) <= 110.0
        # The rank's other peer, and the pair's other rail, are not slowed.
        assert _net.throughput_mbit(procs, h0, h2, 0, 5 * MB) > 300.0
        assert _net.throughput_mbit(procs, h2, h0, 0, 5 * MB) > 300.0
        assert _net.throughput_mbit(procs, h1, h0, 1, 5 * MB) > 300.0
    finally:
        slow.stop()
    for ns in (str(h0.netns), netns_3x2.switch_netns):
        assert "htb" not in _sh.run(["tc", "-n", ns, "qdisc", "show"])
    assert _net.throughput_mbit(procs, h1, h0, 0, 5 * MB) > 300.0


@_net.requires_root
@pytest.mark.parametrize(
    ("params", "why"),
    [
        ({"rank": 0, "peer": 0, "rail": 0, "rate_mbit": 10.0}, "two ranks"),
        ({"rank": 0, "peer": 5, "rail": 0, "rate_mbit": 10.0}, "peer=5"),
        ({"rank": 0, "peer": 1, "rail": 3, "rate_mbit": 10.0}, "rail=3"),
        ({"rank": 0, "peer": 1, "rail": 0, "rate_mbit": 0.0}, "rate_mbit"),
    ],
)
def test_a_link_that_does_not_exist_or_a_bad_rate_is_refused(
    netns_3x2: NetnsTestbed, params: dict[str, float], why: str
) -> None:
    slow = make_injector(
        Fault(kind="slow-link", at_s=0.0, params=params),
        InjectionContext(testbed=netns_3x2, pid_of=_no_pid),
    )
    with pytest.raises(ChaosError, match=why):
        slow.start()
    assert not slow.active


def test_the_loopback_testbed_says_it_needs_netns() -> None:
    fault = Fault(
        kind="slow-link", at_s=0.0, params={"rank": 0, "peer": 1, "rail": 0, "rate_mbit": 1.0}
    )
    ctx = InjectionContext(
        testbed=LoopbackTestbed(2, 1).up(), pid_of=_no_pid, control=lambda key, rec: None
    )
    with pytest.raises(ChaosError, match="netns testbed"):
        make_injector(fault, ctx)
