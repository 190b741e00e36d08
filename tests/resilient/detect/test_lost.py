"""Telling a dead peer from a broken link (pure logic over link states)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import pytest

from resilient.detect.lost_peer import dead_peer, left_in_order


@dataclass
class _Link:
    broken: bool = False
    peer_closed: bool = False
    socket_gone: bool = False
    cut_reason: str | None = None


class _Table:
    def __init__(self, links: dict[tuple[int, int], _Link]) -> None:
        self._links = links

    def links(self) -> dict[tuple[int, int], _Link]:
        return dict(self._links)


class _Board:
    """What each peer's health record says it cut: ``{peer: rails}``."""

    def __init__(
        self, cut: dict[int, set[int]] | None = None, left: dict[int, int] | None = None
    ) -> None:
        self.cut, self.left = cut or {}, left or {}

    def peer_cut_rails(self, peer: int) -> set[int]:
        return self.cut.get(peer, set())

    def peer_left_after(self, peer: int) -> int | None:
        return self.left.get(peer)


CLOSED = _Link(broken=True, peer_closed=True)
GONE = _Link(socket_gone=True)
OK = _Link()
STALLED = _Link(broken=True)  # failed at a deadline: the peer may be alive
CUT = _Link(broken=True, cut_reason="the NIC of rail 0 went down")  # cut here before


def _dead(links: dict[tuple[int, int], _Link], board: Any = None) -> int | None:
    return dead_peer([_Table(links)], 2, board or _Board())  # type: ignore[list-item]


@pytest.mark.timeout(10)
def test_a_peer_closed_on_every_rail_is_dead() -> None:
    assert _dead({(2, 0): CLOSED, (2, 1): CLOSED, (1, 0): OK}) == 2


@pytest.mark.timeout(10)
def test_a_rail_whose_socket_gloo_already_closed_counts_with_one_closed_rail() -> None:
    assert _dead({(2, 0): CLOSED, (2, 1): GONE}) == 2
    # Gone sockets alone never make a peer dead: some error of the peer's must show.
    assert _dead({(2, 0): GONE, (2, 1): GONE}) is None


@pytest.mark.timeout(10)
def test_a_stalled_rail_or_a_peer_that_cut_its_links_is_not_dead() -> None:
    assert _dead({(2, 0): CLOSED, (2, 1): STALLED}) is None
    assert _dead({(2, 0): CLOSED, (2, 1): OK}) is None
    assert _dead({(2, 0): CLOSED, (2, 1): CLOSED}, _Board({2: {0, 1}})) is None


@pytest.mark.timeout(10)
def test_a_rail_cut_before_for_a_nic_down_leaves_the_other_rails_to_tell() -> None:
    # Seen in a chaos run: the killed rank's rail-0 NIC was down, its rail-1 links
    # closed, and the survivors, waiting for a close on rail 0 too, raised
    # LinkError out of DDP instead of recovering.
    assert _dead({(2, 0): CUT, (2, 1): CLOSED}) == 2
    # Its record explains the rail-0 NIC; the rail-1 close it does not explain.
    assert _dead({(2, 0): CLOSED, (2, 1): CLOSED}, _Board({2: {0}})) == 2
    # A close it explains is not evidence, and a cut rail alone never is.
    assert _dead({(2, 0): CUT, (2, 1): CLOSED}, _Board({2: {1}})) is None
    assert _dead({(2, 0): CUT, (2, 1): GONE}) is None
    assert _dead({(2, 0): CUT, (2, 1): STALLED}) is None


@pytest.mark.timeout(10)
def test_a_departure_is_orderly_only_after_every_call_this_rank_made() -> None:
    board: Any = _Board(left={2: 7})
    assert left_in_order(board, 2, 7)  # it took part in all 7
    assert left_in_order(board, 2, 6)
    assert not left_in_order(board, 2, 8)  # this rank is in call 8, which it left
    assert not left_in_order(board, 1, 0)  # rank 1 never said it left
    assert not left_in_order(board, 2, None)  # calls not counted here: never orderly
