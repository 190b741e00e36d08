"""Who is in a subgroup: its members agree on it before any link is built.

torch names a group by a counter that every rank bumps on each ``new_group`` call,
so ranks that make their subgroups in different orders give one name to different
rank sets, and their links would meet the wrong peers under one store prefix. Each
member therefore claims its group rank in the group's store (first claim wins) and
reads every member's claim: any disagreement is a :class:`CollectiveMismatch` on
every member, within the connect timeout, before a link exists. A group of one
claims nothing: it has no link to misdirect.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

from torch._C._distributed_c10d import Store

from resilient.errors import CollectiveMismatch, StoreTimeout

__all__ = ["agree_roster"]

_PREFIX = "resilient/roster/"
_CONFLICT = _PREFIX + "conflict"


def _claim(rank: int, job_ranks: Sequence[int]) -> str:
    return f"{job_ranks[rank]}:{','.join(map(str, job_ranks))}"


def _describe(claim: str) -> str:
    job_rank, _, ranks = claim.partition(":")
    return f"rank {job_rank} in a group of ranks [{ranks.replace(',', ', ')}]"


def agree_roster(store: Store, rank: int, job_ranks: Sequence[int], timeout_s: float) -> None:
    """Claim group rank ``rank`` of the subgroup of ``job_ranks`` in ``store`` and
    check every member's claim matches.

    Raises:
        CollectiveMismatch: another process claimed this group rank, or a member
            made the group with other ranks (names both sides).
        StoreTimeout: a member did not claim its rank within ``timeout_s``.
    """
    if len(job_ranks) == 1:
        # A group of one has no peer to meet: no link, no store key. Ranks that make
        # groups in disjoint parts of the job at once (torch's new_subgroups(group=)
        # with group_size=1) give one counter name to different one-rank groups.
        return
    mine = _claim(rank, job_ranks)
    held = store.compare_set(_PREFIX + str(rank), "", mine).decode()
    if held != mine:
        why = (
            f"subgroup made in different orders: group rank {rank} is claimed by "
            f"{_describe(held)} and by {_describe(mine)} (every rank must call "
            "new_group / init_device_mesh in the same order)"
        )
        store.set(_CONFLICT, why)
        raise CollectiveMismatch(why, calls={job_ranks[rank]: mine}, fields=("ranks",))
    deadline = time.monotonic() + timeout_s
    pause = 0.002
    for peer in range(len(job_ranks)):
        key = _PREFIX + str(peer)
        while not store.check([key]):
            if store.check([_CONFLICT]):
                raise CollectiveMismatch(store.get(_CONFLICT).decode(), fields=("ranks",))
            if time.monotonic() > deadline:
                raise StoreTimeout(
                    f"{_describe(mine)}: group rank {peer} (rank {job_ranks[peer]}) did "
                    f"not join the subgroup within {timeout_s:.0f} s"
                )
            time.sleep(pause)
            pause = min(pause * 2, 0.05)
        theirs = store.get(key).decode()
        if theirs != _claim(peer, job_ranks):
            why = (
                f"subgroup made in different orders: {_describe(mine)} meets "
                f"{_describe(theirs)} as group rank {peer}"
            )
            store.set(_CONFLICT, why)
            raise CollectiveMismatch(why, calls={job_ranks[rank]: mine}, fields=("ranks",))
