"""The TCP connections under a gloo link, so a dead link can be cut at once.

gloo offers no way to interrupt a pending ``wait``: ``abort()``/``shutdown()`` on
the group leave it blocked until its timeout, and a timed-out wait closes the pair
anyway. A ``shutdown(SHUT_RDWR)`` on the pair's socket does interrupt it: gloo's
event loop sees the connection end and fails every pending op of that pair within
microseconds. So while a link is built, the TCP connections that appear in this
process (on the link's address) are recorded, and :func:`cut` shuts them down.

Building links is serialised through :data:`BUILD_LOCK` so that the connections
that appear during one build belong to that link. Before cutting, each recorded
descriptor is checked to still be the same connection (same local and remote
address), because a closed descriptor number can be reused by anything.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field

import psutil

__all__ = ["BUILD_LOCK", "Conn", "capture", "cut"]

logger = logging.getLogger(__name__)

BUILD_LOCK = threading.RLock()


@dataclass(frozen=True, slots=True)
class Conn:
    """One established TCP connection of this process."""

    fd: int
    local: tuple[str, int]
    remote: tuple[str, int]


@dataclass(slots=True)
class Captured:
    """Connections that appeared during a :func:`capture` block."""

    conns: list[Conn] = field(default_factory=list)


def _established(address: str | None) -> dict[int, Conn]:
    out: dict[int, Conn] = {}
    try:
        conns = psutil.Process().net_connections(kind="tcp")
    except (psutil.Error, OSError):  # /proc unreadable: links simply cannot be cut
        return out
    for c in conns:
        if c.status != psutil.CONN_ESTABLISHED or not c.raddr or c.fd < 0:
            continue
        local = (str(c.laddr.ip).removeprefix("::ffff:"), int(c.laddr.port))
        if address is not None and local[0] != address:
            continue
        remote = (str(c.raddr.ip).removeprefix("::ffff:"), int(c.raddr.port))
        out[c.fd] = Conn(c.fd, local, remote)
    return out


@contextlib.contextmanager
def capture(address: str | None) -> Iterator[Captured]:
    """Record the connections on ``address`` that this block opens (holds BUILD_LOCK)."""
    got = Captured()
    with BUILD_LOCK:
        before = _established(address)
        yield got
        after = _established(address)
    got.conns = [c for fd, c in after.items() if before.get(fd) != c]


def _norm(addr: tuple[str, int]) -> tuple[str, int]:
    return str(addr[0]).removeprefix("::ffff:"), int(addr[1])


def cut(conns: list[Conn]) -> int:
    """Shut down ``conns`` (both directions); returns how many were cut.

    Pending gloo ops on them fail at once with "Connection closed". Each descriptor
    is checked to still be the recorded connection first (numbers get reused).
    Only the duplicate descriptor made here is closed; gloo closes its own.
    """
    done = 0
    for conn in conns:
        try:
            with socket.socket(fileno=os.dup(conn.fd)) as s:
                local, remote = _norm(s.getsockname()[:2]), _norm(s.getpeername()[:2])
                if (local, remote) != (conn.local, conn.remote):
                    continue
                s.shutdown(socket.SHUT_RDWR)
            done += 1
        except OSError as exc:  # already gone: nothing to interrupt
            logger.debug("cutting %s failed: %s", conn, exc)
    return done
