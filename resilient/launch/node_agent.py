"""The node agent's side of ``resilient run --nnodes N``: meeting the other agents.

Each agent registers in etcd (:class:`membership.nodes.NodeRendezvous`: node rank,
ranks per node, rail count, under the job token and a lease of its own) and waits
for all N. Global ranks need no agreement: node K's local rank L is rank
``K * P + L`` (:meth:`LaunchConfig.global_rank`).

torch's ``init_process_group`` still needs a TCPStore at MASTER_ADDR:MASTER_PORT
(``env://``); node 0's agent hosts it and publishes where in its node record, the
others hand that address to their ranks. That store is used only to start a rank
(torch's init, the links' store nonce) and to make subgroups (their rosters); the
links, health, epochs and recovery rendezvous through etcd. So a rank (or a
restarted one) can start only while node 0's agent runs: documented as not fault
tolerant (README, docs/DEPLOY.md).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING

from resilient.config import etcd_config
from resilient.errors import LauncherError, MembershipError
from resilient.procs import host_store

if TYPE_CHECKING:
    from torch._C._distributed_c10d import TCPStore

    from membership.nodes import NodeInfo, NodeRendezvous
    from resilient.launch.launch_config import LaunchConfig

__all__ = ["NodeMeeting", "meet_nodes", "node_notice"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class NodeMeeting:
    """What an agent knows once every node agent is there."""

    rendezvous: NodeRendezvous | None
    nodes: dict[int, NodeInfo]
    master_addr: str
    master_port: int
    store: TCPStore | None  # hosted here (node 0, or a one-node job)

    def close(self) -> None:
        """Leave the job's node list and stop the store this agent hosts."""
        if self.rendezvous is not None:
            self.rendezvous.close()
            self.rendezvous = None
        self.store = None  # closes the server


def node_notice(cfg: LaunchConfig) -> str:
    """``node K of N: ranks A..B of W, `` with several nodes; empty with one."""
    if cfg.nnodes == 1:
        return ""
    first, last = cfg.first_rank, cfg.first_rank + cfg.nproc - 1
    return f"node {cfg.node_rank} of {cfg.nnodes}: ranks {first}..{last} of {cfg.world_size}, "


def meet_nodes(
    cfg: LaunchConfig, etcd_url: str, stopping: Callable[[], bool] | None = None
) -> NodeMeeting:
    """Host the init store (node 0, or ``nnodes`` 1), then, with several nodes,
    register this agent and wait for all of them (up to ``cfg.join_timeout_s``, or
    until ``stopping()``: a signal to the agent).

    Raises:
        ConfigError: the node rank is held by another agent, or this agent's
            ``nnodes``, ranks per node or rail count differ from an earlier one's.
        LauncherError: the store could not be hosted; etcd refused or did not
            answer; the job has another token; not every agent came in time.
    """
    store = host_store(cfg.master_addr) if cfg.node_rank == 0 else None
    if cfg.nnodes == 1:
        assert store is not None
        return NodeMeeting(None, {}, cfg.master_addr, store.port, store)
    from membership.nodes import NodeInfo, NodeRendezvous, this_host

    host, pid = this_host()
    me = NodeInfo(
        node_rank=cfg.node_rank, nnodes=cfg.nnodes, nproc_per_node=cfg.nproc,
        rails=cfg.rails, host=host, pid=pid,
        store=f"{cfg.master_addr}:{store.port}" if store is not None else "",
    )  # fmt: skip
    where = f"job {cfg.job}, node {cfg.node_rank} of {cfg.nnodes}"
    try:
        rendezvous = NodeRendezvous(
            etcd_config(etcd_url), cfg.job, cfg.token, me, lease_ttl_s=cfg.lease_ttl_s
        )
        nodes = rendezvous.join(cfg.join_timeout_s, stopping)
    except MembershipError as exc:
        raise LauncherError(f"{where}: the node agents did not meet: {exc}") from exc
    addr, _, port = nodes[0].store.rpartition(":")
    if not addr or not port.isdigit():
        rendezvous.close()
        raise LauncherError(f"{where}: node 0 published no init store ({nodes[0].store!r})")
    logger.info("%s: all %d node agents are there; init store %s", where, cfg.nnodes, addr)
    return NodeMeeting(rendezvous, nodes, addr, int(port), store)
