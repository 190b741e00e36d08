"""Fault injectors: each makes one real fault happen and can undo it.

An injector's ``start()`` injects the fault and ``stop()`` undoes it (idempotent,
safe after a failed start); ``kill`` and ``nic-up`` have nothing to undo. Process
faults act on the rank's pid (its process group: ranks run in their own session);
network faults act on the host's namespaces of a :class:`~chaos.testbed.NetnsTestbed`:

=========== ===================================================================
kill        SIGKILL the rank
hang        SIGSTOP the rank; SIGCONT on stop
slow        SIGSTOP/SIGCONT duty cycle: runs ``factor`` of every 100 ms; it
            follows the rank to a replacement (a slow node restarted in place)
            unless ``pin`` (the process found at start only, as a slow node whose
            rank is replaced elsewhere); a pinned process that is gone ends it
slow-cpu    a cgroup CPU quota of ``factor`` times the CPUs the rank used (measured
            over 0.2 s at start, or ``cpus``): it keeps running, slower (a slow
            node); follows the rank to a replacement unless ``pin``, as ``slow``;
            it counts as fired once the rank is in the cgroup, after that measurement
nic-down    ``ip link set rJ down`` in the host; up again on stop
nic-up      ``ip link set rJ up``
flap        down/up every ``period_s`` (half each), ``count`` times or until stopped
throttle    tbf at ``rate_mbit`` on both directions of the host's rail J
slow-link   the same between the rank and ``peer`` on rail J only
            (:mod:`chaos.slow_link`)
drop        iptables DROP of ``percent`` % of the packets in and out of rail J
partition   iptables DROP between the rank and ``peer`` on rail J only
            (both rules live in the host's namespace, tagged ``rsl-<pid>``)
etcd-kill   SIGKILL one etcd member (``member``, default 0); restarted on stop
=========== ===================================================================

:func:`chaos.injector_kinds.make_injector` builds the injector of a
:class:`~chaos.scenario.Fault`, from these or the loopback testbed's records.
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from chaos import _sh
from chaos.cleanup import rule_comment
from chaos.cpu_throttle import CpuQuota, cpu_root, measure_cpus
from chaos.scenario import Fault
from chaos.testbed import Host, Testbed
from resilient.errors import ChaosError

if TYPE_CHECKING:
    from membership.server import EtcdCluster

__all__ = ["NETNS_KINDS", "Flap", "InjectionContext", "Injector", "needs_netns"]

logger = logging.getLogger(__name__)

SLOW_PERIOD_S: Final = 0.1
_IPTABLES_HINT: Final = "install it (apt-get install -y iptables)"


@dataclass(frozen=True, kw_only=True, slots=True)
class InjectionContext:
    """What injectors act on: the testbed, the current pid of a rank, the etcd cluster."""

    testbed: Testbed
    pid_of: Callable[[int], int]
    etcd: EtcdCluster | None = None
    # Writes (None: deletes) an in-process fault record for the ranks' fault hook;
    # how network faults reach ranks on the loopback testbed.
    control: Callable[[str, Mapping[str, Any] | None], None] | None = None
    # The pid of node K's agent (``resilient run``), where the job runs node agents;
    # raises ChaosError when that agent is not running.
    agent_pid: Callable[[int], int] | None = None


class Injector:
    """One fault; subclasses implement ``_start`` and optionally ``_check``, ``_stop``."""

    def __init__(self, fault: Fault, ctx: InjectionContext) -> None:
        self.fault, self.ctx = fault, ctx
        self.active = False

    @property
    def description(self) -> str:
        params = ", ".join(f"{k}={v}" for k, v in sorted(self.fault.params.items()))
        return f"{self.fault.kind}({params})"

    def start(self) -> None:
        """Inject the fault. Raises ChaosError when it cannot be injected.

        A fault that cannot be injected at all (wrong testbed, a rank, rail or member
        that does not exist, a bad parameter) raises before anything is done and leaves
        the injector inactive, so ``stop()`` has nothing to undo (and does not fail the
        same way again). A start that fails midway leaves it active, for ``stop()``.
        """
        self._check()
        self.active = True
        self._start()

    def stop(self) -> None:
        """Undo the fault (no-op if not active). Raises ChaosError when undoing fails."""
        if not self.active:
            return
        self.active = False
        self._stop()

    def _check(self) -> None:
        """Raise ChaosError if the fault cannot be injected here; changes nothing."""
        if needs_netns(self.fault):
            self._rail_iface()

    def _start(self) -> None:
        raise NotImplementedError

    def _stop(self) -> None:
        return None

    # -- helpers -------------------------------------------------------------------
    def _signal(self, sig: signal.Signals | None) -> int:
        """Send ``sig`` to the rank's process group (None: only check that it exists)."""
        rank = int(self.fault.param("rank"))
        pid = self.ctx.pid_of(rank)
        try:
            os.killpg(pid, 0 if sig is None else sig)
        except ProcessLookupError as exc:
            what = "signal it" if sig is None else f"send {sig.name}"
            raise ChaosError(f"rank {rank} (pid {pid}) is gone; cannot {what}") from exc
        return pid

    def _host(self, key: str = "rank") -> Host:
        if self.ctx.testbed.kind != "netns":
            raise ChaosError(
                f"{self.fault.kind}: network faults need the netns testbed (topology = "
                f'"netns", as root); this run uses {self.ctx.testbed.kind!r}'
            )
        hosts, per = self.ctx.testbed.hosts, self.ctx.testbed.ranks_per_host
        # Node agents put several ranks on a host: a rank's network fault is its host's.
        return hosts[self._index(key, len(hosts) * per, "rank(s) on its hosts") // per]

    def _rail_iface(self) -> tuple[Host, str]:
        host = self._host()
        return host, host.rail_ifaces[self._index("rail", len(host.rail_ifaces), "rail(s)")]

    def _index(self, key: str, size: int, what: str) -> int:
        """Parameter ``key`` as an index below ``size``: a ChaosError, not an IndexError
        (or a negative index silently picking another host) when it is out of range."""
        value = int(self.fault.param(key))
        if not 0 <= value < size:
            raise ChaosError(f"{self.description}: {key}={value} but the testbed has {size} {what}")
        return value


class _Kill(Injector):
    def _start(self) -> None:
        self._signal(signal.SIGKILL)
        self.active = False


class _Hang(Injector):
    def _start(self) -> None:
        self._signal(signal.SIGSTOP)

    def _stop(self) -> None:
        with contextlib.suppress(ChaosError):  # a hung rank may have been killed since
            self._signal(signal.SIGCONT)


class _Periodic(Injector):
    """Runs ``_tick`` in a thread until stopped; the undo runs once the thread ended."""

    def __init__(self, fault: Fault, ctx: InjectionContext) -> None:
        super().__init__(fault, ctx)
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None
        self.error: ChaosError | None = None

    def _start(self) -> None:
        self._halt.clear()
        self._thread = threading.Thread(target=self._loop, name=f"chaos-{self.fault.kind}")
        self._thread.daemon = True
        self._thread.start()

    def _loop(self) -> None:
        try:
            while not self._halt.is_set() and self._tick():
                pass
        except ChaosError as exc:
            self.error = exc
            logger.warning("%s stopped: %s", self.description, exc)

    def _tick(self) -> bool:
        raise NotImplementedError

    def _stop(self) -> None:
        self._halt.set()
        if self._thread is not None:
            self._thread.join(10.0)
        self._undo()

    def _undo(self) -> None:
        raise NotImplementedError


class _Slow(_Periodic):
    _pinned: int | None = None

    def _check(self) -> None:
        # Checked before the thread starts: a bad factor or a gone rank must fail
        # start(), not only log a warning from the thread.
        factor = float(self.fault.param("factor"))
        if not 0.0 < factor < 1.0:
            raise ChaosError(f"slow: factor must be between 0 and 1, got {factor}")
        pid = self._signal(None)
        self._pinned = pid if self.fault.param("pin", False) else None

    def _send(self, sig: signal.Signals) -> bool:
        """Signal the rank (or the pinned process); False once a pinned one is gone."""
        if self._pinned is None:
            self._signal(sig)
            return True
        try:
            os.killpg(self._pinned, sig)
        except ProcessLookupError:
            logger.info("%s: pid %d is gone; its replacement runs at full speed",
                        self.description, self._pinned)  # fmt: skip
            return False
        return True

    def _tick(self) -> bool:
        factor = float(self.fault.param("factor"))
        if not self._send(signal.SIGCONT) or self._halt.wait(SLOW_PERIOD_S * factor):
            return False
        if not self._send(signal.SIGSTOP):
            return False
        return not self._halt.wait(SLOW_PERIOD_S * (1.0 - factor))

    def _undo(self) -> None:
        with contextlib.suppress(ChaosError):
            self._send(signal.SIGCONT)


class _SlowCpu(_Periodic):
    _quota: CpuQuota | None = None
    _pinned: int | None = None
    # When the rank was under the quota (moved into the capped cgroup): the runner
    # dates the fault from then, not from before the 0.2 s measurement of its CPUs.
    fired_at: float | None = None

    def _check(self) -> None:
        factor = float(self.fault.param("factor"))
        if not 0.0 < factor < 1.0:
            raise ChaosError(f"slow-cpu: factor must be between 0 and 1, got {factor}")
        self._signal(None)
        cpu_root()

    def _start(self) -> None:
        rank, factor = int(self.fault.param("rank")), float(self.fault.param("factor"))
        pid = self._signal(None)
        cpus = float(self.fault.param("cpus", 0.0)) or measure_cpus(pid)
        # A rank that was idle while measured still gets a quota it can feel.
        self._quota = CpuQuota(f"slow-r{rank}", max(cpus, 0.05) * factor)
        self._pinned = pid if self.fault.param("pin", False) else None
        logger.info("%s: pid %d used %.2f CPUs; capped at %.3f", self.description, pid,
                    cpus, self._quota.cpus)  # fmt: skip
        if not self._quota.add(pid):
            raise ChaosError(f"{self.description}: rank {rank} (pid {pid}) is gone")
        self.fired_at = time.time()
        super()._start()

    def _tick(self) -> bool:
        if self._pinned is None and self._quota is not None:
            pid = self.ctx.pid_of(int(self.fault.param("rank")))
            if pid not in self._quota.pids():  # replaced: the slow node is its host
                self._quota.add(pid)
        return self._pinned is None and not self._halt.wait(SLOW_PERIOD_S)

    def _undo(self) -> None:
        if self._quota is not None:
            self._quota.remove()


def _link(host: Host, iface: str, state: str) -> None:
    _sh.run(["ip", "-n", str(host.netns), "link", "set", iface, state])


class _NicDown(Injector):
    def _start(self) -> None:
        _link(*self._rail_iface(), "down")

    def _stop(self) -> None:
        _link(*self._rail_iface(), "up")


class _NicUp(Injector):
    def _start(self) -> None:
        _link(*self._rail_iface(), "up")
        self.active = False


class Flap(_Periodic):
    def __init__(self, fault: Fault, ctx: InjectionContext) -> None:
        super().__init__(fault, ctx)
        self.flaps = 0

    def _check(self) -> None:
        # Checked before the thread starts, so that start() raises (on the loopback
        # testbed, say) instead of the thread only logging it; a period of 0 would be
        # a busy loop of link changes.
        super()._check()
        if float(self.fault.param("period_s")) <= 0:
            raise ChaosError("flap: period_s must be > 0")

    def _tick(self) -> bool:
        count = self.fault.param("count")
        if count is not None and self.flaps >= int(count):
            return False
        half = float(self.fault.param("period_s")) / 2.0
        self._set(up=False)
        self.flaps += 1
        stopped = self._halt.wait(half)
        self._set(up=True)
        return not stopped and not self._halt.wait(half)

    def _set(self, *, up: bool) -> None:
        """Take the link down or up (the loopback flap overrides this)."""
        _link(*self._rail_iface(), "up" if up else "down")

    def _undo(self) -> None:
        self._set(up=True)


class _Throttle(Injector):
    def _devices(self) -> list[tuple[str, str]]:
        host, iface = self._rail_iface()
        port = host.switch_ports[int(self.fault.param("rail"))]
        # Egress of the host's end shapes what it sends; egress of the bridge port
        # shapes what it receives.
        return [(str(host.netns), iface), (str(self.ctx.testbed.switch_netns), port)]

    def _check(self) -> None:
        super()._check()
        _sh.require_tool("tc", "install iproute2")
        if float(self.fault.param("rate_mbit")) <= 0:
            raise ChaosError("throttle: rate_mbit must be > 0")

    def _start(self) -> None:
        rate = float(self.fault.param("rate_mbit"))
        # A burst of ~1 ms at the rate (at least 16 KiB) keeps short bursts from
        # exceeding the configured rate on average.
        burst = max(16 * 1024, int(rate * 1e6 / 8 / 1000))
        for ns, dev in self._devices():
            _sh.run(
                ["tc", "-n", ns, "qdisc", "replace", "dev", dev, "root", "tbf",
                 "rate", f"{rate}mbit", "burst", str(burst), "latency", "200ms"]
            )  # fmt: skip

    def _stop(self) -> None:
        for ns, dev in self._devices():
            _sh.run(["tc", "-n", ns, "qdisc", "del", "dev", dev, "root"], check=False)


class _Iptables(Injector):
    """Adds its rules in the host's namespace on start and deletes the same on stop.

    Each rule carries the comment ``rsl-<pid>`` (:func:`chaos.cleanup.rule_comment`):
    it goes with the namespace anyway, but ``iptables -S`` then says whose it is.
    """

    def _rules(self) -> list[list[str]]:
        raise NotImplementedError

    def _apply(self, action: str) -> None:
        host = self._host()
        ipt = _sh.require_tool("iptables", _IPTABLES_HINT)
        for chain, *rule in self._rules():
            _sh.run(
                _sh.in_netns(host.netns, [ipt, "-w", "5", action, chain, *rule_comment(), *rule]),
                check=action != "-D",
            )

    def _check(self) -> None:
        super()._check()
        _sh.require_tool("iptables", _IPTABLES_HINT)
        self._rules()  # a peer that does not exist, say

    def _start(self) -> None:
        self._apply("-I")

    def _stop(self) -> None:
        self._apply("-D")


class _Drop(_Iptables):
    def _rules(self) -> list[list[str]]:
        _, iface = self._rail_iface()
        p = f"{float(self.fault.param('percent')) / 100.0:.6f}"
        rnd = ["-m", "statistic", "--mode", "random", "--probability", p, "-j", "DROP"]
        return [["INPUT", "-i", iface, *rnd], ["OUTPUT", "-o", iface, *rnd]]


class _Partition(_Iptables):
    def _rules(self) -> list[list[str]]:
        _, iface = self._rail_iface()
        rail = int(self.fault.param("rail"))
        peer = self._host("peer")
        if peer.index == self._host().index:
            raise ChaosError(f"{self.description}: peer must be on another host than rank")
        addr = peer.rails[rail]
        return [
            ["INPUT", "-i", iface, "-s", addr, "-j", "DROP"],
            ["OUTPUT", "-o", iface, "-d", addr, "-j", "DROP"],
        ]


class _EtcdKill(Injector):
    def _member(self) -> tuple[EtcdCluster, int]:
        etcd, member = self.ctx.etcd, int(self.fault.param("member", 0))
        if etcd is None:
            raise ChaosError("etcd-kill: this run has no etcd cluster of its own")
        if not 0 <= member < etcd.size:
            raise ChaosError(f"etcd-kill: member {member} does not exist (size {etcd.size})")
        return etcd, member

    def _check(self) -> None:
        self._member()

    def _start(self) -> None:
        etcd, member = self._member()
        etcd.kill(member)

    def _stop(self) -> None:
        etcd, member = self._member()
        try:
            etcd.restart(member)
        except Exception as exc:
            raise ChaosError(f"etcd-kill: member {member} did not come back: {exc}") from exc


# The real injector of each fault kind (chaos.injector_kinds picks between these and
# the loopback testbed's records).
NETNS_KINDS: Final[dict[str, type[Injector]]] = {
    "kill": _Kill,
    "hang": _Hang,
    "slow": _Slow,
    "slow-cpu": _SlowCpu,
    "nic-down": _NicDown,
    "nic-up": _NicUp,
    "flap": Flap,
    "throttle": _Throttle,
    "drop": _Drop,
    "partition": _Partition,
    "etcd-kill": _EtcdKill,
}


def needs_netns(fault: Fault) -> bool:
    """Whether ``fault`` acts on the network (and so needs the netns testbed)."""
    return fault.kind in {
        "nic-down", "nic-up", "flap", "throttle", "drop", "partition", "slow-link"
    }  # fmt: skip
