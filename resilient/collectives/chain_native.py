"""A broadcast chain's rail share in one C step (links.native_steps), when its links are quiet.

Every rank but the root receives each sub-chunk from its left neighbour straight
into the buffer, and every rank but the last passes it on to the right as soon as
it is whole (the step's ``after_recv``): the Python path's order, frame for frame.
A step that stops hands its streams back in a :class:`ChainHandback`, and
:func:`resilient.collectives.ring_rail.chain` finishes on channels from there.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, NamedTuple

import torch

from resilient.collectives.native_acks import StepAcks, acked
from resilient.links import native_steps
from resilient.links.byte_views import bytes_of

if TYPE_CHECKING:
    from resilient.collectives.ring_plan import RingSeat, Span
    from resilient.collectives.route import Route

__all__ = ["ChainHandback", "chain_in_c"]


class ChainHandback(NamedTuple):
    """What a stopped chain step leaves the channels (see Tx.ahead, native_acks)."""

    sent: list[Any]
    got: list[Any]
    acks: tuple[Any, Any]  # the acknowledgement received from the right, sent to the left


def chain_in_c(
    ring: RingSeat, flat: torch.Tensor, subs: list[Span], rail: int, pos: int, route: Route
) -> bool | ChainHandback:
    """The chain's share of this rank at chain position ``pos`` (0: the root) in one
    C step. True: it ran whole; False: links not quiet, nothing moved; else what
    the channels finish."""
    if flat.device.type != "cpu":
        return False
    sends_to = ring.right if pos < ring.world - 1 else None
    recvs_from = ring.left if pos > 0 else None
    peers = [p for p in (sends_to, recvs_from) if p is not None]
    if not peers:
        return True
    links = native_steps.quiet_links(route.links, list(dict.fromkeys(peers)), rail)
    if links is None:
        return False
    at = {link.peer: i for i, link in enumerate(links)}
    by_peer = {link.peer: link for link in links}
    one = native_steps.Step([link.pg for link in links], [link.ledger for link in links])
    buf, base, e = bytes_of(flat.reshape(-1)), flat.data_ptr(), flat.element_size()
    for j, s in enumerate(subs):
        if not s.size:
            continue
        got = -1
        if recvs_from is not None:
            i = at[recvs_from]
            tag = by_peer[recvs_from].ledger.tag(j + route.base)
            got = one.recv(i, tag, route.digest, buf, base, s.start * e, s.size * e)
        if sends_to is not None:
            i = at[sends_to]
            tag = by_peer[sends_to].ledger.tag(j + route.base)
            one.send(i, tag, route.sent_digest, buf, base, s.start * e, s.size * e, after_recv=got)
    acks = None
    if acked(route):
        acks = StepAcks(route, rail, 1)
        if recvs_from is not None:
            acks.give(one, at[recvs_from], recvs_from, by_peer[recvs_from])
        if sends_to is not None:
            acks.expect(one, at[sends_to], sends_to, by_peer[sends_to])
    stopped = one.run()
    if stopped is None:
        if acks is not None:
            acks.ran_whole()
        return True
    sent, recvd = stopped
    theirs: tuple[Any, Any] = (None, None)
    if acks is not None:
        sent, recvd, tx, rx = acks.split(sent, recvd)
        theirs = (tx.get(sends_to) if sends_to is not None else None,
                  rx.get(recvs_from) if recvs_from is not None else None)  # fmt: skip
    return ChainHandback(sent, recvd, theirs)
