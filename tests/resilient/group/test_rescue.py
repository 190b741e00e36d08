"""A call a killed peer left complete on one survivor is finished on the others.

Rank 2 of 3 sends its row of an inline all_reduce's exchange to rank 0 and
receives every row, but its row never reaches rank 1 (its send to rank 1 is posted
under a tag rank 1 does not wait for), and it is SIGKILLed 0.5 s later. Rank 0
completes the call; rank 1's copy fails. With
the rescue (resilient.group.rescue) rank 1 finishes the call from rank 0's table, with
the same bits, and both fail the next call with PeerLost, in step again.
"""

from __future__ import annotations

import os
import signal
import threading
from typing import Any

import pytest
import torch

from resilient.group.rescue import decode, encode
from tests._dist import run_world

VICTIM = 2


def _die_without_reaching(peer: int) -> None:
    """The next control-link send to ``peer`` never arrives, and this process dies
    0.5 s after posting it (meanwhile the rest of the exchange goes through)."""
    # Control rows go out through isend_bytes on socket links, isend on gloo ones.
    from resilient.links import link, socket_link

    # Control rows go out through isend_bytes on socket links, isend on gloo ones.
    for cls, name in ((link.Link, "isend"), (socket_link.SocketLink, "isend_bytes")):
        send = getattr(cls, name)

        def lost_send(self: Any, data: Any, tag: int, send: Any = send) -> Any:
            if self.peer == peer and self.prefix.startswith("ctl/"):
                threading.Timer(0.5, os.kill, args=(os.getpid(), signal.SIGKILL)).start()
                tag += 1 << 21  # a message the peer never posts a receive for
            return send(self, data, tag)

        setattr(cls, name, lost_send)


def _lagging_survivor(pg: Any, rank: int, world: int) -> dict[str, Any]:
    from resilient.errors import PeerLost

    pg.barrier().wait()
    x = torch.arange(4, dtype=torch.float32) * (rank + 1)
    if rank == VICTIM:
        _die_without_reaching(1)
    outcome = "completed"
    try:
        pg.allreduce([x]).wait()
    except PeerLost:
        outcome = "PeerLost"
    try:
        pg.allreduce([torch.ones(1)]).wait()
        after = "completed"
    except PeerLost:
        after = "PeerLost"
    return {"call": outcome, "sum": x.tolist(), "next": after}


@pytest.mark.timeout(120)
def test_a_call_completed_by_one_survivor_is_finished_on_the_other_from_its_table() -> None:
    results = run_world(_lagging_survivor, 3, timeout_s=90, dead=frozenset({VICTIM}))

    assert results[VICTIM] == -signal.SIGKILL
    want = (torch.arange(4, dtype=torch.float32) * 6).tolist()
    for rank in (0, 1):
        assert results[rank] == {"call": "completed", "sum": want, "next": "PeerLost"}, rank


@pytest.mark.timeout(10)
def test_a_rescue_record_round_trips_and_a_bad_one_is_refused() -> None:
    table = torch.arange(12, dtype=torch.int64).view(3, 4)
    seq, back = decode(encode(7, table))
    assert seq == 7 and back is not None and torch.equal(back, table)
    assert decode(encode(0, None)) == (0, None)
    with pytest.raises(ValueError):
        decode(encode(7, table)[:-8])
    with pytest.raises(ValueError):
        decode(b"\x00")
