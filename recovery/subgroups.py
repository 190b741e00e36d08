"""Subgroups follow the world group into its next epoch.

A job's subgroups (``new_group``, DeviceMesh dimensions) have links and call checks
of their own, but no membership: :class:`~recovery.session.Session` moves them with
the world group. When the world group loses a rank, every subgroup gives its calls
of the step up (those holding the rank because it is gone, the others because the
step is replayed everywhere: see ``resilient.process_group``). Once the next epoch
is agreed, every subgroup whose ranks changed (a replacement, a shrink, a growth)
or that a replacement made while it waited enters that epoch with the members of
the plan it holds; the others give up the step's calls and enter it too, so every
group's call sequence starts again at the replayed step on every rank. A
subgroup's links are all built again on first use (its survivors' too: the cost
of one rendezvous per pair, against keeping track of which call each link was in).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

from recovery.agree import Plan

__all__ = ["follow"]

logger = logging.getLogger(__name__)


def follow(plan: Plan, before: Sequence[int], rank: int, timeout_s: float) -> int:
    """Move this process's subgroups into ``plan``'s epoch (``before``: the world
    group's members before it; ``rank``: this rank in the job). Returns how many
    subgroups moved.

    Raises:
        RecoveryError: a subgroup's calls of the failed step still run after
            ``timeout_s``.
    """
    from resilient.process_group import live_subgroups

    moved = 0
    for sg in live_subgroups():
        members = tuple(g for g, r in enumerate(sg.job_ranks) if r in plan.members)
        if sg.rank() not in members:
            continue  # cannot happen while this rank is in the plan; nothing to move
        if not sg.joining:
            if sg.lost is None:
                sg.epochs.peer_loss.abandon(f"the job moves to epoch {plan.epoch}")
            sg.quiesce(timeout_s)
        sg.enter_epoch(plan.epoch, keep_data=[], keep_ctl=None, members=members)
        moved += 1
        logger.info(
            "rank %d (epoch %d): subgroup of ranks %s follows with group ranks %s "
            "(job members before: %s)",
            rank, plan.epoch, list(sg.job_ranks), list(members), list(before),
        )  # fmt: skip
    return moved
