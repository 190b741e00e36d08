"""Control links over plain TCP sockets: the signature exchange without gloo's handshakes.

Every collective starts with a signature exchange: each rank sends a 2.4 KB row to
every peer on the control links. Over two-rank gloo groups each such message costs
gloo's rendezvous for unbound buffers (the sender announces it, the receiver
answers when its receive is posted, then the bytes go) and several wake-ups of the
device's event-loop thread. Measured here (4 ranks, 2 cores, a mesh all-gather of
one 2.4 KB row each, 2000 calls): gloo pairs 2.6 ms a call and 0.96 ms of CPU per
rank; one plain TCP socket per pair, written and read by the calling thread,
0.065 ms and 0.025 ms. DDP pays an exchange per gradient bucket, so this is most
of the exchange's cost.

A :class:`SocketLink` is a :class:`~resilient._link.Link` whose group is a
:class:`SocketPair`: it speaks the little of ``ProcessGroupGloo`` a link uses
(``send``, ``recv``, ``allreduce`` for the repair probe, ``shutdown``), so every
failover, cut, stall and repair rule of links applies unchanged; the connection is
the link's own, so cutting it (``shutdown``), reading its ``TCP_INFO`` and telling
a peer's close all work as for gloo's. Messages are framed (tag, length) and
matched to posted receives by tag in arrival order, as gloo matches slots; a
message that arrives first waits in a small stash. Sends are written at once
(they are small; what the socket buffer cannot take is flushed by the send's
wait). A receive is read by the thread that waits for it; other waiters on the
same link wait for that reader to hand their messages over.

Data links stay gloo groups: their messages are large, and there gloo's
handshake is a small part of the cost (and the issue asks for gloo links).
"""

from __future__ import annotations

import collections
import contextlib
import select
import socket
import struct
import threading
import time
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Final

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store

from resilient import _sockets
from resilient._link import Link
from resilient._sockconnect import PairError, connect_pair, remaining
from resilient.errors import LinkError

__all__ = ["PairError", "SocketLink", "SocketPair", "SocketWork", "connect_pair"]

_HEADER: Final = struct.Struct("<qQ")  # tag, payload bytes
_BUF_BYTES: Final = 64 << 10
_STASH_MAX: Final = 1024  # unmatched messages kept per pair (stale ones of given-up calls)
_POLL_S: Final = 0.001
_PROBE_TAG: Final = -1
_FOREVER_S: Final = 3600.0


def _bytes_of(tensor: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy."""
    try:  # dtypes numpy knows (all but bfloat16), no grad: the cheaper way
        array: Any = tensor.numpy()
    except (TypeError, RuntimeError):
        array = tensor.reshape(-1).view(torch.uint8).numpy()
    return memoryview(array).cast("B")


class SocketWork:
    """One send or receive on a :class:`SocketPair` (the subset of gloo's Work used)."""

    __slots__ = ("done", "error", "pair", "sending", "view")

    def __init__(self, pair: SocketPair, view: memoryview, *, sending: bool) -> None:
        self.pair, self.view, self.sending = pair, view, sending
        self.done = False
        self.error: str | None = None

    def is_completed(self) -> bool:
        return self.done or self.error is not None

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Block until the op completed, at most ``timeout``.

        Raises:
            PairError: the pair failed, or the op did not complete in time.
        """
        if not self.done:
            secs = timeout.total_seconds() if timeout is not None else _FOREVER_S
            deadline = time.monotonic() + (secs if secs > 0 else _FOREVER_S)
            if self.sending:
                self.pair.flush_until(self, deadline)
            else:
                self.pair.read_until(self, deadline)
        if self.error is not None:
            raise PairError(self.error)
        return True


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

    def __init__(self, sock: socket.socket) -> None:
        sock.setblocking(False)
        self._sock = sock
        self._error: str | None = None
        # Sending: messages not fully written yet, in order; the writer holds _tx.
        self._tx = threading.Lock()
        self._outq: collections.deque[tuple[list[memoryview], SocketWork]] = collections.deque()
        # Receiving: posted receives and stashed messages by tag; one reader at a time.
        self._rx = threading.Condition(threading.Lock())
        self._pending: dict[int, collections.deque[SocketWork]] = {}
        self._stash: dict[int, collections.deque[bytes]] = {}
        self._stashed = 0
        self._reading = False
        self._waiting = 0  # threads asleep on _rx (notified only when there are some)
        self._buf = bytearray(_BUF_BYTES)
        self._start = self._end = 0

    # -- the ProcessGroupGloo subset a Link uses ------------------------------------------
    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> SocketWork:
        """Queue ``tensors[0]`` for the peer and write what the socket takes now."""
        payload = _bytes_of(tensors[0])
        work = SocketWork(self, payload, sending=True)
        bufs = [memoryview(_HEADER.pack(tag, len(payload))), payload]
        with self._tx:
            if self._error is not None:
                work.error = self._error
                return work
            self._outq.append((bufs, work))
            if len(self._outq) == 1:
                self._write(None)
        return work

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> SocketWork:
        """Post a receive into ``tensors[0]``; it completes at once when its message
        is stashed or already in the socket (read now, without blocking, unless
        another thread is reading)."""
        work = SocketWork(self, _bytes_of(tensors[0]), sending=False)
        with self._rx:
            if self._error is not None:
                work.error = self._error
                return work
            stashed = self._stash.get(tag)
            if stashed:
                self._stashed -= 1
                self._fill(work, stashed.popleft())
                if not stashed:
                    del self._stash[tag]
                return work
            self._pending.setdefault(tag, collections.deque()).append(work)
            if self._reading:
                return work
            self._reading = True
        try:
            self._pump(None)
        except PairError:
            pass  # the work carries the error
        finally:
            self._release()
        return work

    def allreduce(self, tensors: list[torch.Tensor]) -> _ProbeWork:
        """A two-rank sum of ``tensors[0]`` in place (the repair probe)."""
        return _ProbeWork(self, tensors[0])

    def shutdown(self) -> None:
        """Close the connection; every pending op fails."""
        with contextlib.suppress(OSError):  # already cut or reset
            self._sock.shutdown(socket.SHUT_RDWR)
        self._fail("socket pair closed")
        _sockets.disown(self._sock.fileno())
        self._sock.close()

    # -- sending ---------------------------------------------------------------------------
    def flush_until(self, work: SocketWork, deadline: float) -> None:
        """Write queued messages until ``work``'s went out (or it failed)."""
        with self._tx:
            while not work.is_completed():
                self._write(deadline)

    def _write(self, deadline: float | None) -> None:
        """Write from the queue head; without ``deadline`` only what fits now.
        Holds _tx."""
        while self._outq:
            bufs, work = self._outq[0]
            try:
                n = self._sock.sendmsg(bufs)
            except BlockingIOError:
                if deadline is None:
                    return
                self._await(select.POLLOUT, deadline)
                continue
            except OSError as exc:
                self._fail(f"send failed: {exc.strerror or exc}")
                return
            while n:
                head = bufs[0]
                if n >= len(head):
                    n -= len(head)
                    bufs.pop(0)
                else:
                    bufs[0], n = head[n:], 0
            if not bufs or not any(len(b) for b in bufs):
                work.done = True
                self._outq.popleft()

    # -- receiving -------------------------------------------------------------------------
    def read_until(self, work: SocketWork, deadline: float) -> None:
        """Read messages until ``work``'s arrived, or hand over to the thread that
        reads now and wait for it to deliver."""
        with self._rx:
            while not work.is_completed() and self._reading:
                self._waiting += 1
                try:
                    woke = self._rx.wait(max(0.0, remaining(deadline)))
                finally:
                    self._waiting -= 1
                if not woke:
                    if not work.is_completed():
                        self._fail_locked(f"no message within the deadline ({work.view.nbytes} B)")
                    return
            if work.is_completed():
                return
            self._reading = True
        try:
            while not work.is_completed():
                self._pump(deadline)
        except PairError:
            # The pump reads on after a message until the socket is empty: a peer
            # that sent its last message and closed (a job's final barrier) ends
            # that read with EOF, after our message was delivered. The work's own
            # state decides (SocketWork.wait raises its error, if it has one).
            if not work.is_completed():
                raise
        finally:
            self._release()

    def _release(self) -> None:
        with self._rx:
            self._reading = False
            if self._waiting:
                self._rx.notify_all()

    def _pump(self, deadline: float | None) -> None:
        """Read what the socket holds and deliver every whole message; with a
        ``deadline``, first wait until at least some bytes came. Only the reader
        (``_reading``) calls this, outside the lock: only it touches the buffer."""
        while True:
            self._room()
            try:
                n = self._sock.recv_into(memoryview(self._buf)[self._end :])
            except BlockingIOError:
                if deadline is None:
                    return
                self._await(select.POLLIN, deadline)
                self._flush_some()
                continue
            except OSError as exc:
                self._fail(f"receive failed: {exc.strerror or exc}")
                raise PairError(self._error or str(exc)) from exc
            if n == 0:
                self._fail("Connection closed by peer")
                raise PairError("Connection closed by peer")
            self._end += n
            self._deliver()
            deadline = None  # got bytes: from here on, only what is already there

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
            need = len(self._buf) * 2
            if unread >= _HEADER.size:
                need = max(need, _HEADER.size + _HEADER.unpack_from(self._buf, 0)[1])
            self._buf.extend(bytes(need - len(self._buf)))

    def _deliver(self) -> None:
        """Hand every whole message in the buffer to its receive, or stash it."""
        head = _HEADER.size
        while self._end - self._start >= head:
            tag, nbytes = _HEADER.unpack_from(self._buf, self._start)
            begin = self._start + head
            if self._end - begin < nbytes:
                return
            body = memoryview(self._buf)[begin : begin + nbytes]
            with self._rx:
                queue = self._pending.get(tag)
                if queue:
                    self._fill(queue.popleft(), body)
                    if not queue:
                        del self._pending[tag]
                elif self._stashed >= _STASH_MAX:
                    self._fail_locked(f"more than {_STASH_MAX} messages nobody asked for")
                else:
                    self._stash.setdefault(tag, collections.deque()).append(bytes(body))
                    self._stashed += 1
                if self._waiting:
                    self._rx.notify_all()
            body.release()
            self._start = begin + nbytes
        if self._start == self._end:
            self._start = self._end = 0

    def _fill(self, work: SocketWork, body: memoryview | bytes) -> None:
        if len(body) > work.view.nbytes:
            # gloo aborts the process here; a failed link is kinder.
            work.error = f"a message of {len(body)} B for a receive of {work.view.nbytes} B"
            return
        work.view[: len(body)] = body
        work.done = True

    def _await(self, event: int, deadline: float) -> None:
        """Sleep until the socket is ready for ``event``; a reader also wakes when
        queued output can go (see :meth:`_flush_some`).

        Raises:
            PairError: the deadline passed (the pair fails, as gloo's does).
        """
        left = remaining(deadline)
        if left <= 0:
            what = "send" if event == select.POLLOUT else "receive"
            self._fail(f"a {what} did not complete within its deadline")
            raise PairError(self._error or "timed out")
        if event == select.POLLIN and self._outq:
            event |= select.POLLOUT
        poller = select.poll()
        poller.register(self._sock, event)
        poller.poll(max(1, int(left * 1000)))

    def _flush_some(self) -> None:
        """Write what queued output the socket takes now, unless a writer is busy.

        A reader waiting for the peer must not leave our own queued bytes unsent:
        the peer may be waiting for them before it sends what we wait for.
        """
        if self._outq and self._tx.acquire(blocking=False):
            try:
                self._write(None)
            finally:
                self._tx.release()

    # -- failure ---------------------------------------------------------------------------
    def _fail(self, why: str) -> None:
        with self._rx:
            self._fail_locked(why)

    def _fail_locked(self, why: str) -> None:
        """Fail every pending op with ``why`` (the first reason sticks). Holds _rx."""
        if self._error is None:
            self._error = why
        for queue in self._pending.values():
            for work in queue:
                work.error = self._error
        self._pending.clear()
        for _, work in list(self._outq):
            if not work.done:
                work.error = self._error
        self._rx.notify_all()


class SocketLink(Link):
    """A :class:`~resilient._link.Link` over a :class:`SocketPair` (control links)."""

    def _rendezvous(
        self,
        store: Store,
        index: int,
        address: str,
        over: Callable[[], bool] | None,
        *,
        met: bool = False,
        background: bool = False,
    ) -> None:
        own = PrefixStore(self.prefix, store)
        try:
            sock = connect_pair(
                own, index, address, self.config.connect_timeout_s, over, self.prefix.encode()
            )
        except (OSError, RuntimeError, dist.DistError) as exc:
            raise LinkError(
                f"link {self.rank}<->{self.peer} rail {self.rail} ({address}): "
                f"socket rendezvous failed: {exc}"
            ) from exc
        self.pg = SocketPair(sock)
        self._conns = [
            _sockets.Conn(
                sock.fileno(),
                _sockets.norm(sock.getsockname()[:2]),
                _sockets.norm(sock.getpeername()[:2]),
            )
        ]
