"""Resolve a rank's rails (one address per NIC) from addresses or interface names."""

from __future__ import annotations

import ipaddress
import socket
from collections.abc import Sequence

import psutil

from resilient.errors import ConfigError

__all__ = ["default_rail", "resolve_rails"]


def _is_ip(text: str) -> bool:
    try:
        ipaddress.ip_address(text)
    except ValueError:
        return False
    return True


def _interface_ipv4(name: str) -> str:
    addrs = psutil.net_if_addrs()
    if name not in addrs:
        known = ", ".join(sorted(addrs)) or "none"
        raise ConfigError(f"rail {name!r}: no such network interface (have: {known})")
    for addr in addrs[name]:
        if addr.family == socket.AF_INET:
            return str(addr.address)
    raise ConfigError(f"rail {name!r}: interface has no IPv4 address")


def default_rail(master_addr: str, master_port: int = 29500) -> str:
    """The local address that routes to ``master_addr`` (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((master_addr, master_port))
            return str(s.getsockname()[0])
    except OSError:
        return "127.0.0.1"


def resolve_rails(spec: Sequence[str], master_addr: str = "127.0.0.1") -> tuple[str, ...]:
    """Turn ``["eth0", "10.0.1.5"]`` into addresses; empty: one rail toward the master.

    Raises:
        ConfigError: an interface does not exist or has no IPv4 address.
    """
    if not spec:
        return (default_rail(master_addr),)
    return tuple(item if _is_ip(item) else _interface_ipv4(item) for item in spec)
