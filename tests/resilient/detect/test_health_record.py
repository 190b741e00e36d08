"""A rank's health record on a real TCPStore when two threads publish it at once."""

from __future__ import annotations

import threading
from datetime import timedelta

import pytest
import torch.distributed as dist

from resilient.detect.health_board import HealthBoard
from tests._held import HeldStore

pytestmark = pytest.mark.timeout(60)


def test_the_record_published_last_is_the_newest_state() -> None:
    server = dist.TCPStore("127.0.0.1", 0, 1, True, timeout=timedelta(seconds=10))
    held = HeldStore(server, "health/e0/r0", hold_s=1.5)
    board = HealthBoard(rank=0, world=2, store=held)
    peer = HealthBoard(rank=1, world=2, store=server)
    # The NIC watch publishes "rail 1 down" and stalls before storing it; the NIC
    # comes back meanwhile and that is published from another thread. Stored last,
    # the older record would tell the peer the NIC is still down (nothing publishes
    # again until the next change), and the link would never be repaired.
    down = threading.Thread(target=board.nic_changed, args=(1, False), daemon=True)
    down.start()
    try:
        assert held.first_in.wait(10.0)
        board.nic_changed(1, True)
    finally:
        down.join(10.0)
    assert not down.is_alive()
    assert peer.peer_cut_rails(0) == set()
