"""Subgroups' links over the world group's connections: one TCP connection per
(rank pair, rail, kind of link), whatever number of groups use it.

A subgroup (``new_group``, a DeviceMesh dimension) needs links between its members,
and the world group usually has one already between the same two processes on the
same rail. A :class:`BorrowedLink` is a subgroup's link over that connection: the
world's :class:`~resilient.links.socket_pair.SocketPair`, with the subgroup's tags
in a *slot* of their own (bits from :data:`~resilient.links.ledger.GROUP_SHIFT` on,
:class:`~resilient.links.ledger.OpLedger`), so the groups' messages never meet and
each forgets only its own given-up calls. Everything else of a link (deadlines,
ledger, failover, stall and peer watch) is the borrowing link's own.

What is and is not shared:

* The world group offers its links (:func:`offer`); a subgroup's table asks for the
  one to a peer (:func:`lent`) and both ends agree to borrow it, under one slot the
  connection's lower end hands out, before either uses it
  (:meth:`resilient.links.table.LinkTable.borrowed`). Where the world has no healthy
  socket link of that kind to the peer on that rail (not built yet, broken, gloo
  transport), the subgroup builds its own connection as before.
* Breaking a borrowed link fails its own ops only (the slot's receives, with every
  later message of the slot dropped); it never cuts the connection, which the world
  may still use. The world's link breaking or closing fails the borrowed link's
  ops too (a pair fails as a whole), and the subgroup repairs it: over the world's
  new connection when that is there, else over one of its own.
* Slots are never handed out twice on a connection (a group that left cannot meet
  its successor's messages), so a connection carries at most
  :data:`~resilient.links.ledger.MAX_SLOT` borrowings in its life; after that the
  subgroups build their own.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any

from resilient.links.ledger import OpLedger
from resilient.links.link import PEER_CLOSED, Link
from resilient.links.socket_link import SocketLink
from resilient.links.socket_pair import SocketPair

__all__ = ["BorrowedLink", "Lender", "lent", "offer", "withdraw"]

# (kind of link: "link", "ctl" or "p2p"; job rank of the peer; rail) -> the
# world group's link to that peer, if it has one.
Lender = Callable[[str, int, int], Link | None]

_lock = threading.Lock()
_lenders: list[Lender] = []


def offer(lender: Lender) -> None:
    """Let subgroups borrow the links ``lender`` returns (the world group's)."""
    with _lock:
        _lenders.append(lender)


def withdraw(lender: Lender) -> None:
    """Stop offering ``lender``'s links (its group shuts down)."""
    with _lock:
        if lender in _lenders:
            _lenders.remove(lender)


def lent(kind: str, job_peer: int, rail: int) -> SocketLink | None:
    """A healthy socket link of ``kind`` to job rank ``job_peer`` on ``rail`` that a
    subgroup may borrow, or None."""
    with _lock:
        lenders = list(_lenders)
    for lender in reversed(lenders):  # the newest world group (after a re-init)
        link = lender(kind, job_peer, rail)
        if usable(link):
            assert isinstance(link, SocketLink)
            return link
    return None


def usable(link: Link | None) -> bool:
    """Whether ``link`` can carry a borrower's traffic now: a socket link of its own
    connection, built, not broken."""
    if not isinstance(link, SocketLink) or isinstance(link, BorrowedLink) or link.broken:
        return False
    pg: Any = link.pg
    return isinstance(pg, SocketPair) and pg.error is None


class BorrowedLink(SocketLink):
    """A link over another link's connection, under a tag slot of its own (see the
    module docstring)."""

    @classmethod
    def over(
        cls, owner: SocketLink, *, rank: int, peer: int, prefix: str, config: Any,
        salt: int, slot: int,
    ) -> BorrowedLink:  # fmt: skip
        """``owner``'s connection as a link between group ranks ``rank`` and ``peer``
        under ``slot``.

        Raises:
            LinkError: ``owner`` broke or closed meanwhile.
        """
        link = cls(
            rank=rank, peer=peer, rail=owner.rail, address="", store=None, prefix=prefix,
            config=config, salt=salt, unbuilt=True,
        )  # fmt: skip
        link.ledger = OpLedger(salt, slot)
        link.owner = owner
        link.pg = owner.pg
        if link.pg is None:
            raise link._failed(f"{link!r}: the connection it borrows closed")
        return link

    owner: SocketLink | None = None

    def __repr__(self) -> str:
        ledger = getattr(self, "ledger", None)  # repr is taken while it is being built
        slot = ledger.slot if ledger is not None else "?"
        return f"Link({self.rank}<->{self.peer}, rail {self.rail}, slot {slot})"

    def check_closed(self) -> bool:
        """As :meth:`Link.check_closed`; but a connection that failed or that its
        owner closed here is this link's end, not news of the peer: it is marked
        broken as cut (unless the peer closed it), never left to look like a
        socket the peer's death took away (resilient.detect.lost_peer weighs those)."""
        pg = self.pg
        if self.broken or pg is None or pg.error is None:
            return super().check_closed()
        error = str(pg.error)
        if not any(m in error for m in PEER_CLOSED):
            self.cut_reason = f"the connection it borrows ended here: {error}"
        self._failed(f"{self!r}: the connection it borrows ended: {error}", "marked broken")
        return self.peer_closed

    def _interrupt(self, why: str) -> None:
        """End this link's waits without cutting the connection: its own receives
        fail, and its slot's later messages are dropped (it is not used again)."""
        pg = self.pg
        if pg is not None:
            pg.forget(lambda _tag: True, why, self.ledger.slot)

    def close(self, *, background: bool | None = None) -> None:
        """Stop using the connection; it stays open for its owner."""
        self._waiters.close()
        pg, self.pg = self.pg, None
        if pg is not None:
            pg.forget(lambda _tag: True, f"{self!r} closed", self.ledger.slot)
