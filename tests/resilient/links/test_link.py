"""A link's rendezvous ends within its bound when the peer gives up half-way.

gloo waits five times its timeout for a pair's connection; a peer that published
its address and then never connected (its NIC went down, its build was given up)
held the other end 5x the link's bound (measured in a chaos run: 26 s past 5 s).
A build both ends agreed on (``met``, see resilient.links.table) now ends at its bound.
Real gloo, a real etcd store, a real peer process stopped mid-rendezvous.
"""

from __future__ import annotations

import multiprocessing as mp
import os
import signal
import time

import pytest
from torch._C._distributed_c10d import PrefixStore

from membership.store import EtcdStore
from resilient.config import DataPlaneConfig
from resilient.errors import LinkError
from resilient.links import link, pair_groups

pytestmark = pytest.mark.timeout(60)

PREFIX = "pair/"


def _peer(store: EtcdStore) -> None:
    """The other end (index 0, on 127.0.0.2): comes to the rendezvous and
    publishes its address; the test stops it before it connects."""
    pair_groups.gloo_pair(PrefixStore(PREFIX, store), 0, "127.0.0.2", 60.0)


def test_a_rendezvous_whose_peer_stopped_half_way_fails_within_its_bound(
    etcd_store: EtcdStore,
) -> None:
    peer = mp.get_context("spawn").Process(target=_peer, args=(etcd_store,), daemon=True)
    peer.start()
    try:
        deadline = time.monotonic() + 30
        while not etcd_store.check([PREFIX + "/0/0"]):  # its gloo address is out
            assert time.monotonic() < deadline and peer.is_alive()
            time.sleep(0.01)
        assert peer.pid is not None
        os.kill(peer.pid, signal.SIGSTOP)
        bound = 2.0
        began = time.monotonic()
        with pytest.raises(LinkError):
            # 127.0.0.1 < 127.0.0.2: this end listens, and waits for a connection.
            link.Link(
                rank=1, peer=0, rail=0, address="127.0.0.1", store=etcd_store,
                prefix=PREFIX, config=DataPlaneConfig(connect_timeout_s=bound), met=True,
            )  # fmt: skip
        took = time.monotonic() - began
        assert took < bound + 1.5, took  # not 5x the bound (10 s)
    finally:
        if peer.pid is not None:
            os.kill(peer.pid, signal.SIGKILL)
        peer.join(10)
