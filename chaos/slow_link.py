"""The ``slow-link`` fault: one link (a rank and one peer, on one rail) throttled,
every other link of both at full speed.

``throttle`` shapes a whole rail of a host: every peer sees the rank slow there.
A slow link is narrower, a bad cable or an overloaded switch port between two
hosts. Both directions are shaped, on the rank's side of the cable: what the rank's
interface sends to the peer's address, and what the switch port towards the rank
sends from it. Each device gets an ``htb`` qdisc that sends what no filter picks
unshaped, and one class at ``rate_mbit`` that a u32 filter sends only the peer's
packets to.
"""

from __future__ import annotations

from chaos import _sh
from chaos.injectors import Injector
from resilient.errors import ChaosError

__all__ = ["SlowLink"]


class SlowLink(Injector):
    """A tbf at ``rate_mbit`` between ``rank`` and ``peer`` on ``rail``, both ways."""

    def _devices(self) -> list[tuple[str, str, str]]:
        """(namespace, device, match) per direction: the rank's egress to the peer, the
        switch port's egress from it."""
        host, iface = self._rail_iface()
        peer = self._host("peer")
        if peer.index == host.index:
            raise ChaosError(f"{self.description}: a link needs two ranks")
        rail = int(self.fault.param("rail"))
        addr = peer.rails[rail]
        return [
            (str(host.netns), iface, f"dst {addr}/32"),
            (str(self.ctx.testbed.switch_netns), host.switch_ports[rail], f"src {addr}/32"),
        ]

    def _check(self) -> None:
        super()._check()
        _sh.require_tool("tc", "install iproute2")
        if float(self.fault.param("rate_mbit")) <= 0:
            raise ChaosError("slow-link: rate_mbit must be > 0")
        self._devices()

    def _start(self) -> None:
        rate = float(self.fault.param("rate_mbit"))
        burst = max(16 * 1024, int(rate * 1e6 / 8 / 1000))  # ~1 ms at the rate, as throttle
        for ns, dev, match in self._devices():
            tc = ["tc", "-n", ns]
            # htb's default class 0: what no filter picks goes out unshaped.
            _sh.run([*tc, "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb"])
            limit = ["rate", f"{rate}mbit", "ceil", f"{rate}mbit", "burst", str(burst)]
            _sh.run([*tc, "class", "add", "dev", dev, "parent", "1:", "classid", "1:20", "htb",
                     *limit])  # fmt: skip
            _sh.run([*tc, "filter", "add", "dev", dev, "parent", "1:", "protocol", "ip", "prio",
                     "1", "u32", "match", "ip", *match.split(), "flowid", "1:20"])  # fmt: skip

    def _stop(self) -> None:
        for ns, dev, _ in self._devices():
            _sh.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)
