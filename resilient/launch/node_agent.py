"""The node agent's side of ``resilient run --nnodes N``: meeting the other agents.

Each agent registers in etcd (:class:`membership.nodes.NodeRendezvous`: node rank,
ranks per node, rail count, under the job token and a lease of its own) and waits
for all N. Global ranks need no agreement: node K's local rank L is rank
``K * P + L`` (:meth:`LaunchConfig.global_rank`).

torch's ``init_process_group`` still needs a TCPStore at MASTER_ADDR:MASTER_PORT
(``env://``); node 0's agent hosts it and publishes where in its node record, the
others hand that address to their ranks. Under the run id (``RESILIENT_RUN_ID``,
always set by these agents) ranks that call ``resilient.init()`` never use it:
torch's init, the links and subgroup rosters meet in etcd. A rank started with
``env://`` needs it to start or restart, so only while node 0's agent runs.

A spare may take node 0 over too: it hosts an init store of its own (every
interface, named by its host name) and publishes it, with the run id, in its
node-0 record; its ranks get that address. Ranks of other nodes keep the old one:
only ``resilient.init()`` ranks restart without node 0's first agent.

Once its ranks run, an agent is fenced by its node lease
(:meth:`NodeRendezvous.watch_lease`): unable to refresh it, the agent kills its
ranks before etcd could expire it, and exits. A spare agent (``--spare``) waits
until a node is lost (its key gone while it was running), claims that node rank
and starts its ranks as replacements: each global rank at the next incarnation,
admitted by the survivors and given the state by a live peer as any replacement.
An agent started again for a node the job lost (no spare took it) takes it back
the same way; the ranks then rejoin the survivors, or ask to join them where the
group shrank without them (the grow path, recovery.joining; docs/DEPLOY.md says
how reliable that is).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from resilient.config import etcd_config
from resilient.errors import LauncherError, MembershipError
from resilient.procs import host_store

if TYPE_CHECKING:
    from torch._C._distributed_c10d import TCPStore

    from membership.nodes import NodeInfo, NodeRendezvous
    from resilient.launch.launch_config import LaunchConfig
    from resilient.launch.slots import Slot

__all__ = ["NodeMeeting", "fence_notice", "meet_nodes", "node_notice", "takeover_notice"]

logger = logging.getLogger(__name__)


@dataclass(slots=True)
class NodeMeeting:
    """What an agent knows once every node agent is there."""

    rendezvous: NodeRendezvous | None
    nodes: dict[int, NodeInfo]
    master_addr: str
    master_port: int
    store: TCPStore | None  # hosted here (node 0, or a one-node job)
    run_id: str = ""  # this start of the job (node 0's, RESILIENT_RUN_ID)
    # A spare's: the node it took over, and the incarnation each of its ranks
    # starts at; None and empty otherwise.
    took_over: int | None = None
    incarnations: dict[int, int] = field(default_factory=dict)
    finished: bool = False  # a spare whose job ended without needing it
    came_back: bool = False  # took_over is this agent's own node, lost before

    def watch_lease(self, fence: Callable[[str], None]) -> None:
        """Call ``fence(why)`` (another thread) when the node lease may lapse."""
        if self.rendezvous is not None:
            self.rendezvous.watch_lease(fence)

    def mark_done(self) -> None:
        """Record that this node finished (every rank done): no spare takes it over.
        Never raises: an etcd error is logged."""
        if self.rendezvous is None:
            return
        from membership.nodes import DONE

        try:
            self.rendezvous.set_state(DONE)
        except MembershipError as exc:
            logger.warning(
                "node %d: recording it done failed: %s", self.rendezvous.me.node_rank, exc
            )

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


def fence_notice(node: int, why: str, code: int) -> str:
    """What a fenced agent says as it exits."""
    return (
        f"node {node} fenced: {why}; its ranks were killed so that none runs beside a "
        f"replacement (etcd unreachable, or this machine too slow to refresh?); exiting "
        f"with {code}"
    )


def takeover_notice(node: int, slots: Sequence[Slot], *, came_back: bool = False) -> str:
    """What a spare agent says as it takes lost ``node`` over (``came_back``: what
    the node's own agent, started again, says as it takes it back)."""
    ranks = ", ".join(f"{s.rank} (incarnation {s.incarnation})" for s in slots)
    if came_back:
        return f"node {node} was lost and comes back: ranks {ranks} rejoin the job"
    return f"spare node: node {node} was lost; taking it over: ranks {ranks}"


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
    if cfg.spare:
        return _stand_by(cfg, etcd_url, stopping)
    store = host_store(cfg.master_addr) if cfg.node_rank == 0 else None
    run = secrets.token_hex(8) if cfg.node_rank == 0 else ""
    if cfg.nnodes == 1:
        assert store is not None
        return NodeMeeting(None, {}, cfg.master_addr, store.port, store, run_id=run)
    from membership.nodes import NodeInfo, NodeRendezvous, this_host

    host, pid = this_host()
    me = NodeInfo(
        node_rank=cfg.node_rank, nnodes=cfg.nnodes, nproc_per_node=cfg.nproc,
        rails=cfg.rails, host=host, pid=pid,
        store=f"{cfg.master_addr}:{store.port}" if store is not None else "", run=run,
    )  # fmt: skip
    where = f"job {cfg.job}, node {cfg.node_rank} of {cfg.nnodes}"
    try:
        rendezvous = NodeRendezvous(
            etcd_config(etcd_url), cfg.job, cfg.token, me, lease_ttl_s=cfg.lease_ttl_s
        )
        if rendezvous.was_lost():
            return _come_back(cfg, rendezvous, where, stopping)
        nodes = rendezvous.join(cfg.join_timeout_s, stopping)
    except MembershipError as exc:
        raise LauncherError(f"{where}: the node agents did not meet: {exc}") from exc
    addr, port = _init_store(rendezvous, nodes, where)
    logger.info("%s: all %d node agents are there; init store %s", where, cfg.nnodes, addr)
    return NodeMeeting(rendezvous, nodes, addr, port, store, run_id=nodes[0].run)


def _come_back(
    cfg: LaunchConfig, rendezvous: NodeRendezvous, where: str, stopping: Callable[[], bool] | None
) -> NodeMeeting:
    """This agent's node was lost from the job, which runs on: claim it back and
    start its ranks as replacements, as a spare taking it over would.

    Raises:
        ConfigError: this agent disagrees with the node agents there.
        LauncherError: node 0 (its init store and the run id went with its first
            agent: a spare node takes node 0 over); the node was not lost within
            ``cfg.join_timeout_s`` or a spare took it first; etcd refused or did
            not answer.
    """

    def claim() -> int:
        if cfg.node_rank == 0:
            raise MembershipError(
                "node 0 was lost from the running job and cannot come back as node 0 "
                "(torch's init store and the run id went with its first agent); "
                "start this agent with --spare to take a lost node over"
            )
        rendezvous.take_back(cfg.join_timeout_s, stopping)
        return cfg.node_rank

    claimed = _claim(cfg, rendezvous, where, claim)
    assert claimed is not None
    _, incarnations, nodes = claimed
    addr, port = _init_store(rendezvous, nodes, where)
    logger.warning("%s: came back to the running job; init store %s", where, addr)
    return NodeMeeting(
        rendezvous, nodes, addr, port, None, run_id=nodes[0].run, took_over=cfg.node_rank,
        incarnations=incarnations, came_back=True,
    )  # fmt: skip


def _claim(
    cfg: LaunchConfig, rendezvous: NodeRendezvous, where: str, claim: Callable[[], int | None]
) -> tuple[int, dict[int, int], dict[int, NodeInfo]] | None:
    """Run ``claim`` (returns the node this agent claimed, None when the job ended
    without needing it), then read the next incarnation of each of its ranks and
    the node agents. The rendezvous is closed on any error, and when not needed.

    Raises:
        LauncherError: etcd refused or did not answer, or ``claim`` raised a
            MembershipError (its message follows ``where``).
    """
    try:
        node = claim()
        if node is None:
            rendezvous.close()
            return None
        first = node * cfg.nproc
        return node, rendezvous.incarnations(range(first, first + cfg.nproc)), rendezvous.agreeing()
    except MembershipError as exc:
        rendezvous.close()
        raise LauncherError(f"{where}: {exc}") from exc
    except BaseException:
        rendezvous.close()
        raise


def _init_store(
    rendezvous: NodeRendezvous, nodes: dict[int, NodeInfo], where: str
) -> tuple[str, int]:
    """Where node 0's agent hosts torch's init store.

    Raises:
        LauncherError: node 0 is not there or published no address.
    """
    published = nodes[0].store if 0 in nodes else ""
    addr, _, port = published.rpartition(":")
    if not addr or not port.isdigit():
        rendezvous.close()
        raise LauncherError(f"{where}: node 0 published no init store ({published!r})")
    return addr, int(port)


def _stand_by(cfg: LaunchConfig, etcd_url: str, stopping: Callable[[], bool] | None) -> NodeMeeting:
    """A spare node agent: register, wait for a node to be lost, claim it.

    Raises:
        ConfigError: this spare's ``nnodes``, ranks per node or rail count differ
            from the node agents'.
        LauncherError: etcd refused or did not answer; the job has another token;
            node 0 was lost in a job without a run id (not survivable); stopped by a
            signal; an init store could not be hosted (taking node 0 over).
    """
    from membership.nodes import NodeInfo, NodeRendezvous, this_host

    host, pid = this_host()
    me = NodeInfo(
        node_rank=-1, nnodes=cfg.nnodes, nproc_per_node=cfg.nproc, rails=cfg.rails,
        host=host, pid=pid,
    )  # fmt: skip
    where = f"job {cfg.job}, spare node"
    rendezvous = NodeRendezvous(
        etcd_config(etcd_url), cfg.job, cfg.token, me, lease_ttl_s=cfg.lease_ttl_s, spare=True
    )
    # An init store of its own if it takes node 0 over, on every interface, named
    # by this machine's host name: --master-addr names node 0's first machine.
    hosted: list[TCPStore] = []

    def store() -> str:
        if not hosted:
            hosted.append(host_store(host))
        return f"{host}:{hosted[0].port}"

    def claim() -> int | None:
        rendezvous.register_spare()
        return rendezvous.wait_for_loss(stopping, store)

    if (claimed := _claim(cfg, rendezvous, where, claim)) is None:
        return NodeMeeting(None, {}, "", 0, None, finished=True)
    node, incarnations, nodes = claimed
    addr, port = _init_store(rendezvous, nodes, where)
    logger.warning("%s: took node %d over; init store %s", where, node, addr)
    return NodeMeeting(
        rendezvous, nodes, addr, port, hosted[0] if node == 0 and hosted else None,
        run_id=nodes[0].run, took_over=node, incarnations=incarnations,
    )  # fmt: skip
