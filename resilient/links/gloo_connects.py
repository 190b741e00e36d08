"""Connection attempts that gloo leaves behind, aborted while their pair still exists.

The connecting end of a gloo pair hands a non-blocking ``connect`` to its device's
event loop, with a callback bound to the raw pair. The loop gives the attempt a
deadline (gloo's timeout), but checks it only when the socket reports something.
Across a partition the SYN is never answered, so nothing is reported; the pair
stops waiting (after five times its timeout), the constructor fails and the pair
is freed, while the attempt stays registered. Once the partition heals, a SYN
retransmission connects, the callback runs on the freed pair, and the process
dies (SIGSEGV; reproduced on loopback: SYNs to the passive end dropped until
the build failed, crash within 0.25 s and 2.2 s of the rule going in two timed
runs; with the rule kept 4 s longer, the socket stayed in SYN_SENT until then).

So while gloo builds a pair, :func:`unanswered_aborted` watches its connection
attempt: once gloo's own deadline for it has passed, the attempt is shut down.
The loop then sees an error past the deadline and fails the pair through its
callback, while the pair is still alive: the build fails cleanly, and sooner
(about twice its timeout at most, not five times it). The watcher costs nothing
when the build finishes within a second: it reads the store only after that.

Which attempt is the pair's: a socket of this process still in SYN_SENT towards
the peer's listener. The listener's address comes from what the peer published
for the rendezvous; its place in that record is found by locating this rank's
own address in its own record (both records have the same layout). If the
layout is not recognised, nothing is aborted (gloo then behaves as it did).
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import re
import socket
import threading
from collections.abc import Iterator
from typing import Any, Final

import psutil

from resilient.links import gloo_sockets

__all__ = ["abort_unanswered", "listener_of", "unanswered_aborted"]

logger = logging.getLogger(__name__)

# After gloo's deadline for the attempt, how long to wait before aborting it (the
# loop must see the error past its deadline, or it retries with a new socket).
_MARGIN_S: Final = 0.25
_POLL_S: Final = 0.1
# When the watcher first reads the store: most builds are done by then.
_FIRST_LOOK_S: Final = 1.0
# torch's ProcessGroupGloo keys each device's rendezvous under "<device index>/";
# a link has one device.
_KEY: Final = "0/{}"
_TCP_SYN_SENT: Final = 2  # tcpi_state


def _family_bytes(ip: ipaddress.IPv4Address | ipaddress.IPv6Address) -> tuple[bytes, int]:
    """How a sockaddr of ``ip``'s family starts (family, native byte order) and
    where its address bytes sit."""
    if ip.version == 4:
        return socket.AF_INET.to_bytes(2, "little"), 4
    return socket.AF_INET6.to_bytes(2, "little"), 8


def listener_of(own_record: bytes, own_address: str, peer_record: bytes) -> tuple[str, int] | None:
    """The (ip, port) the peer listens on, read from its rendezvous record at the
    place where ``own_address`` sits in ``own_record``; None if that place is not
    found exactly once, or the records differ in layout."""
    try:
        ip = ipaddress.ip_address(own_address)
    except ValueError:
        return None
    family, at = _family_bytes(ip)
    pattern = re.escape(family) + b"(?s:.{%d})" % (at - 2) + re.escape(ip.packed)
    found = [m.start() for m in re.finditer(pattern, own_record)]
    if len(found) != 1 or len(peer_record) != len(own_record):
        return None
    start = found[0]
    if peer_record[start : start + 2] != family:
        return None
    port = int.from_bytes(peer_record[start + 2 : start + 4], "big")
    raw = peer_record[start + at : start + at + len(ip.packed)]
    return str(ipaddress.ip_address(raw)), port


def _peer_listener(store: Any, index: int, address: str) -> tuple[str, int] | None:
    mine, theirs = _KEY.format(index), _KEY.format(1 - index)
    try:
        if not store.check([mine, theirs]):
            return None
        return listener_of(bytes(store.get(mine)), address, bytes(store.get(theirs)))
    except Exception as exc:  # a store hiccup only means: nothing to abort
        logger.debug("reading the rendezvous records failed: %s", exc)
        return None


def _addr(a: Any) -> tuple[str, int]:
    return str(a.ip).removeprefix("::ffff:"), int(a.port)


def _syn_sent(fd: int, local: tuple[str, int]) -> socket.socket | None:
    """A duplicate of ``fd`` if it still is that unanswered attempt, else None."""
    try:
        s = socket.socket(fileno=os.dup(fd))
    except OSError:
        return None
    try:
        state = s.getsockopt(socket.IPPROTO_TCP, gloo_sockets.TCP_INFO, 8)[0]
        if state == _TCP_SYN_SENT and gloo_sockets.norm(s.getsockname()[:2]) == local:
            return s
    except OSError:
        pass
    s.close()
    return None


def abort_unanswered(peer: tuple[str, int]) -> int:
    """Shut down this process's unanswered connection attempts to ``peer``; returns
    how many. Only the duplicate descriptor made here is closed."""
    try:
        conns = psutil.Process().net_connections(kind="inet")
    except (psutil.Error, OSError):
        return 0
    done = 0
    for c in conns:
        if c.status != psutil.CONN_SYN_SENT or not c.raddr or c.fd < 0:
            continue
        if _addr(c.raddr) != peer:
            continue
        s = _syn_sent(c.fd, _addr(c.laddr))
        if s is None:
            continue
        with s:
            try:
                s.shutdown(socket.SHUT_RDWR)
                done += 1
            except OSError as exc:
                logger.debug("aborting the attempt to %s failed: %s", peer, exc)
    return done


def _watch(
    store: Any, index: int, address: str, timeout_s: float, label: str, done: threading.Event
) -> None:
    if done.wait(min(timeout_s, _FIRST_LOOK_S)):
        return
    peer = None
    while peer is None:
        peer = _peer_listener(store, index, address)
        if peer is None and done.wait(_POLL_S):
            return
    # gloo connects as soon as it has read the peer's record, so by now any
    # attempt has started, and its deadline is at most timeout_s away.
    if done.wait(timeout_s + _MARGIN_S):
        return
    while not done.is_set():
        n = abort_unanswered(peer)
        if n:
            logger.warning(
                "%s: aborted %d unanswered connection attempt(s) to %s:%d past gloo's "
                "%.1f s deadline (the rendezvous fails now)", label, n, peer[0], peer[1], timeout_s,
            )  # fmt: skip
        done.wait(_POLL_S)


@contextlib.contextmanager
def unanswered_aborted(
    store: Any, index: int, address: str, timeout_s: float, label: str
) -> Iterator[None]:
    """Around the construction of a two-rank gloo group (``index`` 0 or 1 in it,
    bound to ``address``, gloo timeout ``timeout_s``, rendezvous in ``store``):
    abort its connection attempt once gloo's deadline for it has passed.
    ``label`` names the link (with its rank and epoch) in the log."""
    done = threading.Event()
    watcher = threading.Thread(
        target=_watch, args=(store, index, address, timeout_s, label, done),
        name=f"connect-watch-{address}", daemon=True,
    )  # fmt: skip
    watcher.start()
    try:
        yield
    finally:
        done.set()
        watcher.join(timeout=1.0)
