"""Dealing the data of ranks that left over the members (pure logic)."""

from __future__ import annotations

import itertools

import pytest

from recovery.shards import Piece, pieces


@pytest.mark.parametrize("world", [2, 3, 4, 5, 8])
@pytest.mark.parametrize("rows", [1, 7, 8, 32])
def test_every_row_is_trained_exactly_once_and_loads_stay_even(world: int, rows: int) -> None:
    for m in range(1, world + 1):
        for members in itertools.combinations(range(world), m):
            covered: dict[int, list[int]] = {r: [] for r in range(world)}
            loads = []
            for rank in members:
                mine = pieces(rank, world, members)
                assert mine[0] == Piece(rank), "a member keeps its own shard whole"
                load = 0
                for p in mine:
                    got = list(range(rows))[p.rows(rows)]
                    covered[p.shard] += got
                    load += len(got)
                loads.append(load)
            assert all(sorted(c) == list(range(rows)) for c in covered.values()), members
            # Parts of one shard differ by at most one row; each member gets at most
            # one row more than another per shard that left.
            assert max(loads) - min(loads) <= world - m, (members, loads)


def test_while_everyone_takes_part_a_rank_trains_only_its_own_shard() -> None:
    assert pieces(2, 4, (0, 1, 2, 3)) == [Piece(2)]
    assert Piece(2).rows(8) == slice(0, 8)


def test_a_rank_that_is_not_a_member_has_no_share() -> None:
    with pytest.raises(ValueError):
        pieces(2, 4, (0, 1, 3))
