"""The world group lends its connections; its subgroups borrow them.

The mechanism (tag slots on one connection, both ends agreeing before use) is
:mod:`resilient.links.lending`'s. This module knows the groups: which of the world
group's tables serves each kind of link, and how a subgroup's link numbering maps
to job ranks (a subgroup's members are group ranks; the world group's are job
ranks), in whatever epoch each group is.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Protocol

from resilient.links.lending import Lender, lent
from resilient.links.link import Link
from resilient.links.table import LinkTable

__all__ = ["CONTROL", "DATA", "P2P", "borrower", "lender"]

DATA = "link"  # LinkTable names: the data links, the control links, point-to-point
CONTROL = "ctl"
P2P = "p2p"


class _Epochs(Protocol):
    members: tuple[int, ...]
    links: LinkTable

    def tables(self) -> list[LinkTable]: ...


class _PointToPoint(Protocol):
    def link_to(self, peer: int, rail: int) -> Link | None: ...


def lender(epochs: _Epochs, p2p: Callable[[], _PointToPoint | None]) -> Lender:
    """What the world group lends: its data, control and point-to-point links to a
    job rank, each to the subgroups' links of the same kind (point-to-point frames
    never share a connection with the collectives', whose C steps and rail threads
    expect their own traffic there)."""

    def lend(kind: str, job_peer: int, rail: int) -> Link | None:
        members = epochs.members
        if job_peer not in members:
            return None
        pos = members.index(job_peer)
        if kind == P2P:
            chan = p2p()
            return chan.link_to(job_peer, rail) if chan is not None else None
        tables = {t.name: t for t in epochs.tables()}
        table = tables.get(kind)
        return table.links().get((pos, rail)) if table is not None else None

    return lend


def borrower(
    epochs: _Epochs, job_ranks: Sequence[int], kind: str
) -> Callable[[int, int], Link | None]:
    """A subgroup table's ``borrow``: the world's link of ``kind`` to the member at
    position ``pos`` of the subgroup's current epoch."""

    def borrow(pos: int, rail: int) -> Link | None:
        members = epochs.members
        if not 0 <= pos < len(members):
            return None
        return lent(kind, job_ranks[members[pos]], rail)

    return borrow
