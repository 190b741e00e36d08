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

__all__ = ["closed_rails", "dead_peer", "gone_rails"]


def closed_rails(tables: Iterable[LinkTable]) -> dict[int, set[int]]:
    """Per peer, the rails on which a link to it broke because its end closed."""
    closed: dict[int, set[int]] = {}
    for table in tables:
        for (peer, rail), link in table.links().items():
            if link.broken and link.peer_closed:
                closed.setdefault(peer, set()).add(rail)
    return closed


def gone_rails(tables: Iterable[LinkTable]) -> dict[int, set[int]]:
    """Per peer, the rails on which a link's socket is gone without an error of
    ours: gloo closed it after reading the peer's FIN or RST (measured on the netns
    testbed: after a SIGKILL, the links that had no op pending showed no TCP state
    at all, so only the rail that failed an op showed the peer's close)."""
    gone: dict[int, set[int]] = {}
    for table in tables:
        for (peer, rail), link in table.links().items():
            if not link.broken and link.socket_gone:
                gone.setdefault(peer, set()).add(rail)
    return gone


def dead_peer(tables: Iterable[LinkTable], rails: int, board: HealthBoard) -> int | None:
    """The lowest peer whose links closed on every rail without it saying so, or None.

    A rail counts as closed when a link to the peer on it failed with the peer's
    close, or (given one such rail) when its socket is gone (see gone_rails).
    """
    tables = list(tables)
    gone = gone_rails(tables)
    for peer, closed in sorted(closed_rails(tables).items()):
        if len(closed | gone.get(peer, set())) >= rails and not board.peer_cut(peer):
            return peer
    return None
