"""Framed, tag-matched messages over one plain TCP socket between two ranks.

A :class:`SocketPair` is one connected socket between two ranks; it speaks the part
of ``ProcessGroupGloo`` a :class:`~resilient.links.link.Link` uses (``send``, ``recv``,
``allreduce`` for the repair probe, ``shutdown``). Messages are framed
(:mod:`resilient.links.socket_frames`: tag, length, digest) and meet their receives
by tag in arrival order, as gloo matches slots; a message that comes before its
receive waits in a stash (a large one is read into a buffer of its own, so a peer is
never blocked by a receive posted late). A large message that comes while no
receive at all is posted on the pair is left in the socket until one is (parked),
so the usual early arrival, a peer's next call, costs no extra copy.

Its bytes move when a thread waits: the pair's :class:`~resilient.links.socket_engine.Engine`
drives every pair of its engine (see there). A message of at least ``_DIRECT_BYTES``
whose receive is posted is read straight into the receive's tensor; smaller ones
come through one shared buffer, several per system call.

A pair fails as a whole, as gloo's does: a closed or reset connection, a message
larger than its receive (gloo aborts the process there), or an op past its deadline
fails every op still pending on it, with a
:class:`~resilient.links.socket_connect.PairError` from ``wait``. Cutting a pair
(``shutdown``, or ``shutdown(2)`` on its descriptor from
:mod:`resilient.links.gloo_sockets`) wakes a thread that waits on it at once.
"""

from __future__ import annotations

import array
import collections
import contextlib
import fcntl
import socket
import termios
from collections.abc import Callable
from datetime import timedelta
from typing import Final

import torch

from resilient.links import gloo_sockets
from resilient.links.byte_views import bytes_of
from resilient.links.ledger import GROUP_SHIFT, MAX_SLOT, tag_slot
from resilient.links.socket_engine import Engine, SocketWork, engine
from resilient.links.socket_frames import CALL_SHIFT, HEADER, NEWS

__all__ = ["SocketPair"]

_FORGOTTEN_KEPT: Final = 256
_BUF_BYTES: Final = 64 << 10
_DIRECT_BYTES: Final = 16 << 10  # bodies at least this large skip the shared buffer
_STASH_MAX: Final = 1024  # unmatched messages kept per pair (stale ones of given-up calls)
_PROBE_TAG: Final = -1


class _ProbeWork:
    """The repair probe: the sum of both ends' tensors, like a two-rank all_reduce."""

    def __init__(self, pair: SocketPair, tensor: torch.Tensor) -> None:
        self.tensor = tensor
        self.other = torch.empty_like(tensor)
        self.sent = pair.send([tensor], 0, _PROBE_TAG)
        self.got = pair.recv([self.other], 0, _PROBE_TAG)

    def wait(self, timeout: timedelta | None = None) -> bool:
        self.sent.wait(timeout)
        self.got.wait(timeout)
        self.tensor.add_(self.other)
        return True


class SocketPair:
    """A framed, tag-matched message stream over one connected TCP socket."""

    def __init__(self, sock: socket.socket, engine_: Engine | None = None) -> None:
        sock.setblocking(False)
        self._sock = sock
        self.fileno = sock.fileno()
        self.engine = engine_ or engine("default")
        self.error: str | None = None
        # A C step moves this socket's bytes now (resilient.links.native_steps): no
        # other thread reads or writes it meanwhile; what they post waits in Python.
        self.claimed = False
        # Sending: messages not fully written yet, in order.
        self._outq: collections.deque[tuple[list[memoryview], SocketWork]] = collections.deque()
        # Receiving: posted receives and stashed messages by tag.
        self._pending: dict[int, collections.deque[SocketWork]] = {}
        # Stashed messages by tag, each as (digest, body).
        self._stash: dict[int, collections.deque[tuple[int, bytes | bytearray]]] = {}
        self._stashed = 0
        self._buf = bytearray(_BUF_BYTES)
        self._start = self._end = 0
        # A large body being read straight into its destination:
        # (tag, view, got, work, digest).
        self._body: tuple[int, memoryview, int, SocketWork | None, int] | None = None
        # A large message came while no receive at all was posted here: its header
        # stays in the buffer and its body in the socket until one is (see _deliver).
        self._parked = False
        self._draining = False  # the peer closed: read all it sent, park nothing (drain)
        # Tags of given-up calls by tag slot (see forget): their messages are discarded.
        self._forgotten: dict[int, Callable[[int], bool]] = {}
        # The last tag slot handed out (take_slot): groups sharing this connection.
        self._slots = 0
        # Calls dropped by number (see forget_call), the newest _FORGOTTEN_KEPT.
        self._calls_gone: set[int] = set()
        self._calls_order: collections.deque[int] = collections.deque()
        self.engine.add(self)

    @property
    def has_output(self) -> bool:
        return bool(self._outq)

    @property
    def parked(self) -> bool:
        return self._parked

    # -- the ProcessGroupGloo subset a Link uses ------------------------------------------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int, digest: int = 0) -> SocketWork:
        """Queue ``tensors[0]`` for the peer and write what the socket takes now;
        ``digest``: the call's (see :class:`SocketWork`)."""
        return self.send_bytes(bytes_of(tensors[0]), tag, digest)

    def send_bytes(self, payload: memoryview, tag: int, digest: int = 0) -> SocketWork:
        """:meth:`send` of a byte view (one view of a control row serves every peer)."""
        work = SocketWork(self, payload, sending=True)
        bufs = [memoryview(HEADER.pack(tag, len(payload), digest)), payload]
        with self.engine.lock:
            if self.error is not None:
                work.error = self.error
                return work
            self._outq.append((bufs, work))
            if len(self._outq) == 1 and not self.claimed:
                self.write_some()
            if self._outq:
                self.engine.ring()
        return work

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int, digest: int = 0) -> SocketWork:
        """Post a receive into ``tensors[0]``; it completes at once when its message
        is stashed, or is already in the socket and no other receive is pending on
        the pair (read now, without blocking, unless another thread drives the
        engine: it reads it then). Otherwise the thread that waits reads it.
        ``digest``: the call's; a message with another fails the receive."""
        return self.recv_bytes(bytes_of(tensors[0]), tag, digest)

    def recv_bytes(self, into: memoryview, tag: int, digest: int = 0) -> SocketWork:
        """:meth:`recv` into a byte view."""
        work = SocketWork(self, into, sending=False, digest=digest)
        with self.engine.lock:
            # A whole message that came before the pair failed is still delivered:
            # a peer that sends and then exits closes the connection behind it.
            stashed = self._stash.get(tag)
            if stashed:
                self._stashed -= 1
                self._fill(work, *stashed.popleft())
                if not stashed:
                    del self._stash[tag]
                return work
            if self.error is not None:
                work.error = self.error
                return work
            if self._calls_gone and tag >> CALL_SHIFT in self._calls_gone:
                # Its call was refused before the receive was posted (a C step,
                # resilient.links.native_steps, posts the rest of a call only once it stopped).
                work.error, work.mismatch = "its call was refused on another rank", True
                return work
            # With a receive posted already, the read that posting it made found
            # the socket empty, or found it again only moments ago: a collective
            # posts several receives per pair at once, and reading again for each
            # is a system call and a BlockingIOError for nothing.
            first = not self._pending
            self._pending.setdefault(tag, collections.deque()).append(work)
            if self._parked:
                self.unpark()
                self.engine.ring()  # a driver polls the socket for input again
            if first and not self.engine.driving and not self.claimed:
                self.read_some()
        return work

    def take_slot(self) -> int | None:
        """A tag slot no group on this connection used yet (never handed out twice,
        so a group that left never meets its successor's messages), or None when
        all are taken. Only the connection's lower end hands slots out
        (resilient.links.table)."""
        with self.engine.lock:
            if self._slots >= MAX_SLOT or self.error is not None:
                return None
            self._slots += 1
            return self._slots

    def forget(self, stale: Callable[[int], bool], why: str, slot: int = 0) -> int:
        """Drop every receive of tag slot ``slot`` whose tag ``stale`` names (a
        given-up call's): it fails with ``why`` and never writes into its buffer,
        which the caller may reuse now; messages with such tags, stashed or still
        to come, are discarded. Queued sends still go out whole (the framing needs
        them; the peer drops them in turn). Returns how many receives were dropped."""

        def mine(tag: int) -> bool:
            return tag_slot(tag) == slot and stale(tag)

        with self.engine.lock:
            self._forgotten[slot] = stale
            return self._drop_locked(mine, why)

    def forget_call(self, call: int, why: str, slot: int = 0) -> int:
        """:meth:`forget` for the tags of one call checked by digest (``call``: the
        tag bits from CALL_SHIFT on, without the slot), kept beside the epoch's
        predicate; the newest _FORGOTTEN_KEPT calls are remembered. The dropped
        receives fail as refused (DigestMismatch): the call was, on some rank."""
        call |= slot << (GROUP_SHIFT - CALL_SHIFT)
        with self.engine.lock:
            if call not in self._calls_gone:
                self._calls_gone.add(call)
                self._calls_order.append(call)
                if len(self._calls_order) > _FORGOTTEN_KEPT:
                    self._calls_gone.discard(self._calls_order.popleft())
            return self._drop_locked(lambda tag: tag >> CALL_SHIFT == call, why, refused=True)

    def _drop_locked(self, stale: Callable[[int], bool], why: str, *, refused: bool = False) -> int:
        """Drop receives, stashed messages and a body being read of ``stale`` tags."""
        dropped = 0
        for tag in [t for t in self._pending if stale(t)]:
            for work in self._pending.pop(tag):
                work.error, work.mismatch = why, refused
                dropped += 1
        for tag in [t for t in self._stash if stale(t)]:
            self._stashed -= len(self._stash.pop(tag))
        body = self._body
        if body is not None and body[3] is not None and stale(body[0]):
            # Half read into a dropped receive's buffer: read the rest aside.
            tag, view, got, reading, digest = body
            assert reading is not None
            reading.error, reading.mismatch = why, refused
            self._body = (tag, memoryview(bytearray(len(view))), got, None, digest)
            dropped += 1
        self.engine.ring()
        return dropped

    def tcp_info(self, size: int) -> bytes | None:
        """The first ``size`` bytes of the connection's ``TCP_INFO``, or None once it
        is closed: one system call on the pair's own socket, where reading through a
        descriptor number (resilient.links.gloo_sockets) has to duplicate and verify it first.
        (A close racing this call may, at worst, read another socket's counters once.)"""
        try:
            return self._sock.getsockopt(socket.IPPROTO_TCP, gloo_sockets.TCP_INFO, size)
        except OSError:
            return None

    def unread(self) -> int:
        """Bytes the peer sent that wait in the socket, unread (0 once it is closed)."""
        count = array.array("i", [0])
        try:
            fcntl.ioctl(self._sock.fileno(), termios.FIONREAD, count)
        except (OSError, ValueError):  # closed: nothing left to read
            return 0
        return count[0]

    def drain(self) -> None:
        """Read everything the peer sent into its receives, or the stash (a large
        message too, parked or not), up to its close, which then fails the pair.
        For a peer the kernel saw close: what it sent before is delivered, as when
        a driver reads up to the close itself. Nothing happens while a C step
        holds the pair (it reads up to the close itself) or once it failed."""
        with self.engine.lock:
            if self.claimed or self.error is not None:
                return
            self._draining = True
            try:
                self.unpark()
                self.read_some()
            finally:
                self._draining = False
            self.engine.handed_over()  # waiters whose receives completed look again

    def allreduce(self, tensors: list[torch.Tensor]) -> _ProbeWork:
        """A two-rank sum of ``tensors[0]`` in place (the repair probe)."""
        return _ProbeWork(self, tensors[0])

    def fail(self, why: str) -> None:
        """Fail every pending op now (the link above broke), waking their waiters; the
        connection stays open until :meth:`shutdown`."""
        self.engine.stop_c_step()
        with self.engine.lock:
            self.fail_locked(why)
            self.engine.ring()

    def shutdown(self) -> None:
        """Close the connection; every pending op fails."""
        self.engine.stop_c_step()
        with self.engine.lock:
            # A C step still on the socket would read or write a number the system
            # may give to the next socket opened once this one is closed.
            self.engine.until_released(self)
            with contextlib.suppress(OSError):  # already cut or reset
                self._sock.shutdown(socket.SHUT_RDWR)
            self.fail_locked("socket pair closed")
            self.engine.discard(self)
            gloo_sockets.disown(self.fileno)
            self._sock.close()

    # -- sending (under the engine's lock) ------------------------------------------------
    def write_some(self) -> None:
        """Write from the queue head what the socket takes now."""
        while self._outq:
            bufs, work = self._outq[0]
            try:
                n = self._sock.sendmsg(bufs)
            except BlockingIOError:
                return
            except OSError as exc:
                self.fail_locked(f"send failed: {exc.strerror or exc}")
                return
            while n:
                head = bufs[0]
                if n >= len(head):
                    n -= len(head)
                    bufs.pop(0)
                else:
                    bufs[0], n = head[n:], 0
            if bufs and any(len(b) for b in bufs):
                # The socket took part: it is full now. Asking again would only
                # raise BlockingIOError (a system call and an exception, each
                # tens of microseconds on a busy host); the poll says when it drains.
                return
            work.done = True
            self._outq.popleft()

    # -- receiving (under the engine's lock) ----------------------------------------------
    def unpark(self) -> None:
        """Go on reading past a parked message: into its receive when that is posted
        now, else into a buffer of its own (the old way)."""
        if self._parked:
            self._parked = False
            self._deliver(park=False)

    def read_some(self) -> None:
        """Read what the socket holds now and deliver every whole message."""
        try:
            while self.error is None and not self._parked:
                if self._body is not None:
                    if not self._read_body():
                        return
                    continue
                self._room()
                room = len(self._buf) - self._end
                n = self._sock.recv_into(memoryview(self._buf)[self._end :])
                if n == 0:
                    self.fail_locked("Connection closed by peer")
                    return
                self._end += n
                self._deliver()
                if n < room:
                    # Less than asked for: the socket is empty now, and asking
                    # again would only raise BlockingIOError (see write_some).
                    return
        except BlockingIOError:
            return
        except OSError as exc:
            self.fail_locked(f"receive failed: {exc.strerror or exc}")

    def _read_body(self) -> bool:
        """Read on into the large body's destination; True once it is whole, False
        when the pair failed or the socket holds nothing more now.

        Raises:
            BlockingIOError: nothing more to read now.
        """
        assert self._body is not None
        tag, view, got, work, digest = self._body
        while got < len(view):
            want = len(view) - got
            n = self._sock.recv_into(view[got:])
            if n == 0:
                self.fail_locked("Connection closed by peer")
                return False
            got += n
            self._body = (tag, view, got, work, digest)
            if n < want:
                return False  # the socket is empty now (see read_some)
        self._body = None
        if work is not None:
            work.done = True
        else:
            self._arrived(tag, view.obj, digest)  # type: ignore[arg-type]
        return True

    def _room(self) -> None:
        """Make space after ``_end`` for the next read: move the unread part to the
        front, or grow the buffer for a message larger than it."""
        if self._end < len(self._buf):
            return
        unread = self._end - self._start
        if self._start:
            self._buf[:unread] = self._buf[self._start : self._end]
            self._start, self._end = 0, unread
        if self._end == len(self._buf):
            self._buf.extend(bytes(len(self._buf)))

    def _deliver(self, *, park: bool = True) -> None:
        """Hand every whole message in the buffer to its receive, or stash it; start
        reading a large body straight into its destination.

        A large message that comes while no receive at all is posted on this pair (a
        peer one call ahead: its next call's data came while this rank still waits
        in the last one) is parked instead: left in the socket, not read into a
        fresh buffer to be copied again once its receive is posted. Any receive
        posted here unparks it (:meth:`recv`), so a wait for a later message on the
        pair never waits behind it; the socket's buffers hold what the peer sends
        meanwhile, and a peer whose send does not fit waits as on a slow link.
        """
        head = HEADER.size
        while self._end - self._start >= head:
            tag, nbytes, digest = HEADER.unpack_from(self._buf, self._start)
            begin = self._start + head
            have = min(self._end - begin, nbytes)
            if have < nbytes and nbytes >= _DIRECT_BYTES:
                if park and not self._pending and self.error is None and not self._draining:
                    self._parked = True
                    return
                part = memoryview(self._buf)[begin : begin + have]
                self._start_body(tag, nbytes, part, digest)
                self._start = begin + have
                break
            if have < nbytes:
                return
            body = memoryview(self._buf)[begin : begin + nbytes]
            self._arrived(tag, body, digest)
            body.release()
            self._start = begin + nbytes
        if self._start == self._end:
            self._start = self._end = 0

    def _start_body(self, tag: int, nbytes: int, part: memoryview, digest: int) -> None:
        queue = self._pending.get(tag)
        work = queue[0] if queue else None
        if work is not None and work.digest and digest & ~NEWS != work.digest:
            # Another call's message: its receive fails (see _fill); the body is
            # read aside (stashed, until its call is forgotten).
            queue.popleft()  # type: ignore[union-attr]
            if not queue:
                del self._pending[tag]
            self._mismatched(work, digest)
            work = None
        if work is not None and nbytes <= work.view.nbytes:
            queue.popleft()  # type: ignore[union-attr]
            if not queue:
                del self._pending[tag]
            view = work.view[:nbytes]
            work.news = digest & NEWS != 0
        else:  # no receive yet, or one too small (fails when the body is whole)
            work = None
            view = memoryview(bytearray(nbytes))
        got = len(part)
        view[:got] = part
        part.release()
        self._body = (tag, view, got, work, digest)

    def _arrived(self, tag: int, body: memoryview | bytearray, digest: int) -> None:
        forgotten = self._forgotten.get(tag_slot(tag)) if self._forgotten else None
        if forgotten is not None and forgotten(tag):
            return
        if self._calls_gone and tag >> CALL_SHIFT in self._calls_gone:
            return
        queue = self._pending.get(tag)
        if queue:
            self._fill(queue.popleft(), digest, body)
            if not queue:
                del self._pending[tag]
        elif self._stashed >= _STASH_MAX:
            self.fail_locked(f"more than {_STASH_MAX} messages nobody asked for")
        else:
            kept = body if isinstance(body, bytearray) else bytes(body)
            self._stash.setdefault(tag, collections.deque()).append((digest, kept))
            self._stashed += 1

    @staticmethod
    def _mismatched(work: SocketWork, digest: int) -> None:
        work.mismatch = True
        work.error = (
            f"a message of call digest {digest:#x} for a receive of call digest {work.digest:#x}"
        )

    def _fill(self, work: SocketWork, digest: int, body: memoryview | bytes | bytearray) -> None:
        if work.digest and digest & ~NEWS != work.digest:
            self._mismatched(work, digest)
            return
        work.news = digest & NEWS != 0
        if len(body) > work.view.nbytes:
            # gloo aborts the process here; a failed receive is kinder.
            work.error = f"a message of {len(body)} B for a receive of {work.view.nbytes} B"
            return
        work.view[: len(body)] = body
        work.done = True

    # -- failure (under the engine's lock) ------------------------------------------------
    def fail_locked(self, why: str) -> None:
        """Fail every pending op with ``why`` (the first reason sticks)."""
        if self.error is None:
            self.error = why
        for queue in self._pending.values():
            for work in queue:
                work.error = self.error
        self._pending.clear()
        for _, work in self._outq:
            if not work.done:
                work.error = self.error
        self._outq.clear()
        if self._body is not None and self._body[3] is not None:
            self._body[3].error = self.error
        self._body = None
        self.engine.handed_over()
