"""Subgroups' links over the world group's connections (resilient.links.lending): real
TCP sockets on loopback, rendezvoused through a real TCPStore; the two ends of each
pair are two threads of this process, each with its own tables."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

import pytest
import torch
import torch.distributed as dist

from resilient.config import DataPlaneConfig
from resilient.errors import LinkError
from resilient.links.ledger import GROUP_SHIFT, MAX_SLOT, SALT_SHIFT, OpLedger, tag_slot
from resilient.links.lending import BorrowedLink
from resilient.links.link import Link
from resilient.links.socket_link import SocketLink
from resilient.links.table import LinkTable
from resilient.procs import free_port

pytestmark = pytest.mark.timeout(60)

RAILS = ("127.0.1.1", "127.0.1.2")  # rank 0's and rank 1's address (one rail each)
CONFIG = DataPlaneConfig(op_timeout_floor_s=5.0, data_transport="socket")


def _stores() -> tuple[Any, Any]:
    port = free_port()
    server = dist.TCPStore(
        "127.0.0.1", port, 2, True, timeout=timedelta(seconds=10), wait_for_workers=False
    )
    client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=10))
    return server, client


def _both(fn0: Callable[[], Any], fn1: Callable[[], Any]) -> tuple[Any, Any]:
    with ThreadPoolExecutor(2) as pool:
        f0, f1 = pool.submit(fn0), pool.submit(fn1)
        return f0.result(timeout=30), f1.result(timeout=30)


def _table(rank: int, store: Any, prefix: str) -> LinkTable:
    return LinkTable(
        rank=rank, rails=(RAILS[rank],), store=dist.PrefixStore(prefix, store), config=CONFIG,
        transport="socket",
    )  # fmt: skip


@contextlib.contextmanager
def _world_and_sub(
    lend: tuple[bool, bool] = (True, True),
) -> Iterator[tuple[list[Link], list[Link]]]:
    """Two ranks' world links to each other, and their subgroup's links, which
    borrow the world's where ``lend`` says that rank's world link is offered."""
    stores = _stores()
    world = [_table(r, stores[r], "world/") for r in (0, 1)]
    sub = [_table(r, stores[r], "sub/") for r in (0, 1)]
    for r in (0, 1):
        offered = world[r] if lend[r] else None
        sub[r].borrow = lambda pos, rail, t=offered: t.links().get((pos, rail)) if t else None
    try:
        w = _both(lambda: world[0].get(1, 0), lambda: world[1].get(0, 0))
        s = _both(lambda: sub[0].get(1, 0), lambda: sub[1].get(0, 0))
        yield list(w), list(s)
    finally:
        for t in sub + world:
            t.close()


def _exchange(sender: Link, receiver: Link, value: float, tag: int) -> torch.Tensor:
    got = torch.zeros(4)
    rx = receiver.irecv(got, tag)
    tx = sender.isend(torch.full((4,), value), tag)
    _both(lambda: sender.wait(tx, 16), lambda: receiver.wait(rx, 16))
    return got


def test_a_tag_slot_sits_above_the_salt_and_the_call_number() -> None:
    ledger = OpLedger(salt=3, slot=2)
    assert ledger.tag(7) == 7 + (3 << SALT_SHIFT) + (2 << GROUP_SHIFT)
    assert tag_slot(ledger.tag((1 << 52) + 7)) == 2  # the largest call numbers stay below
    # The largest tag a schedule makes: the last call number, the last step's tag.
    largest = (((1 << 21) - 1) << 32) + (1 << 24) - 1
    assert OpLedger(salt=15, slot=MAX_SLOT).tag(largest) < 1 << 63  # fits int64
    ledger.renew(5)
    assert tag_slot(ledger.tag(7)) == 2 and ledger.salt == 5
    with pytest.raises(ValueError, match="slot"):
        OpLedger(slot=MAX_SLOT + 1)


def test_a_subgroup_link_borrows_the_world_connection_and_both_carry_their_own() -> None:
    with _world_and_sub() as (w, s):
        assert all(isinstance(link, BorrowedLink) for link in s)
        assert s[0].pg is w[0].pg and s[1].pg is w[1].pg  # no second connection
        assert s[0].ledger.slot == s[1].ledger.slot >= 1
        # The same schedule tag in both groups, receives posted in either order.
        got_w = torch.zeros(4)
        got_s = torch.zeros(4)
        rx_s = s[1].irecv(got_s, 5)
        rx_w = w[1].irecv(got_w, 5)
        tx_w = w[0].isend(torch.full((4,), 1.0), 5)
        tx_s = s[0].isend(torch.full((4,), 2.0), 5)
        _both(
            lambda: (w[0].wait(tx_w, 16), s[0].wait(tx_s, 16)),
            lambda: (s[1].wait(rx_s, 16), w[1].wait(rx_w, 16)),
        )
        assert got_w.tolist() == [1.0] * 4 and got_s.tolist() == [2.0] * 4


def test_a_broken_borrowed_link_fails_its_own_ops_and_leaves_the_connection() -> None:
    with _world_and_sub() as (w, s):
        pending = s[1].irecv(torch.zeros(4), 9)
        s[1].abort("test: the subgroup gave this link up")
        assert s[1].broken and not w[1].broken
        with pytest.raises(LinkError):
            s[1].wait(pending, 16)
        # A message of the given-up slot that still comes is dropped, and the world
        # link's traffic goes on over the same connection.
        s[0].isend(torch.full((4,), 3.0), 9)
        assert _exchange(w[0], w[1], 4.0, 9).tolist() == [4.0] * 4
        s[1].close()
        assert _exchange(w[1], w[0], 5.0, 10).tolist() == [5.0] * 4


def test_the_world_link_breaking_fails_the_borrowed_links_waits() -> None:
    with _world_and_sub() as (w, s):
        pending = s[1].irecv(torch.zeros(4), 9)
        w[1].abort("test: NIC down")
        with pytest.raises(LinkError):
            s[1].wait(pending, 16)
        assert s[1].broken


def test_with_nothing_lent_at_one_end_both_ends_build_their_own() -> None:
    with _world_and_sub(lend=(True, False)) as (w, s):
        assert all(type(link) is SocketLink for link in s)
        assert s[0].pg is not w[0].pg
        assert _exchange(s[0], s[1], 6.0, 3).tolist() == [6.0] * 4
        assert _exchange(w[0], w[1], 7.0, 3).tolist() == [7.0] * 4


def test_forgetting_one_groups_call_keeps_the_other_groups_receive() -> None:
    with _world_and_sub() as (w, s):
        key = 77
        base = key << 32
        got = torch.zeros(4)
        rx_w = w[1].irecv(got, base + 1)
        rx_s = s[1].irecv(torch.zeros(4), base + 1)
        pair = w[1].pg
        assert pair.forget_call(key, "test: the subgroup's call fell back", s[1].ledger.slot) == 1
        assert rx_s.error is not None and rx_w.error is None
        tx = w[0].isend(torch.full((4,), 8.0), base + 1)
        _both(lambda: w[0].wait(tx, 16), lambda: w[1].wait(rx_w, 16))
        assert got.tolist() == [8.0] * 4


def test_the_owner_closing_its_connection_is_no_sign_of_the_peers_death() -> None:
    with _world_and_sub() as (w, s):
        w[1].close()  # the world group dropped its link here (a new epoch, a repair)
        assert s[1].check_closed() is False
        assert s[1].broken and not s[1].peer_closed and not s[1].socket_gone
        assert s[1].cut_reason is not None and "ended here" in s[1].cut_reason
