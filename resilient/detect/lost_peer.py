"""Telling a lost peer from a broken link.

A process that dies (crash, SIGKILL, OOM kill) has its sockets closed by the
kernel: every link to it, on every rail, fails with "connection closed/reset by
peer" within milliseconds (measured: 40 ms from a SIGKILL to the survivors'
errors, 4 ranks, 2 rails). A broken cable, a NIC down or a DROP rule never close a
connection; they stall it. The one other way a link closes is a peer cutting its
end on purpose (it saw the link dead; :mod:`resilient.detect.health_board`), and such a peer
first publishes that link as broken. So a peer is declared lost when links to it
closed at its end on *every* rail (rails whose links this rank had cut already,
say a NIC down, aside) and its own health record, read now, does not explain at
least one of those closes. A hung peer keeps its sockets open: that needs a deadline or a
lease, not this.

A peer that shuts its group down closes every link too, and a rank still inside
a call then sees the same closes (seen under CPU contention: the last rank out
of the final barrier declared its two peers lost at the end of a clean job). So
a rank records, before its links close, how many of the epoch's calls had
succeeded there (:meth:`~resilient.detect.health_board.HealthBoard.leave`): when that covers every
call this rank has submitted, the peer took part in all of them and sent all
their data before it left, and its closes are an orderly end
(:func:`left_in_order`). A peer that left with fewer (a program that failed,
or whose call failed, and shut its group down in a ``finally``) is lost as before.
"""

from __future__ import annotations

from collections.abc import Iterable

from resilient.detect.health_board import HealthBoard
from resilient.links.table import LinkTable

__all__ = ["closed_rails", "cut_rails", "dead_peer", "departed_peer", "gone_rails", "left_in_order"]


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


def cut_rails(tables: Iterable[LinkTable]) -> dict[int, set[int]]:
    """Per peer, the rails on which this rank cut its link (a NIC down at either
    end, a link the peer reported broken, a link never built): no close can show
    there, whatever happens to the peer."""
    cut: dict[int, set[int]] = {}
    for table in tables:
        for (peer, rail), link in table.links().items():
            if link.broken and not link.peer_closed and link.cut_reason is not None:
                cut.setdefault(peer, set()).add(rail)
    return cut


def dead_peer(tables: Iterable[LinkTable], rails: int, board: HealthBoard) -> int | None:
    """The lowest peer whose links closed on every rail without it saying so, or None.

    A rail counts as closed when a link to the peer on it failed with the peer's
    close, or (given one such rail) when its socket is gone (see gone_rails), or
    when this rank had cut its link there before (cut_rails: a NIC down). At least
    one close must be one the peer's own health record, read now, does not explain
    (a NIC of that rail down, or that link reported broken): a peer that cut its
    links on purpose said so first. A stalled link (a deadline) keeps the peer
    alive: a hang needs a lease.
    """
    tables = list(tables)
    gone, cut = gone_rails(tables), cut_rails(tables)
    for peer, closed in sorted(closed_rails(tables).items()):
        if len(closed | gone.get(peer, set()) | cut.get(peer, set())) < rails:
            continue
        if closed - board.peer_cut_rails(peer):
            return peer
    return None


def departed_peer(tables: Iterable[LinkTable]) -> int | None:
    """The lowest peer a link build found had shut its group down (so it never
    came to the rendezvous; no link to it closes, since none was built), or None."""
    departed = set().union(*(t.left_peers for t in tables))
    return min(departed) if departed else None


def left_in_order(board: HealthBoard, peer: int, submitted: int | None) -> bool:
    """True if ``peer`` shut its group down after every one of the ``submitted``
    calls this rank has made in the epoch had succeeded there (None: this rank does not
    count them, so no departure is ever taken as orderly)."""
    if submitted is None:
        return False
    done = board.peer_left_after(peer)
    return done is not None and done >= submitted
