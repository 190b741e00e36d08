"""A peer that sent its last messages and exited (a job's final barrier): what it
sent is still delivered when the kernel's view of its close is taken first
(``SocketLink.check_closed``, run by the peer watch while calls are in flight).

Real TCP sockets on loopback; the two ends are two threads of this process."""

from __future__ import annotations

import socket
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from resilient.config import DataPlaneConfig
from resilient.links.link import Link
from resilient.links.table import LinkTable
from resilient.procs import free_port

pytestmark = pytest.mark.timeout(60)

RAILS = ("127.0.1.1", "127.0.1.2")
CONFIG = DataPlaneConfig(op_timeout_floor_s=5.0, data_transport="socket")


def _both(fn0: Callable[[], Any], fn1: Callable[[], Any]) -> tuple[Any, Any]:
    with ThreadPoolExecutor(2) as pool:
        f0, f1 = pool.submit(fn0), pool.submit(fn1)
        return f0.result(timeout=30), f1.result(timeout=30)


@pytest.fixture
def links() -> Iterator[tuple[Link, Link]]:
    port = free_port()
    stores = (
        dist.TCPStore("127.0.0.1", port, 2, True, timeout=timedelta(seconds=10),
                      wait_for_workers=False),
        dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=10)),
    )  # fmt: skip
    tables = [
        LinkTable(rank=r, rails=(RAILS[r],), store=stores[r], config=CONFIG, transport="socket")
        for r in (0, 1)
    ]
    try:
        yield _both(lambda: tables[0].get(1, 0), lambda: tables[1].get(0, 0))
    finally:
        for t in tables:
            t.close()


def _send_and_exit(sender: Link, payload: torch.Tensor, tag: int) -> None:
    """What a peer does at the end of a job: its last send, then its socket closes."""
    work = sender.isend(payload, tag)
    sender.wait(work, payload.numel() * payload.element_size())
    sock: socket.socket = sender.pg._sock  # type: ignore[union-attr]
    sock.shutdown(socket.SHUT_WR)  # the FIN the kernel shows as the peer's close


def _wait_until_unread(link: Link, nbytes: int) -> None:
    import time

    deadline = time.monotonic() + 5
    while link.pg.unread() < nbytes:  # type: ignore[union-attr]
        assert time.monotonic() < deadline, "the peer's bytes never arrived"
        time.sleep(0.01)


# "large": over the size read straight into its receive (parked while none is
# posted), and within what the socket buffers hold, so the close follows it at once.
@pytest.mark.parametrize("numel", [4, 1 << 13], ids=["small", "large"])
def test_a_receive_posted_after_the_close_was_seen_still_gets_the_last_message(
    links: tuple[Link, Link], numel: int
) -> None:
    slow, peer = links
    payload = torch.arange(numel, dtype=torch.float32)
    _send_and_exit(peer, payload, tag=7)
    _wait_until_unread(slow, 4 * numel)
    assert slow.check_closed()  # the peer is gone, and the link is marked so
    got = torch.zeros(numel)
    work = slow.irecv(got, 7)
    slow.wait(work, 4 * numel)
    assert torch.equal(got, payload)


def test_a_receive_posted_before_the_close_completes_with_its_bytes(
    links: tuple[Link, Link],
) -> None:
    slow, peer = links
    got = torch.zeros(4)
    work = slow.irecv(got, 3)
    # The peer's message and close come while nobody drives this end's socket.
    _send_and_exit(peer, torch.tensor([1.0, 2.0, 3.0, 4.0]), tag=3)
    _wait_until_unread(slow, 16)
    assert slow.check_closed()
    slow.wait(work, 16)
    assert got.tolist() == [1.0, 2.0, 3.0, 4.0]
