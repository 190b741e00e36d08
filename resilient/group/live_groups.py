"""This process's live groups, and how a peer loss one group declares reaches the
others: the world group's loss fails the subgroups (and, under recovery, every
subgroup gives its step up), and a subgroup that finds a job rank gone tells the
world group, which recovery watches."""

from __future__ import annotations

import atexit
import logging
import weakref
from collections.abc import Callable, Sequence
from typing import Protocol

from resilient.errors import PeerLost

__all__ = ["LiveGroup", "add", "fail_subgroups", "live_subgroups", "tell_world"]

logger = logging.getLogger(__name__)


class _Loss(Protocol):
    def abandon(self, why: str) -> PeerLost: ...


class _Epochs(Protocol):
    @property
    def peer_loss(self) -> _Loss: ...


class LiveGroup(Protocol):
    """What this module needs of a process group (ResilientProcessGroup)."""

    @property
    def is_subgroup(self) -> bool: ...

    @property
    def closed(self) -> bool: ...

    @property
    def job_ranks(self) -> tuple[int, ...]: ...

    @property
    def epochs(self) -> _Epochs: ...

    subgroups_follow: bool

    def declare_lost(self, rank: int, why: str) -> None: ...

    def shutdown(self) -> None: ...


_LIVE: weakref.WeakSet[LiveGroup] = weakref.WeakSet()


def add(pg: LiveGroup) -> None:
    """Count ``pg`` among this process's groups (weakly: a dropped group leaves)."""
    _LIVE.add(pg)


@atexit.register
def _shutdown_live_groups() -> None:
    # A gloo group still alive while the interpreter tears down can abort the
    # process; close whatever the program did not destroy itself.
    for pg in list(_LIVE):
        try:
            pg.shutdown()
        except Exception:  # exiting anyway; never mask the program's own exit status
            logger.debug("shutdown at exit failed", exc_info=True)


def live_subgroups() -> list[LiveGroup]:
    """This process's subgroups (new_group, DeviceMesh dimensions) not shut down."""
    return [pg for pg in list(_LIVE) if pg.is_subgroup and not pg.closed]


def fail_subgroups(lost: PeerLost) -> None:
    """The world group lost ``lost.peer``: every subgroup of this process holding
    that rank gives its calls up at once, instead of each finding out for itself
    at its next call's deadline. When recovery drives the job
    (``subgroups_follow`` on the world group), every other subgroup gives its
    calls up too: the step is replayed on every group."""
    world = [pg for pg in list(_LIVE) if not pg.is_subgroup]
    follow = any(pg.subgroups_follow for pg in world)
    for pg in live_subgroups():
        if lost.peer in pg.job_ranks:
            pg.declare_lost(pg.job_ranks.index(lost.peer), f"the world group lost it ({lost})")
        elif follow:
            pg.epochs.peer_loss.abandon(f"the world group lost rank {lost.peer}; recovering")


def tell_world(job_ranks: Sequence[int]) -> Callable[[PeerLost], None]:
    """For a subgroup of ``job_ranks``: on a peer it declares lost (``lost.peer``
    is its group rank), the world group declares that job rank lost too.

    A job whose step waits in a subgroup's call (FSDP's reduce-scatter, an HSDP
    all-reduce) would otherwise see the loss only there: the world group, which
    recovery reads, may have no call in flight to find it. The subgroup's
    evidence is the world's own kind (the rank's connections closed on every
    rail, or a peer's report), so the world group acts on it as it would on its
    own; it then fails every subgroup (:func:`fail_subgroups`), this one already
    failed.
    """
    ranks = tuple(job_ranks)

    def tell(lost: PeerLost) -> None:
        if not 0 <= lost.peer < len(ranks):
            return  # an abandoned epoch names no rank
        rank = ranks[lost.peer]
        for pg in list(_LIVE):
            if not pg.is_subgroup and not pg.closed:
                pg.declare_lost(rank, f"a subgroup of ranks {list(ranks)} found it gone")

    return tell
