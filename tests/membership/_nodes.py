"""Node rendezvous for the membership tests: records, and two agents met and running."""

from __future__ import annotations

import threading

from membership.nodes import RUNNING, NodeInfo, NodeRendezvous
from resilient.config import EtcdConfig

TOKEN = "t0ken"


def info(node_rank: int, *, nproc: int = 2, pid: int = 0, probe: str = "") -> NodeInfo:
    """Node ``node_rank``'s record in a job of two nodes (``probe``: its beacon's
    address; empty: the rendezvous opens a beacon of its own)."""
    return NodeInfo(
        node_rank=node_rank, nnodes=2, nproc_per_node=nproc, rails=1, host="host",
        pid=pid or 1000 + node_rank, store="127.0.0.1:29500" if node_rank == 0 else "",
        probe=probe,
    )  # fmt: skip


def running_job(
    made: list[NodeRendezvous], cfg: EtcdConfig, job: str, *, ttl_s: float, probe_of_1: str = ""
) -> list[NodeRendezvous]:
    """Nodes 0 and 1 met (each joins in its own thread) and are ``running``."""
    agents = [
        NodeRendezvous(cfg, job, TOKEN, info(k, probe=probe_of_1 if k else ""), lease_ttl_s=ttl_s)
        for k in (0, 1)
    ]
    made.extend(agents)
    threads = [threading.Thread(target=a.join, args=(20.0,), daemon=True) for a in agents]
    for t in threads:
        t.start()
    for t in threads:
        t.join(25.0)
    assert agents[0].states() == {0: RUNNING, 1: RUNNING}
    return agents
