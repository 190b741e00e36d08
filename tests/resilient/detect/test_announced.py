"""The launcher's announcement of a replacement as a doorbell for a lost rank.

With real etcd: an announcement written the way the launcher writes it reaches the
watching rank with the rank it names. With real processes: a peer SIGKILLed while
nobody calls anything is declared lost as soon as the announcement makes a
survivor look at its links (the others learn it from that survivor, through the
health board); the same probe of a live peer changes nothing.
"""

from __future__ import annotations

import os
import queue
import signal
import time
from typing import Any

import pytest
import torch

from membership import Membership
from membership.server import EmbeddedEtcd
from resilient.config import EtcdConfig, MembershipConfig
from resilient.detect.announcements import watch_announcements
from resilient.launch.leases import LeaseWatch
from tests._dist import run_world

TOKEN = "announce-token"


@pytest.mark.timeout(60)
def test_an_announcement_reaches_the_watch_with_the_rank_it_names(
    etcd_server: EmbeddedEtcd, etcd_config: EtcdConfig, job_name: str
) -> None:
    member = Membership(etcd_config, MembershipConfig(job=job_name, lease_ttl_s=5.0))
    launcher = LeaseWatch(etcd_server.url, job_name)
    heard: queue.Queue[int] = queue.Queue()
    try:
        member.join(0, 0, [], TOKEN)
        assert watch_announcements(member, heard.put) is not None
        launcher.announce(3, 1, "warm", None)
        assert heard.get(timeout=10) == 3
        launcher.announce(2, 1, "none", None)
        assert heard.get(timeout=10) == 2
    finally:
        member.close()
        launcher.close()


def _probe(pg: Any, rank: int, world: int) -> dict[str, Any]:
    pg.allreduce([torch.ones(1_000_000)]).wait()  # every link is built and idle
    pg.barrier().wait()
    if rank == world - 1:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.5)  # idle: nothing notices the death by itself
    if rank == 1:
        # Rank 1 probes nothing: it learns of the loss from rank 0, through the
        # health board, as every survivor that did not hear the launcher would.
        deadline = time.monotonic() + 10.0
        while pg.lost is None and time.monotonic() < deadline:
            time.sleep(0.01)
        return {"lost": (type(pg.lost).__name__, getattr(pg.lost, "peer", None))}
    before = pg.lost
    pg.epochs.peer_loss.probe(1)  # alive
    alive = pg.lost
    pg.epochs.peer_loss.probe(world - 1)
    lost = pg.lost
    return {
        "before": before is None,
        "live peer probed": alive is None,
        "lost": (type(lost).__name__, getattr(lost, "peer", None)),
    }


@pytest.mark.timeout(120)
def test_a_killed_idle_peer_is_lost_when_probed_and_a_live_one_is_not() -> None:
    results = run_world(_probe, 3, timeout_s=90, dead=frozenset({2}))

    assert results[2] == -signal.SIGKILL
    assert results[0] == {"before": True, "live peer probed": True, "lost": ("PeerLost", 2)}
    assert results[1] == {"lost": ("PeerLost", 2)}
