"""Connecting the two ends of a socket link through the store (resilient.links.socket_link).

End 0 listens on the rail address and publishes where; end 1 connects from its
own rail address and says a token (the link's store prefix), so a stray
connection is never taken for the peer. Every wait is bounded and gives up as
soon as nobody wants the link any more.
"""

from __future__ import annotations

import errno
import select
import socket
import struct
import time
from collections.abc import Callable
from typing import Final

from torch._C._distributed_c10d import Store

from resilient.links import gloo_sockets

__all__ = ["HELLO", "PairError", "connect_pair", "remaining"]

HELLO: Final = b"RSL1"
_NAP_S: Final = 0.05  # longest sleep in a rendezvous wait, to look at ``over()``


class PairError(RuntimeError):
    """A socket pair failed: closed or reset by the peer, cut, timed out.

    A RuntimeError, as gloo's errors are, so :class:`~resilient.links.link.Link`
    translates it into LinkError the same way (and reads "closed by peer" alike).
    """


def remaining(deadline: float) -> float:
    return deadline - time.monotonic()


def _family(address: str) -> int:
    return socket.getaddrinfo(address, 0, type=socket.SOCK_STREAM)[0][0]


def _read_key(store: Store, key: str, deadline: float, over: Callable[[], bool] | None) -> str:
    nap = 0.0005
    while not store.check([key]):
        if over is not None and over():
            raise PairError(f"the rendezvous at {key} is no longer wanted")
        if time.monotonic() > deadline:
            raise PairError(f"the peer did not publish {key} in time")
        time.sleep(nap)
        nap = min(nap * 2, _NAP_S)
    return bytes(store.get(key)).decode()


def _wait_for(
    sock: socket.socket, event: int, deadline: float, over: Callable[[], bool] | None
) -> None:
    poller = select.poll()
    poller.register(sock, event)
    while not poller.poll(int(min(_NAP_S, max(0.0, remaining(deadline))) * 1000)):
        if over is not None and over():
            raise PairError("the rendezvous is no longer wanted")
        if time.monotonic() > deadline:
            raise PairError("the rendezvous timed out")


def _read_exact(sock: socket.socket, n: int, deadline: float) -> bytes:
    out = bytearray()
    while len(out) < n:
        _wait_for(sock, select.POLLIN, deadline, None)
        chunk = sock.recv(n - len(out))
        if not chunk:
            raise PairError("the peer closed the connection during the hello")
        out += chunk
    return bytes(out)


def _accept(address: str, store: Store, deadline: float, over: Callable[[], bool] | None,
            token: bytes) -> socket.socket:  # fmt: skip
    listener = socket.socket(_family(address), socket.SOCK_STREAM)
    try:
        listener.bind((address, 0))
        listener.listen(4)
        listener.setblocking(False)
        store.set("sock/0", f"{address}|{listener.getsockname()[1]}")
        while True:
            _wait_for(listener, select.POLLIN, deadline, over)
            with gloo_sockets.owning() as own:
                try:
                    conn, _ = listener.accept()
                except BlockingIOError:
                    continue
                own(conn.fileno())
            try:
                conn.setblocking(False)
                hello = _read_exact(conn, len(HELLO) + 4, deadline)
                size = struct.unpack("<I", hello[len(HELLO) :])[0]
                if hello.startswith(HELLO) and _read_exact(conn, size, deadline) == token:
                    return conn
            except (OSError, PairError):
                pass
            gloo_sockets.disown(conn.fileno())
            conn.close()  # a stray connection: keep listening for the peer
    finally:
        listener.close()


def _connect(address: str, store: Store, deadline: float, over: Callable[[], bool] | None,
             token: bytes) -> socket.socket:  # fmt: skip
    host, port = _read_key(store, "sock/0", deadline, over).rsplit("|", 1)
    with gloo_sockets.owning() as own:
        sock = socket.socket(_family(address), socket.SOCK_STREAM)
        own(sock.fileno())
    try:
        sock.bind((address, 0))
        sock.setblocking(False)
        if sock.connect_ex((host, int(port))) not in (0, errno.EINPROGRESS):
            raise PairError(f"connect to {host}:{port} failed at once")
        _wait_for(sock, select.POLLOUT, deadline, over)
        err = sock.getsockopt(socket.SOL_SOCKET, socket.SO_ERROR)
        if err:
            raise PairError(f"connect to {host}:{port}: {errno.errorcode.get(err, err)}")
        sock.setblocking(True)
        sock.settimeout(max(0.001, remaining(deadline)))
        sock.sendall(HELLO + struct.pack("<I", len(token)) + token)
        return sock
    except BaseException:
        gloo_sockets.disown(sock.fileno())
        sock.close()
        raise


def connect_pair(
    store: Store,
    index: int,
    address: str,
    timeout_s: float,
    over: Callable[[], bool] | None = None,
    token: bytes = b"",
) -> socket.socket:
    """A TCP connection between the two ends of a link, made through ``store``.

    End 0 listens on ``address`` (port chosen by the kernel) and publishes where;
    end 1 connects from ``address`` and says ``token`` (the link's store prefix), so
    a stray connection is never taken for the peer. Bounded by ``timeout_s``, and
    given up as soon as ``over()`` says nobody wants the link any more.

    Raises:
        PairError: not connected in time, or the rendezvous was given up.
        OSError: the address cannot be bound.
    """
    deadline = time.monotonic() + timeout_s
    make = _accept if index == 0 else _connect
    sock = make(address, store, deadline, over, token)
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock
