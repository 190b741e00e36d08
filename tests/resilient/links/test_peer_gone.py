"""LinkTable.peer_gone: how a rendezvous wait learns that its peer shut its group
down (pure logic over a stand-in ``gone``; the real path, with processes, is in
tests/resilient/group/test_departure.py)."""

from __future__ import annotations

import time

import pytest
import torch.distributed as dist

from resilient.config import DataPlaneConfig
from resilient.errors import LinkError
from resilient.links.handshake import Handshake
from resilient.links.table import GONE_EVERY_S, LinkTable

pytestmark = pytest.mark.timeout(30)


def _table() -> tuple[LinkTable, list[int]]:
    store, config = dist.HashStore(), DataPlaneConfig()
    table = LinkTable(rank=0, rails=("127.0.0.1",), store=store, config=config)
    asked: list[int] = []
    left = {2}

    def gone(peer: int) -> str | None:
        asked.append(peer)
        return f"rank {peer} shut its group down" if peer in left else None

    table.gone = gone
    return table, asked


def test_a_peer_still_there_is_read_at_most_every_period() -> None:
    table, asked = _table()
    assert table.peer_gone(1) is None
    assert table.peer_gone(1) is None  # at once again: no second read
    assert asked == [1]
    time.sleep(GONE_EVERY_S * 1.5)
    assert table.peer_gone(1) is None
    assert asked == [1, 1]
    assert table.left_peers == {}


def test_a_departure_is_remembered_until_the_epoch_ends() -> None:
    table, asked = _table()
    assert table.peer_gone(2) == "rank 2 shut its group down"
    assert table.peer_gone(2) == "rank 2 shut its group down"  # remembered, not read
    assert asked == [2]
    assert table.left_peers == {2: "rank 2 shut its group down"}
    table.renew(1, keep=())
    # A new epoch (maybe a new numbering) forgets it and reads again.
    assert table.left_peers == {}
    assert table.peer_gone(2) is not None and asked == [2, 2]


def test_a_handshake_wait_ends_when_its_peer_left() -> None:
    table, _ = _table()
    table.config = DataPlaneConfig(connect_timeout_s=30.0)
    start = time.monotonic()
    with pytest.raises(LinkError, match="rank 2 shut its group down"):
        Handshake(table).poll(f"{table.name}/e0/never", 2, 0)
    assert time.monotonic() - start < 5.0
