"""Telling a lost peer from a broken link.

A process that dies (crash, SIGKILL, OOM kill) has its sockets closed by the
kernel: every link to it, on every rail, fails with "connection closed/reset by
peer" within milliseconds (measured: 40 ms from a SIGKILL to the survivors'
errors, 4 ranks, 2 rails). A broken cable, a NIC down or a DROP rule never close a
connection; they stall it. The one other way a link closes is a peer cutting its
end on purpose (it saw the link dead; :mod:`resilient._health`), and such a peer
first publishes that link as broken. So a peer is declared lost when links to it
closed at its end on *every* rail and its own health record, read now, reports
none of them. A hung peer keeps its sockets open: that needs a deadline or a
lease, not this.
"""

from __future__ import annotations

from collections.abc import Iterable

from resilient._health import HealthBoard
from resilient.links import LinkTable

__all__ = ["closed_rails", "dead_peer"]


def closed_rails(tables: Iterable[LinkTable]) -> dict[int, set[int]]:
    """Per peer, the rails on which a link to it broke because its end closed."""
    closed: dict[int, set[int]] = {}
    for table in tables:
        for (peer, rail), link in table.links().items():
            if link.broken and link.peer_closed:
                closed.setdefault(peer, set()).add(rail)
    return closed


def dead_peer(tables: Iterable[LinkTable], rails: int, board: HealthBoard) -> int | None:
    """The lowest peer whose links closed on every rail without it saying so, or None."""
    for peer, closed in sorted(closed_rails(tables).items()):
        if len(closed) >= rails and not board.peer_cut(peer):
            return peer
    return None
