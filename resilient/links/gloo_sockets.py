"""The TCP connections under a gloo link, so a dead link can be cut at once.

gloo offers no way to interrupt a pending ``wait``: ``abort()``/``shutdown()`` on
the group leave it blocked until its timeout, and a timed-out wait closes the pair
anyway. A ``shutdown(SHUT_RDWR)`` on the pair's socket does interrupt it: gloo's
event loop sees the connection end and fails every pending op of that pair within
microseconds. So each link learns which connection is its own, and :func:`cut`
shuts it down.

Which connection is a link's is not simply "the one that appeared while it was
built". The connecting end's socket does appear during the build (gloo connects
synchronously, and builds take turns through one gate, :func:`capture`). But the
listening end shares one listener per rail with every other link there, and gloo
accepts connections as soon as they arrive: the peer of a link built later may
connect while this rank is still building another one, so a window on the
listening end catches other links' connections and can miss its own (measured on
the netns testbed: a link recorded two connections to other peers, was cut, and
its pending receive went on waiting). So the two ends compare notes through the
store (:func:`pair_up`): each publishes the outgoing connections that appeared
during its build, each keeps the connection whose mirror image the peer
published, and each confirms what it kept so the connecting end keeps it too.

The gate is not a plain lock: gloo's constructor can overrun its own timeout by
tens of seconds when a NIC goes down mid-rendezvous (measured on the netns
testbed: 9-26 s past a 5 s bound), and a lock would hold every other build of the
process behind it, the next epoch's included. A build waits for the one in the
gate only until that one's bound has passed, or its epoch is over; then it goes
ahead. A repair (which may sit out gloo's whole timeout) holds up only a build to
the same peer on the same rail. The other build's connection, should it appear
meanwhile, can land in the newcomer's window; the peer's notes (below) drop it
unless it joins the same two processes on the same rail, and a link that keeps
an extra connection only cuts it too.

Before cutting, each recorded descriptor is checked to still be the same
connection (same local and remote address), because a closed descriptor number
can be reused by anything.
"""

from __future__ import annotations

import contextlib
import ipaddress
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from typing import Any, Final

__all__ = [
    "PEER_GONE_STATES",
    "PROGRESS_INFO_BYTES",
    "SENT_INFO_BYTES",
    "TCP_INFO",
    "Conn",
    "Progress",
    "capture",
    "cut",
    "disown",
    "norm",
    "owning",
    "pair_up",
    "peer_closed",
    "progress",
    "progress_of",
    "sent",
    "sent_of",
    "state_of",
    "tcp_state",
]

logger = logging.getLogger(__name__)

# The socket option number of TCP_INFO (Python names it only on some platforms).
TCP_INFO: Final = getattr(socket, "TCP_INFO", 11)
_POLL_S: Final = 0.001
# How far past its own bound a build in the gate is waited for (gloo's constructor
# returns a little after its timeout even when nothing is wrong).
_OVERRUN_S: Final = 1.0


@dataclass(frozen=True, slots=True)
class Conn:
    """One established TCP connection of this process."""

    fd: int
    local: tuple[str, int]
    remote: tuple[str, int]

    @classmethod
    def of(cls, sock: socket.socket) -> Conn:
        """The connection of a connected TCP socket (addresses normalised, see norm).

        Raises:
            OSError: the socket is not connected (or closed).
        """
        return cls(sock.fileno(), norm(sock.getsockname()[:2]), norm(sock.getpeername()[:2]))

    def text(self) -> str:
        return f"{self.local[0]}:{self.local[1]}>{self.remote[0]}:{self.remote[1]}"

    def mirror(self) -> str:
        """How the other end of this connection writes it (see :meth:`text`)."""
        return f"{self.remote[0]}:{self.remote[1]}>{self.local[0]}:{self.local[1]}"


@dataclass(slots=True)
class Captured:
    """Outgoing connections (local port not a listener of ours) opened in a block."""

    conns: list[Conn] = field(default_factory=list)


# Descriptors of connections that are not gloo's (resilient.links.socket_link): a gloo
# build's window must never take one of them for its own. Registered while the
# descriptor is made, under the lock every scan holds, so no scan sees it unowned.
_OWN: set[int] = set()
_OWN_LOCK = threading.Lock()


@contextlib.contextmanager
def owning() -> Iterator[Callable[[int], None]]:
    """Hold off connection scans while a descriptor is made; ``own(fd)`` registers it."""
    with _OWN_LOCK:
        yield _OWN.add


def disown(fd: int) -> None:
    """Forget ``fd`` (call before closing it: its number will be reused)."""
    with _OWN_LOCK:
        _OWN.discard(fd)


_TCP_ESTABLISHED: Final = 1
_TCP_LISTEN: Final = 10
_INET: Final = (socket.AF_INET, socket.AF_INET6)


def _established() -> tuple[dict[int, Conn], set[int]]:
    """This process's established TCP connections by descriptor, and its listening ports.

    Read from the descriptors themselves (``/proc/self/fd``, then ``TCP_INFO`` and
    the socket's addresses), not from ``/proc/net/tcp``: that lists every socket of
    the host and cost ~9 ms a call on an idle 2-core machine (psutil), three calls
    a link build, and far more while ranks compute.
    """
    with _OWN_LOCK:
        return _scan(set(_OWN))


def _scan(owned: set[int]) -> tuple[dict[int, Conn], set[int]]:
    out: dict[int, Conn] = {}
    listening: set[int] = set()
    try:
        names = os.listdir("/proc/self/fd")
    except OSError:  # /proc unreadable: links simply cannot be cut
        return out, listening
    for name in names:
        fd = int(name)
        if fd in owned:
            continue
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            s = socket.socket(fileno=os.dup(fd))
        except OSError:  # closed meanwhile, or not a socket we can look at
            continue
        with s:
            try:
                if s.type != socket.SOCK_STREAM or s.family not in (
                    socket.AF_INET,
                    socket.AF_INET6,
                ):
                    continue
                state = s.getsockopt(socket.IPPROTO_TCP, TCP_INFO, 1)[0]
                if state == _TCP_LISTEN:
                    listening.add(int(s.getsockname()[1]))
                elif state == _TCP_ESTABLISHED:
                    out[fd] = Conn.of(s)
            except OSError:
                continue
    return out, listening


@dataclass(slots=True)
class _Turn:
    deadline: float
    over: Callable[[], bool] | None
    background: bool = False
    key: tuple[str, int] | None = None  # (rail address, peer)


class _Gate:
    """One link build at a time, but never one stuck build for everybody."""

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._holder: _Turn | None = None

    def _passable(self, turn: _Turn) -> bool:
        h = self._holder
        if h is None:
            return True
        if h.background and not turn.background and (h.key is None or h.key != turn.key):
            return True
        if time.monotonic() > h.deadline or (h.over is not None and h.over()):
            logger.info("a link build overran its bound or outlived its epoch; not waiting for it")
            return True
        return False

    def enter(
        self,
        bound_s: float,
        over: Callable[[], bool] | None,
        background: bool = False,
        key: tuple[str, int] | None = None,
    ) -> _Turn:
        turn = _Turn(time.monotonic() + bound_s + _OVERRUN_S, over, background, key)
        with self._cond:
            while not self._passable(turn):
                self._cond.wait(0.02)
            self._holder = turn
        return turn

    def leave(self, turn: _Turn) -> None:
        with self._cond:
            if self._holder is turn:
                self._holder = None
                self._cond.notify_all()


_GATE = _Gate()


@contextlib.contextmanager
def capture(
    bound_s: float,
    over: Callable[[], bool] | None = None,
    *,
    address: str = "",
    peer: int = -1,
    background: bool = False,
) -> Iterator[Captured]:
    """Record the outgoing connections this block opens, to build the link to
    ``peer`` on the rail at ``address``.

    Builds take turns (see the module docstring): this waits for the build under
    way until its ``bound_s`` (plus a second) has passed or its ``over()`` says its
    epoch is over, whichever comes first, so never longer than that build's bound.
    A ``background`` build (a repair) holds up no other kind of build but one to
    the same peer on the same rail (the only one whose connection the peer's notes
    could not tell apart): a call waiting on a link must not wait for a repair
    that may sit out gloo's timeout (seen: the signature exchange held 6 s behind
    a repair on a flapping NIC, and a peer gave up).
    """
    got = Captured()
    turn = _GATE.enter(bound_s, over, background, (address, peer))
    try:
        before, _ = _established()
        yield got
        after, listening = _established()
    finally:
        _GATE.leave(turn)
    got.conns = [
        c for fd, c in after.items() if before.get(fd) != c and c.local[1] not in listening
    ]


def _at(conn: Conn, address: str) -> bool:
    """Whether ``conn`` was accepted at ``address`` (its rail's listener; any
    connection was when that is no IP address: a host name is not compared).
    The connecting end's source address is the kernel's choice, not the rail's."""
    try:
        ipaddress.ip_address(address)
    except ValueError:
        return True
    return conn.local[0] == address


def _read(store: Any, key: str, deadline: float) -> str | None:
    """Poll ``key`` (a blocking get would hold the shared store client)."""
    while True:
        if store.check([key]):
            return bytes(store.get(key)).decode()
        if time.monotonic() > deadline:
            return None
        time.sleep(_POLL_S)


def pair_up(store: Any, me: int, got: Captured, timeout_s: float, address: str = "") -> list[Conn]:
    """The connection(s) of a just-built two-rank link, agreed with the peer.

    ``store`` is the link's own (prefixed) store and ``me`` this end's index (0/1);
    ``address`` the link's rail here: the end that accepted the connection keeps
    only one accepted there, so a build to the same peer on another rail at the
    same time is never taken for this one. Returns [] if the peer does not answer
    within ``timeout_s`` (the link then works, but cannot be cut; its ops fail at
    their deadline instead).
    """
    deadline = time.monotonic() + timeout_s
    store.set(f"conn/{me}", ",".join(c.text() for c in got.conns))
    theirs = _read(store, f"conn/{1 - me}", deadline)
    if theirs is None:
        logger.warning("link end %d: the peer never published its connection", me)
        return []
    wanted = set(filter(None, theirs.split(",")))
    kept = [c for c in _established()[0].values() if c.mirror() in wanted and _at(c, address)]
    store.set(f"kept/{me}", ",".join(c.text() for c in kept))
    confirmed = _read(store, f"kept/{1 - me}", deadline)
    if confirmed is not None:
        ok = set(filter(None, confirmed.split(",")))
        kept += [c for c in got.conns if c.mirror() in ok]
    return kept


def norm(addr: tuple[str, int]) -> tuple[str, int]:
    """A socket address as connections are recorded (IPv4-mapped prefix dropped)."""
    return str(addr[0]).removeprefix("::ffff:"), int(addr[1])


@contextlib.contextmanager
def _verified(conn: Conn) -> Iterator[socket.socket | None]:
    """A duplicate of ``conn``'s descriptor if it still is that connection, else None.

    Family and type are given, not read from the descriptor: three system calls
    fewer, on a path the peer watch and the send-rate meter take for every link
    (a wrong guess only fails the address check below).
    """
    family = socket.AF_INET6 if ":" in conn.local[0] else socket.AF_INET
    try:
        s = socket.socket(family, socket.SOCK_STREAM, 0, fileno=os.dup(conn.fd))
    except OSError:
        yield None
        return
    with s:
        try:
            same = (norm(s.getsockname()[:2]), norm(s.getpeername()[:2])) == (
                conn.local,
                conn.remote,
            )
        except OSError:
            same = False
        yield s if same else None


def cut(conns: list[Conn]) -> int:
    """Shut down ``conns`` (both directions); returns how many were cut.

    Pending gloo ops on them fail at once with "Connection closed". Each descriptor
    is checked to still be the recorded connection first (numbers get reused).
    Only the duplicate descriptor made here is closed; gloo closes its own.
    """
    done = 0
    for conn in conns:
        with _verified(conn) as s:
            if s is None:
                continue
            try:
                s.shutdown(socket.SHUT_RDWR)
                done += 1
            except OSError as exc:  # already gone: nothing to interrupt
                logger.debug("cutting %s failed: %s", conn, exc)
    return done


@dataclass(frozen=True, slots=True)
class Progress:
    """What the kernel knows of a connection's progress (``TCP_INFO``)."""

    unacked: int  # segments sent and not acknowledged yet
    retransmits: int  # retransmission timeouts in a row, without an ACK between
    since_ack_ms: int  # since the last ACK from the peer
    notsent: int = 0  # bytes written by the application, not sent yet
    probes: int = 0  # probe timeouts in a row (nothing in flight, data waiting)
    window: int = -1  # the peer's advertised window, bytes (-1: the kernel does not say)
    mss: int = 0

    def dead(self, min_ms: int) -> str | None:
        """Why the connection looks dead after ``min_ms`` without an ACK, or None.

        Lost in transit: data unacknowledged and the retransmission timer fired.
        Dropped before it left (a firewall's OUTPUT rule, as a partition on this
        host is made): nothing in flight, data waiting although the peer's window
        has room for it, and the probe timer fired. A peer too busy to read shows
        neither: its window is shut (zero-window probes), or its ACKs still come.
        """
        if self.since_ack_ms < min_ms:
            return None
        if self.unacked and self.retransmits:
            return (
                f"{self.unacked} segment(s) unacknowledged, {self.retransmits} retransmission "
                f"timeout(s), no ACK for {self.since_ack_ms} ms"
            )
        room = self.window >= max(1, min(self.notsent, self.mss))
        if self.notsent and not self.unacked and self.probes and room:
            return (
                f"{self.notsent} B not sent although the peer's window is open "
                f"({self.probes} probe timeout(s)), no ACK for {self.since_ack_ms} ms"
            )
        return None


def _tcp_info(conn: Conn, size: int) -> bytes | None:
    """The first ``size`` bytes of ``conn``'s ``TCP_INFO``, or None if it is gone."""
    with _verified(conn) as s:
        if s is None:
            return None
        try:
            return s.getsockopt(socket.IPPROTO_TCP, TCP_INFO, size)
        except OSError:
            return None


SENT_INFO_BYTES: Final = 184  # what sent_of reads of TCP_INFO


def sent(conn: Conn) -> tuple[int, int, int, int] | None:
    """``(bytes_acked, busy_us, retransmitted, segments_out)`` of ``conn``'s sending
    side, or None (gone, old kernel).

    ``busy_us`` is the kernel's time with data to send (``tcpi_busy_time``, Linux
    4.10+, jiffy resolution) less the part the receiver's window held it back
    (``tcpi_rwnd_limited``: a receiver too busy to read is a slow process, not a
    slow path), so the deltas of the first two over an interval give the rate the
    path allowed, whatever either application did in between; the last two give
    the share of segments that had to be sent again (loss).
    """
    return sent_of(_tcp_info(conn, SENT_INFO_BYTES))


def sent_of(raw: bytes | None) -> tuple[int, int, int, int] | None:
    """:func:`sent` from the first :data:`SENT_INFO_BYTES` of a ``TCP_INFO`` (None
    when there is none, or an old kernel's is too short)."""
    if raw is None or len(raw) < 176:
        return None
    # struct tcp_info: u32 tcpi_total_retrans at 100, u64 tcpi_bytes_acked at 120,
    # u32 tcpi_segs_out at 136, u64 tcpi_busy_time at 168, u64 tcpi_rwnd_limited
    # at 176 (part of the busy time).
    (retrans,) = struct.unpack_from("=I", raw, 100)
    (acked,) = struct.unpack_from("=Q", raw, 120)
    (segs,) = struct.unpack_from("=I", raw, 136)
    (busy,) = struct.unpack_from("=Q", raw, 168)
    if len(raw) >= 184:
        (rwnd_limited,) = struct.unpack_from("=Q", raw, 176)
        busy = max(0, busy - rwnd_limited)
    return acked, busy, retrans, segs


# tcpi_state values: the peer sent FIN (CLOSE_WAIT) or RST (CLOSE).
PEER_GONE_STATES: Final = frozenset({7, 8})


def peer_closed(conn: Conn) -> bool:
    """Whether the kernel saw the other end close or reset ``conn``."""
    return tcp_state(conn) in PEER_GONE_STATES


def tcp_state(conn: Conn) -> int | None:
    """``conn``'s TCP state (``tcpi_state``), or None once its descriptor is gone
    (gloo closes a pair's socket itself when it reads the peer's FIN or RST)."""
    return state_of(_tcp_info(conn, 8))


def state_of(raw: bytes | None) -> int | None:
    """:func:`tcp_state` from the start of a ``TCP_INFO`` (None when there is none)."""
    return raw[0] if raw else None


PROGRESS_INFO_BYTES: Final = 232  # what progress_of reads of TCP_INFO


def progress(conn: Conn) -> Progress | None:
    """``conn``'s TCP progress, or None if it is gone (or not Linux)."""
    return progress_of(_tcp_info(conn, PROGRESS_INFO_BYTES))


def progress_of(raw: bytes | None) -> Progress | None:
    """:func:`progress` from the first :data:`PROGRESS_INFO_BYTES` of a ``TCP_INFO``
    (None when there is none)."""
    if raw is None or len(raw) < 60:
        return None
    # struct tcp_info: u8 state, ca_state, retransmits, probes, ...; u32 rto, ato,
    # snd_mss (offset 16), rcv_mss, unacked (24), ...; u32 last_ack_recv at 56;
    # u32 notsent_bytes at 144 (Linux 4.6+); u32 snd_wnd at 228 (Linux 6.2+).
    retransmits, probes = raw[2], raw[3]
    (mss,) = struct.unpack_from("=I", raw, 16)
    (unacked,) = struct.unpack_from("=I", raw, 24)
    (since_ack,) = struct.unpack_from("=I", raw, 56)
    notsent = struct.unpack_from("=I", raw, 144)[0] if len(raw) >= 148 else 0
    window = struct.unpack_from("=I", raw, 228)[0] if len(raw) >= 232 else -1
    return Progress(
        unacked=unacked, retransmits=retransmits, since_ack_ms=since_ack,
        notsent=notsent, probes=probes, window=window, mss=mss,
    )  # fmt: skip
