"""A local testbed: hosts with real rails (NICs) for chaos runs.

:class:`NetnsTestbed` (root) makes one network namespace per host and one
*switch* namespace holding a bridge per rail (a rail plane) and a management
bridge. Each host gets one veth per rail (``r0``, ``r1``, ... inside the host)
plus ``mgmt``; the root namespace joins the management bridge through one veth, so
etcd and the launcher (which stay in the root namespace) reach every host while
faults on the rails never touch the control plane::

    host h0 ──r0── br0 ──r0── host h1        rail 0: 10.100.0.<host+1>/24
            ──r1── br1 ──r1──                rail 1: 10.101.0.<host+1>/24
            ─mgmt─ brm ─mgmt─                mgmt:   10.213.<k>.<host+1>/24, root .254

The bridges live in their own namespace so the host's firewall never sees rail
traffic. Every name starts with ``rsl-<id>``; an owner file records the pid of the
process that built it, and :func:`sweep_leftovers` (run before every build)
deletes testbeds whose owner died, e.g. after a crash or SIGKILL, and the other
leftovers :mod:`chaos.cleanup` knows. ``down()`` holds SIGINT/SIGTERM/SIGHUP while
it runs when a :class:`~chaos.signals.SignalGuard` is installed.

:class:`LoopbackTestbed` needs no root: each host's rails are loopback aliases
``127.0.<rail+1>.<host+1>``, as ``resilient run`` gives them; only process faults
and etcd faults can be injected there.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from dataclasses import dataclass
from types import TracebackType
from typing import Final

from chaos import _sh, signals
from chaos.cleanup import (
    PREFIX,
    delete_testbed,
    list_netns,
    owner_dir,
    remove_leftovers,
    write_record,
)
from resilient.errors import ChaosError
from resilient.launch.launcher import loopback_rails

__all__ = ["Host", "LoopbackTestbed", "NetnsTestbed", "Testbed", "sweep_leftovers"]

logger = logging.getLogger(__name__)

_MAX_HOSTS: Final = 200
_MAX_RAILS: Final = 8


_owner_dir = owner_dir  # the name the tests know
_list_netns = list_netns


@dataclass(frozen=True, kw_only=True, slots=True)
class Host:
    """One host of the testbed. ``netns`` is None on the loopback testbed.

    ``rails[j]`` is the address of rail ``j``; inside the namespace its interface is
    ``rail_ifaces[j]`` and the bridge side of that cable is ``switch_ports[j]`` in
    the switch namespace.
    """

    index: int
    rails: tuple[str, ...]
    netns: str | None = None
    mgmt_addr: str = "127.0.0.1"
    rail_ifaces: tuple[str, ...] = ()
    switch_ports: tuple[str, ...] = ()
    mgmt_iface: str = ""  # the control-plane interface inside the namespace

    def wrap(self, argv: list[str]) -> list[str]:
        """``argv`` as run on this host (inside its namespace)."""
        return _sh.in_netns(self.netns, argv)


class Testbed:
    """Hosts and the address the control plane listens on; a context manager.

    Global rank r runs on host ``r // ranks_per_host`` (one rank per host unless
    the scenario runs node agents, each with several ranks).
    """

    kind: str = ""

    def __init__(self, hosts: int, rails: int, *, ranks_per_host: int = 1) -> None:
        if not 1 <= hosts <= _MAX_HOSTS:
            raise ChaosError(f"testbed: hosts={hosts} must be between 1 and {_MAX_HOSTS}")
        if not 1 <= rails <= _MAX_RAILS:
            raise ChaosError(f"testbed: rails={rails} must be between 1 and {_MAX_RAILS}")
        if ranks_per_host < 1:
            raise ChaosError(f"testbed: ranks_per_host={ranks_per_host} must be >= 1")
        self.n_hosts, self.n_rails = hosts, rails
        self.ranks_per_host = ranks_per_host
        self.hosts: tuple[Host, ...] = ()
        self.control_addr = "127.0.0.1"

    @property
    def switch_netns(self) -> str | None:
        return None

    def describe(self) -> str:
        return f"{self.kind}: {self.n_hosts} host(s) x {self.n_rails} rail(s)"

    def up(self) -> Testbed:
        raise NotImplementedError

    def down(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> Testbed:
        return self.up()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.down()


class LoopbackTestbed(Testbed):
    """Rails as loopback aliases; nothing to build or remove."""

    kind = "loopback"

    def up(self) -> LoopbackTestbed:
        self.hosts = tuple(
            Host(index=i, rails=loopback_rails(i, self.n_rails)) for i in range(self.n_hosts)
        )
        return self

    def down(self) -> None:
        self.hosts = ()


class NetnsTestbed(Testbed):
    """Hosts as network namespaces with one veth per rail; see the module docstring.

    Raises (from ``up``):
        ChaosError: not root, ``ip`` missing or a command failed; whatever was built
            is removed again before the error propagates.
    """

    kind = "netns"

    def __init__(self, hosts: int, rails: int, *, ranks_per_host: int = 1) -> None:
        super().__init__(hosts, rails, ranks_per_host=ranks_per_host)
        self._names: list[str] = []
        self._set_id(secrets.token_hex(2))

    @property
    def switch_netns(self) -> str:
        return f"{PREFIX}{self.id}-sw"

    def describe(self) -> str:
        return (
            f"netns {PREFIX}{self.id}-*: {self.n_hosts} host(s) x {self.n_rails} rail(s), "
            f"control plane on {self.control_addr}"
        )

    def host_netns(self, index: int) -> str:
        return f"{PREFIX}{self.id}-h{index}"

    def up(self) -> NetnsTestbed:
        _sh.require_root("the netns testbed")
        _sh.require_tool("ip", "install iproute2")
        sweep_leftovers()
        subnet = _free_mgmt_subnet()
        self.control_addr = f"10.213.{subnet}.254"
        self._claim_owner()
        try:
            self._build(subnet)
        except BaseException:
            self.down()
            raise
        logger.info("testbed %s: %d host(s) x %d rail(s) up", self.id, self.n_hosts, self.n_rails)
        return self

    def down(self) -> None:
        """Delete every namespace (their veths, qdiscs and rules go with them).

        Signals wait until it is done (see :mod:`chaos.signals`): cut short, it would
        leave namespaces that only the next sweep removes.
        """
        with signals.shielded():
            delete_testbed(self._names, self._root_if)
            self._names.clear()
            self.hosts = ()
            with contextlib.suppress(OSError):
                self._owner.unlink()

    def _set_id(self, testbed_id: str) -> None:
        self.id = testbed_id
        self._root_if = f"rsl{testbed_id}m"
        self._owner = _owner_dir() / f"{testbed_id}.json"

    def _claim_owner(self) -> None:
        """Create the owner file, whole and under an id no other testbed holds.

        The file appears at once (written aside, then hard-linked into place), so a
        concurrent :func:`sweep_leftovers` never reads half a record and deletes a
        live testbed as unclaimed; the link fails if the id is taken (2 random bytes
        do collide), and then another id is drawn.
        """
        owners = _owner_dir()
        for _ in range(32):
            if not any(n.startswith(f"{PREFIX}{self.id}-") for n in _list_netns()):
                names = [self.switch_netns, *(self.host_netns(i) for i in range(self.n_hosts))]
                record = {"kind": "testbed", "pid": os.getpid(), "netns": names,
                          "root_if": self._root_if}  # fmt: skip
                try:
                    if write_record(self._owner, record):
                        return
                except OSError as exc:
                    raise ChaosError(f"testbed: cannot write {self._owner}: {exc}") from exc
            self._set_id(secrets.token_hex(2))
        raise ChaosError(f"testbed: no free testbed id in {owners} (32 tries)")

    def _netns(self, name: str) -> None:
        _sh.run(["ip", "netns", "add", name])
        self._names.append(name)
        _sh.run(["ip", "-n", name, "link", "set", "lo", "up"])

    def _build(self, subnet: int) -> None:
        sw = self.switch_netns
        self._netns(sw)
        for bridge in [*(f"br{j}" for j in range(self.n_rails)), "brm"]:
            _sh.run(["ip", "-n", sw, "link", "add", bridge, "type", "bridge"])
            _sh.run(["ip", "-n", sw, "link", "set", bridge, "up"])
        # The root namespace's leg on the management bridge, where etcd listens.
        _sh.run(
            ["ip", "link", "add", "name", self._root_if, "type", "veth",
             "peer", "name", "root", "netns", sw]
        )  # fmt: skip
        _sh.run(["ip", "-n", sw, "link", "set", "root", "master", "brm", "up"])
        _sh.run(["ip", "addr", "add", f"{self.control_addr}/24", "dev", self._root_if])
        _sh.run(["ip", "link", "set", self._root_if, "up"])
        self.hosts = tuple(self._build_host(i, subnet) for i in range(self.n_hosts))

    def _build_host(self, i: int, subnet: int) -> Host:
        ns, sw = self.host_netns(i), self.switch_netns
        self._netns(ns)
        cables = [(f"r{j}", f"h{i}r{j}", f"br{j}", f"10.{100 + j}.0.{i + 1}/24")
                  for j in range(self.n_rails)]  # fmt: skip
        cables.append(("mgmt", f"h{i}m", "brm", f"10.213.{subnet}.{i + 1}/24"))
        for inner, port, bridge, cidr in cables:
            _sh.run(
                ["ip", "link", "add", "name", inner, "netns", ns, "type", "veth",
                 "peer", "name", port, "netns", sw]
            )  # fmt: skip
            _sh.run(["ip", "-n", sw, "link", "set", port, "master", bridge, "up"])
            _sh.run(["ip", "-n", ns, "addr", "add", cidr, "dev", inner])
            _sh.run(["ip", "-n", ns, "link", "set", inner, "up"])
        return Host(
            index=i,
            netns=ns,
            rails=tuple(f"10.{100 + j}.0.{i + 1}" for j in range(self.n_rails)),
            mgmt_addr=f"10.213.{subnet}.{i + 1}",
            rail_ifaces=tuple(f"r{j}" for j in range(self.n_rails)),
            switch_ports=tuple(f"h{i}r{j}" for j in range(self.n_rails)),
            mgmt_iface="mgmt",
        )


def _free_mgmt_subnet() -> int:
    """A third octet for 10.213.X.0/24 that no interface of the root namespace uses."""
    used = _sh.run(["ip", "-4", "-o", "addr", "show"], check=False)
    for _ in range(64):
        k = secrets.randbelow(250) + 1
        if f" 10.213.{k}." not in used:
            return k
    raise ChaosError("no free 10.213.X.0/24 management subnet (64 tries)")


def sweep_leftovers() -> int:
    """Delete testbeds whose owner process is gone (a crashed or killed run), and every
    other leftover of the library (see :func:`chaos.cleanup.remove_leftovers`).

    Also removes ``rsl-*`` namespaces that no owner file claims. Returns how many
    objects (namespaces, links, qdiscs, rules, owner records) were deleted. Does
    nothing without root.
    """
    return len(remove_leftovers())
