"""What a node agent says about whole nodes: lost, fenced, taken over, returned.

The per-rank events (``rank.lost``, ``recovery.started``) say what became of each
rank; an SRE looking at a machine that died wants one line for the machine. Each
of these events names the node (``node``), its global ranks (``ranks``), the agent
it concerns (``host``, ``pid``) and why (``reason``):

* ``node.lost``: a node's lease lapsed while it was running and none of its ranks
  holds a member key, or its machine refused a connect to its agent's beacon (the
  agent died; :mod:`membership.node_probe`: known in well under a second).
  Written by the spare agent that claims it, or, with no spare registered, by
  the live node agent of the lowest node rank (one line per loss), which also
  announces "none" for each of the lost ranks: no agent is left to
  restart them, and the survivors' recovery gives every rank announced "none" up
  at once (recovery's shrink check), so the job shrinks by the whole node in one
  epoch as soon as the loss is known rather than after ``--shrink-after``;
* ``node.fenced``: this agent could not refresh its node lease and killed its
  ranks before etcd could expire it (the agent then exits 69);
* ``node.taken_over``: this spare agent claimed the lost node and starts its ranks
  as replacements (``incarnations``), ``lost_host``/``lost_pid`` naming the agent
  that ran it before.
"""

from __future__ import annotations

import logging
import os
import socket
import time
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

from resilient.errors import MembershipError

if TYPE_CHECKING:
    from resilient.launch.launch_config import LaunchConfig
    from resilient.launch.leases import LeaseWatch
    from resilient.launch.node_agent import NodeMeeting
    from resilient.launch.slots import Slot

__all__ = ["NodeWatch", "fenced_events", "takeover_events"]

logger = logging.getLogger(__name__)

# How often a node agent looks for lost nodes: three etcd reads each time; a loss
# is known only once a lease lapsed (seconds), so finer polling buys little.
_POLL_S: Final = 0.5

Emit = Callable[..., None]


def fenced_events(emit: Emit, node: int, slots: Sequence[Slot], why: str, at: float) -> None:
    """A fenced agent's events: one ``node.fenced`` (naming this agent's host and
    pid), then ``rank.lost`` per rank (read by the chaos report). Dated ``at``,
    when the fence killed the ranks: the supervisor that logs them may have been
    blocked on the unreachable etcd for seconds by then."""
    ranks = [s.rank for s in slots]
    emit(
        "node.fenced", node=node, ranks=ranks, host=socket.gethostname(), pid=os.getpid(), ts=at,
        reason=why, action=f"killed ranks {ranks}; the node agent exits",
    )  # fmt: skip
    for slot in slots:
        emit(
            "rank.lost", rank=slot.rank, incarnation=slot.incarnation, ts=at,
            reason=f"node {node} fenced: {why}",
            action="killed with its node; the node agent exits",
        )  # fmt: skip


def takeover_events(emit: Emit, meeting: NodeMeeting, node: int, slots: Sequence[Slot]) -> None:
    """A spare's events as it takes lost ``node`` over: ``node.lost`` (the spare
    saw it first), ``node.taken_over``, and ``recovery.started`` per rank; the
    node's own agent's as it takes it back: ``node.returned``, then the same
    ``recovery.started``."""
    rendezvous = meeting.rendezvous
    me = rendezvous.me if rendezvous is not None else None
    agent = {"host": me.host if me else "", "pid": me.pid if me else 0}
    ranks = [s.rank for s in slots]
    incs = {str(s.rank): s.incarnation for s in slots}
    if meeting.came_back:  # node.lost was written when the loss was found
        emit(
            "node.returned", node=node, ranks=ranks, **agent, incarnations=incs,
            reason=f"node {node} was lost; its agent started again",
            action=f"its agent takes it back and starts ranks {ranks} as replacements",
        )  # fmt: skip
        how = f"its agent took lost node {node} back"
    else:
        if rendezvous is not None:
            why = rendezvous.why_lost(node)
        else:
            from membership.nodes import LEASE_LAPSED  # etcd's client is slow to import

            why = LEASE_LAPSED
        before = rendezvous.took_from if rendezvous is not None else None
        lost = {"host": before.host if before else "", "pid": before.pid if before else 0}
        emit(
            "node.lost", node=node, ranks=ranks, **lost, reason=why,
            action="a spare node takes it over",
        )  # fmt: skip
        emit(
            "node.taken_over", node=node, ranks=ranks, **agent, lost_host=lost["host"],
            lost_pid=lost["pid"], incarnations=incs, reason=f"node {node} was lost ({why})",
            action=f"spare agent starts ranks {ranks} as replacements",
        )  # fmt: skip
        how = f"spare node took lost node {node} over"
    for slot in slots:
        action = f"{how}: incarnation {slot.incarnation}"
        emit("recovery.started", rank=slot.rank, incarnation=slot.incarnation, action=action)


class NodeWatch:
    """A (non-spare) node agent's look-out for lost nodes; :meth:`poll` from the
    supervisor's loop (it reads etcd at most every 0.5 s, never raises)."""

    def __init__(
        self,
        cfg: LaunchConfig,
        meeting: NodeMeeting,
        leases: LeaseWatch | None,
        *,
        emit: Emit,
        notice: Callable[[str], None],
    ) -> None:
        self._cfg, self._meeting, self._leases = cfg, meeting, leases
        self._emit, self._notice = emit, notice
        self._handled: set[int] = set()
        self._due = 0.0

    def poll(self) -> None:
        rendezvous = self._meeting.rendezvous
        now = time.monotonic()
        if rendezvous is None or rendezvous.spare or rendezvous.fenced or now < self._due:
            return
        self._due = now + _POLL_S
        try:
            probe = self._neighbour(rendezvous)
            lost = [k for k in rendezvous.lost_nodes(probe=probe) if k not in self._handled]
            if not lost or rendezvous.spares():
                return  # a spare claims it, and says so (takeover_events)
        except MembershipError as exc:
            logger.debug("node %d: looking for lost nodes failed: %s", self._cfg.node_rank, exc)
            return
        live = set(rendezvous.seen) - set(lost) - self._handled
        self._handled |= set(lost)
        if min(live, default=self._cfg.node_rank) != self._cfg.node_rank:
            return  # the live agent of the lowest node rank speaks for all
        for node in lost:
            self._report(rendezvous, node)

    def _neighbour(self, rendezvous: Any) -> tuple[int, ...]:
        """The node whose beacon this agent knocks on: the next live one below it
        (the lowest agent takes the highest), so each node has one prober and a
        node lost with its prober is probed by the next one up once that is known."""
        me = self._cfg.node_rank
        others = sorted(set(rendezvous.seen) - self._handled - {me})
        below = [k for k in others if k < me]
        return (below[-1],) if below else tuple(others[-1:])

    def _report(self, rendezvous: Any, node: int) -> None:
        """``node`` is lost and no spare comes: say so once, and announce "none"
        for each of its ranks (nothing is left to restart them)."""
        cfg = self._cfg
        ranks = list(range(node * cfg.nproc, (node + 1) * cfg.nproc))
        left = cfg.world_size - cfg.nproc * len(self._handled)
        shrink = cfg.min_ranks is not None and left >= cfg.min_ranks
        before = rendezvous.seen.get(node)
        action = (
            f"no spare node: the job goes on without ranks {ranks} ({left} ranks, "
            f"--min-ranks {cfg.min_ranks})"
            if shrink
            else f"no spare node and no shrink allowed (--min-ranks {cfg.min_ranks}): "
            "the survivors wait for a replacement until their timeout"
        )
        self._emit(
            "node.lost", node=node, ranks=ranks, host=before.host if before else "",
            pid=before.pid if before else 0, seen_by=cfg.node_rank,
            reason=rendezvous.why_lost(node), action=action,
        )  # fmt: skip
        for rank in ranks:
            inc = rendezvous.incarnation_of(rank)
            if self._leases is not None:
                self._leases.announce(rank, inc, "none", None)
            self._emit(
                "rank.lost", rank=rank, incarnation=inc, reason=f"node {node} was lost",
                action="go on without it (shrink)" if shrink else "none: no spare node",
                left=shrink,
            )  # fmt: skip
        self._notice(f"node {node} was lost (ranks {ranks}); {action}")
        logger.warning("node %d: node %d lost (ranks %s); %s", cfg.node_rank, node, ranks, action)
