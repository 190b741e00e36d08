"""Which peers a rank lists as cut off (pure logic; the rings themselves are tested
in test_collectives.py and, with a real partition, in tests/integration)."""

from __future__ import annotations

from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import pytest

from resilient.collectives.reorder import cut_off_peers


@dataclass
class _Table:
    rails: tuple[str, ...]
    broken: set[tuple[int, int]]
    peers: tuple[int, ...]

    def links(self) -> dict[tuple[int, int], Any]:
        return {
            (p, r): SimpleNamespace(broken=(p, r) in self.broken)
            for p in self.peers
            for r in range(len(self.rails))
        }


def _usable(peer: int, rail: int, table: Any) -> bool:
    return (peer, rail) not in table.broken


@pytest.mark.timeout(10)
def test_a_peer_is_cut_off_only_when_every_rail_to_it_is_unusable_in_some_table() -> None:
    data = _Table(rails=("a", "b"), broken={(2, 0)}, peers=(1, 2, 3))
    ctl = _Table(rails=("a", "b"), broken={(2, 0), (2, 1), (3, 1)}, peers=(1, 2, 3))
    # Rail 1 still reaches 2 on the data links, but no control link does.
    assert cut_off_peers([data], _usable) == []
    assert cut_off_peers([data, ctl], _usable) == [2]
    data.broken.add((2, 1))
    ctl.broken.clear()
    assert cut_off_peers([data, ctl], _usable) == [2]
    data.broken.clear()
    assert cut_off_peers([data, ctl], _usable) == []
