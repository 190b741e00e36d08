"""Which data each member trains on after a shrink: its own shard, plus an equal part
of every shard whose rank left.

Data parallelism gives rank ``r`` of ``N`` its own shard of each batch. When the
group shrinks to ``M`` members, the ``L = N - M`` shards of the ranks that left
must still be trained on, exactly once. Dealing whole shards would give one
member two shards: its step takes twice as long while the others wait, and its
rows would count half as much in the gradient (DDP averages the members' means).
Splitting each left shard's rows into ``M`` equal parts instead gives every
member ``1 + L/M`` shards' worth of rows: the step takes ``N/M`` as long (what the
policy's shrink estimate assumes), and the members' means weigh every row alike
when ``M`` divides the batch evenly.

Pure functions of (rank, world, members): every rank computes the same layout.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import NamedTuple

__all__ = ["Piece", "pieces"]


class Piece(NamedTuple):
    """Part ``part`` of ``parts`` equal parts of shard ``shard``'s rows."""

    shard: int
    part: int = 0
    parts: int = 1

    def rows(self, n: int) -> slice:
        """This part's rows of a shard of ``n`` rows (sizes differ by at most one)."""
        return slice(self.part * n // self.parts, (self.part + 1) * n // self.parts)


def pieces(rank: int, world: int, members: Sequence[int]) -> list[Piece]:
    """What ``rank`` trains on: its whole shard first, then its part of each shard
    of a rank that is not a member, in rank order.

    Raises:
        ValueError: ``rank`` is not one of ``members``.
    """
    if rank not in members:
        raise ValueError(f"rank {rank} is not a member of {tuple(members)}")
    index, count = list(members).index(rank), len(members)
    left = [r for r in range(world) if r not in members]
    return [Piece(rank)] + [Piece(r, index, count) for r in left]
