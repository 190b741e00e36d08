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

from resilient.links.lending import Lender, lent, usable
from resilient.links.link import Link
from resilient.links.table import LinkTable

__all__ = ["CONTROL", "DATA", "P2P", "borrower", "lender", "own_data"]

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
    job rank (point-to-point falls back to the data link where the world has no
    point-to-point link to that peer: both carry bulk messages)."""

    def lend(kind: str, job_peer: int, rail: int) -> Link | None:
        members = epochs.members
        if job_peer not in members:
            return None
        pos = members.index(job_peer)
        if kind == P2P:
            chan = p2p()
            link = chan.link_to(job_peer, rail) if chan is not None else None
            return link if usable(link) else epochs.links.links().get((pos, rail))
        tables = {t.name: t for t in epochs.tables()}
        table = tables.get(kind)
        return table.links().get((pos, rail)) if table is not None else None

    return lend


def own_data(epochs: _Epochs, kind: str) -> Callable[[int, int], Link | None] | None:
    """The world group's own borrowing: its point-to-point links ride on its data
    links' connections (the other kinds keep their own)."""
    if kind != P2P:
        return None
    return lambda pos, rail: epochs.links.links().get((pos, rail))


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
