"""Faults on a whole node of a job that runs one ``resilient run`` agent per node.

============== ================================================================
node-kill      SIGKILL node K's agent and every process below it (its ranks,
               their spares and helpers): the machine is gone. The whole tree
               is frozen (SIGSTOP) first and only then killed, so no rank
               notices its agent's death first and no agent restarts a rank
               meanwhile; the ranks run in sessions of their own, so the
               tree is walked (``/proc``), not one process group signalled.
node-partition every rail of node K and its management link cut: iptables DROP
               in and out of each of those interfaces in the host's namespace
               (the links stay up, as behind a failed switch, so no NIC
               monitor sees it); the node's own ranks still reach one
               another over loopback. The rules are deleted on stop.
============== ================================================================
"""

from __future__ import annotations

import logging
import os
import signal
import time
from pathlib import Path
from typing import Any, Final

from chaos import _sh
from chaos.cleanup import rule_comment
from chaos.injectors import Injector
from chaos.testbed import Host
from resilient.errors import ChaosError

__all__ = ["NODE_INJECTORS", "NodeKill", "NodePartition", "descendants", "kill_tree"]

logger = logging.getLogger(__name__)

# Rounds of freezing newly found descendants; a frozen process forks no more, so
# a tree is whole after a few (one per generation that was mid-fork).
_FREEZE_ROUNDS: Final = 16
_IPTABLES_HINT: Final = "install it (apt-get install -y iptables)"


def _children() -> dict[int, list[int]]:
    """Parent pid -> child pids, for every process in ``/proc``."""
    out: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path("/proc", entry, "stat").read_text()
        except OSError:  # gone meanwhile
            continue
        # "pid (comm) state ppid ...": comm may hold spaces and parentheses.
        fields = stat[stat.rindex(")") + 2 :].split()
        out.setdefault(int(fields[1]), []).append(int(entry))
    return out


def descendants(pid: int) -> list[int]:
    """Every process below ``pid`` (children, grandchildren, ...), parents first."""
    tree, found, queue = _children(), [], [pid]
    while queue:
        for child in tree.get(queue.pop(0), ()):
            found.append(child)
            queue.append(child)
    return found


def _send(pid: int, sig: signal.Signals) -> bool:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        return False
    return True


def kill_tree(pid: int) -> list[int]:
    """SIGKILL ``pid`` and every descendant; return the pids signalled.

    Freezes the tree first (SIGSTOP to every process found, repeated until no new
    descendant shows up), then kills every frozen process. The tree is read before
    the first signal, so the whole of it stops within one loop of ``kill`` calls.

    Raises:
        ChaosError: ``pid`` does not exist.
    """
    tree = [pid, *descendants(pid)]
    frozen = [p for p in tree if _send(p, signal.SIGSTOP)]
    if pid not in frozen:
        raise ChaosError(f"pid {pid} is gone; nothing to kill")
    for _ in range(_FREEZE_ROUNDS):
        new = [p for p in descendants(pid) if p not in frozen]
        if not new:
            break
        frozen += [p for p in new if _send(p, signal.SIGSTOP)]
    for p in frozen:
        _send(p, signal.SIGKILL)
    return frozen


class NodeKill(Injector):
    """SIGKILL node ``node``'s agent and its whole process tree; nothing to undo."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.detail: dict[str, Any] = {}
        # When the node was gone (its last process frozen), a few ms after start():
        # the runner dates the fault from then, not from before the /proc walk.
        self.fired_at: float | None = None

    def _agent(self) -> int:
        lookup = self.ctx.agent_pid
        if lookup is None:
            raise ChaosError(f"{self.description}: this job runs no node agents ([job] nodes)")
        return lookup(int(self.fault.param("node")))

    def _check(self) -> None:
        self._agent()

    def _start(self) -> None:
        agent = self._agent()
        killed = kill_tree(agent)
        self.fired_at = time.time()
        self.detail = {"agent_pid": agent, "killed_pids": killed}
        logger.info("%s: killed agent %d and %d process(es) below it", self.description,
                    agent, len(killed) - 1)  # fmt: skip
        self.active = False


class NodePartition(Injector):
    """Cuts every rail of node ``node`` and its management link (iptables DROP in
    the host's namespace); the rules, tagged ``rsl-<pid>``, go on stop."""

    def _node_host(self) -> Host:
        testbed = self.ctx.testbed
        if testbed.kind != "netns":
            raise ChaosError(
                f'{self.description}: needs the netns testbed (topology = "netns", as root)'
            )
        return testbed.hosts[self._index("node", len(testbed.hosts), "node(s)")]

    def _ifaces(self, host: Host) -> list[str]:
        return [*host.rail_ifaces, *([host.mgmt_iface] if host.mgmt_iface else [])]

    def _check(self) -> None:
        self._node_host()
        _sh.require_tool("iptables", _IPTABLES_HINT)

    def _apply(self, action: str) -> None:
        host = self._node_host()
        ipt = _sh.require_tool("iptables", _IPTABLES_HINT)
        for iface in self._ifaces(host):
            for chain, way in (("INPUT", "-i"), ("OUTPUT", "-o")):
                rule = [ipt, "-w", "5", action, chain, *rule_comment(), way, iface, "-j", "DROP"]
                _sh.run(_sh.in_netns(host.netns, rule), check=action != "-D")

    def _start(self) -> None:
        self._apply("-I")

    def _stop(self) -> None:
        self._apply("-D")  # not checked: after a start that failed midway, some are absent


NODE_INJECTORS: Final[dict[str, type[Injector]]] = {
    "node-kill": NodeKill,
    "node-partition": NodePartition,
}
