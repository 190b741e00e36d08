"""Pure schedule math: chunking, rail splits, ring step bookkeeping."""

from __future__ import annotations

import itertools

import pytest

from resilient.collectives.ring_plan import (
    Span,
    avoiding_ring,
    even_bounds,
    rail_pieces,
    rail_sizes,
    recv_chunk,
    send_chunk,
    sub_spans,
)


@pytest.mark.timeout(10)
@pytest.mark.parametrize("n,parts", [(0, 3), (1, 4), (10, 4), (1001, 4), (7, 7)])
def test_even_bounds_cover_exactly(n: int, parts: int) -> None:
    spans = even_bounds(n, parts)
    assert len(spans) == parts
    assert spans[0].start == 0 and spans[-1].stop == n
    assert all(a.stop == b.start for a, b in itertools.pairwise(spans))
    assert max(s.size for s in spans) - min(s.size for s in spans) <= 1


@pytest.mark.timeout(10)
def test_rail_sizes_follow_weights_and_sum() -> None:
    assert rail_sizes(100, [1, 1]) == [50, 50]
    assert rail_sizes(100, [3, 1]) == [75, 25]
    assert rail_sizes(100, [1, 0]) == [100, 0]
    assert rail_sizes(100, [0, 1]) == [0, 100]
    assert sum(rail_sizes(1001, [0.3, 0.3, 0.4])) == 1001
    with pytest.raises(ValueError):
        rail_sizes(10, [0, 0])
    with pytest.raises(ValueError):
        rail_sizes(10, [-1, 2])


@pytest.mark.timeout(10)
def test_chunk_membership_independent_of_weights() -> None:
    chunks = even_bounds(1003, 4)

    def owner(pieces: list[list[Span]], element: int) -> int:
        for rail in pieces:
            for c, span in enumerate(rail):
                if span.start <= element < span.stop:
                    return c
        raise AssertionError(element)

    a = rail_pieces(chunks, [1, 1])
    b = rail_pieces(chunks, [5, 1])
    assert all(owner(a, e) == owner(b, e) for e in range(1003))


@pytest.mark.timeout(10)
@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_ring_bookkeeping(world: int) -> None:
    for rank in range(world):
        left = (rank - 1) % world
        for step in range(2 * (world - 1)):
            # What I receive at step t is what my left neighbour sends at step t ...
            assert recv_chunk(rank, step, world) == send_chunk(left, step, world)
            # ... and what I send at step t+1.
            assert recv_chunk(rank, step, world) == send_chunk(rank, step + 1, world)
        # reduce_scatter (shift -1) ends with rank owning its own chunk.
        assert recv_chunk(rank, world - 2, world, shift=-1) == rank


@pytest.mark.timeout(10)
def test_sub_spans_partition() -> None:
    subs = sub_spans(Span(10, 30), 3)
    assert [s.size for s in subs] == [7, 7, 6]
    assert subs[0].start == 10 and subs[-1].stop == 30
    assert all(s.size == 0 for s in sub_spans(Span(5, 5), 4))


def test_skip_bounds_leaves_one_part_empty_and_shares_the_rest() -> None:
    from resilient.collectives.ring_plan import skip_bounds

    for skip in range(4):
        spans = skip_bounds(10, 4, skip)
        assert spans[skip].size == 0
        assert [s.size for i, s in enumerate(spans) if i != skip] == [4, 3, 3]
        assert spans[0].start == 0 and spans[-1].stop == 10
        assert all(a.stop == b.start for a, b in itertools.pairwise(spans))
    with pytest.raises(ValueError):
        skip_bounds(10, 4, 4)


def _ring_pairs(order: tuple[int, ...]) -> set[tuple[int, int]]:
    n = len(order)
    return {
        (min(order[i], order[(i + 1) % n]), max(order[i], order[(i + 1) % n])) for i in range(n)
    }


def _ring_exists(world: int, cut: set[tuple[int, int]]) -> bool:
    return any(
        not _ring_pairs((0, *rest)) & cut for rest in itertools.permutations(range(1, world))
    )


@pytest.mark.parametrize("world", [4, 5, 6, 7])
def test_avoiding_ring_finds_a_ring_without_the_cut_pairs_whenever_one_exists(world: int) -> None:
    pairs = list(itertools.combinations(range(world), 2))
    for k in (1, 2, 3):
        for cut in itertools.islice(itertools.combinations(pairs, k), 200):
            order = avoiding_ring(world, cut)
            assert (order is not None) == _ring_exists(world, set(cut)), (world, cut, order)
            if order is not None:
                assert sorted(order) == list(range(world))
                assert not _ring_pairs(order) & set(cut), (cut, order)
                assert avoiding_ring(world, [(b, a) for a, b in reversed(cut)]) == order


def test_avoiding_ring_keeps_the_natural_order_without_cuts_and_has_none_for_three() -> None:
    assert avoiding_ring(4, []) is None
    assert avoiding_ring(3, [(0, 1)]) is None  # every ring of three uses every pair
    assert avoiding_ring(4, [(1, 2)]) == (0, 1, 3, 2)
    assert avoiding_ring(4, [(0, 1), (0, 2)]) is None  # rank 0 would have one neighbour
