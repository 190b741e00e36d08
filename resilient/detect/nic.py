"""Watching this rank's NICs: a rail whose interface goes down is seen in ~10 ms.

:class:`NicMonitor` maps each rail address to its interface (psutil) and polls
``/sys/class/net/<iface>/operstate`` every ``interval_s`` in a thread (one small
file read per rail). On a change it emits ``nic.down`` / ``nic.up`` events, logs a
warning and calls the registered callbacks (what link-level recovery hooks into).
Loopback rails are not watched: ``lo`` has no carrier to lose. ``unknown`` (some
virtual NICs) counts as up; ``down``, ``lowerlayerdown``, ``notpresent`` and
``dormant`` count as down.
"""

from __future__ import annotations

import ipaddress
import logging
import socket
import threading
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Final

import psutil

from resilient import events

__all__ = ["NicMonitor", "interface_of"]

logger = logging.getLogger(__name__)

_DOWN: Final = frozenset({"down", "lowerlayerdown", "notpresent", "dormant"})
SYSFS_NET: Final = Path("/sys/class/net")
# No link is built on a NIC that went down less than this long ago. Seen: a
# rendezvous on a NIC flapping every 0.1 s sat in gloo for 26 s, well past its
# bound, holding up every link build behind it (they go in one global order).
HOLD_DOWN_S: Final = 2.0


def interface_of(address: str) -> str | None:
    """The interface holding IPv4 ``address`` here, or None (not local, or loopback)."""
    if ipaddress.ip_address(address).is_loopback:
        return None
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == address for a in addrs):
            return str(name)
    return None


class NicMonitor:
    """Polls the operstate of each rail's interface; see the module docstring."""

    def __init__(
        self,
        rank: int,
        rails: Sequence[str],
        *,
        interval_s: float = 0.01,
        sysfs: Path = SYSFS_NET,
        interfaces: Sequence[str | None] | None = None,
    ) -> None:
        self.rank = rank
        self.epoch = 0  # the group's current epoch, for the events (set by the group)
        self.interfaces = list(interfaces) if interfaces is not None else [
            interface_of(a) for a in rails
        ]  # fmt: skip
        self._sysfs, self._interval = sysfs, interval_s
        self.up = [True] * len(self.interfaces)
        # When each rail's NIC last went down (monotonic s; -inf: never seen down).
        self.down_at = [float("-inf")] * len(self.interfaces)
        self._callbacks: list[Callable[[int, bool], None]] = []
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None

    def steady(self, rail: int, hold_s: float = HOLD_DOWN_S) -> bool:
        """``rail``'s NIC is up and has not gone down for ``hold_s``: a flapping NIC
        is not, between two flaps."""
        return self.up[rail] and time.monotonic() - self.down_at[rail] >= hold_s

    @property
    def watching(self) -> bool:
        return any(i is not None for i in self.interfaces)

    def on_change(self, callback: Callable[[int, bool], None]) -> None:
        """Call ``callback(rail, up)`` on every change (from the monitor's thread)."""
        self._callbacks.append(callback)

    def start(self) -> NicMonitor:
        if self.watching and self._thread is None:
            self.up = [self._is_up(i) for i in range(len(self.interfaces))]
            self._thread = threading.Thread(target=self._run, name="nic-monitor", daemon=True)
            self._thread.start()
        return self

    def stop(self) -> None:
        self._halt.set()
        if self._thread is not None:
            self._thread.join(2.0)

    def _is_up(self, rail: int) -> bool:
        name = self.interfaces[rail]
        if name is None:
            return True
        try:
            state = (self._sysfs / name / "operstate").read_text().strip()
        except OSError:
            return False  # the interface vanished
        return state not in _DOWN

    def _run(self) -> None:
        while not self._halt.wait(self._interval):
            for rail in range(len(self.interfaces)):
                up = self._is_up(rail)
                if up != self.up[rail]:
                    self.up[rail] = up
                    if not up:
                        self.down_at[rail] = time.monotonic()
                    self._report(rail, up)

    def _report(self, rail: int, up: bool) -> None:
        name = self.interfaces[rail]
        events.emit(
            "nic.up" if up else "nic.down",
            epoch=self.epoch,
            links=[(self.rank, -1, rail)],
            reason=f"interface {name} of rail {rail} is {'up' if up else 'down'}",
            action="reported",
        )
        logger.warning(
            "rank %d: rail %d (%s) NIC %s", self.rank, rail, name, "up" if up else "down"
        )
        for callback in self._callbacks:
            try:
                callback(rail, up)
            except Exception:  # a faulty hook must not stop the monitor
                logger.exception("rank %d: NIC change callback failed", self.rank)
