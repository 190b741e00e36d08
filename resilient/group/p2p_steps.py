"""How one peer's point-to-point ops move on: the frames each op posts and what it
does with the frames that come (:class:`Steps`, the base of
:class:`~resilient.group.p2p_channel.Channel`, which holds the ops, the link and
the threads; the protocol is described there).

Every method here runs under the channel's lock, from its ``_advance``, in issue
order, and never waits: a step posts frames and returns the op's outcome, or None
while it waits for a frame.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

from resilient.errors import LinkError
from resilient.group.p2p_wire import (
    DATA,
    DATA_ANY,
    EMPTY,
    INFO,
    OFFER,
    PAIR,
    READY,
    REPLY,
    AnyRecv,
    Message,
    mismatch,
    wire_tag,
)  # fmt: skip
from resilient.links.byte_views import bytes_of
from resilient.links.socket_frames import NEWS
from resilient.links.table import Link

__all__ = ["Steps"]


@dataclass(slots=True, eq=False)
class _Op:
    """A message's progress: posted on ``link`` (None: not yet), waiting for
    ``work`` (a send: its READY, then its bytes' write; a receive: its bytes)
    until ``deadline``, which is ``timeout_s`` after the wait began."""

    msg: Message
    link: Link | None = None
    work: Any = None
    deadline: float = 0.0
    timeout_s: float = 0.0
    ready: bytearray | None = None  # a send's READY frame, until it came
    claim: tuple[int, int] | None = None  # a send's any-source READY, until its REPLY came
    any: AnyRecv | None = None  # a receive from any source, announced to this peer
    offer: bytearray | None = None  # that receive's OFFER frame, until it came


# What an op ended with: True (done), False (a receive from any source's op at a
# peer it did not take: nothing to settle), or the exception its work raises.
_Outcome = bool | BaseException
_Settled = list[tuple[Message, _Outcome]]


class Steps:
    """The steps of a channel's ops (see the module docstring); the channel sets
    these attributes."""

    rank: int
    peer_rank: int
    _floor_s: float
    _per_byte_s: float
    _ops: list[_Op]  # issued and not ended, in issue order
    _held: set[int]  # tags whose sends wait behind an OFFER (_advance fills it)
    _late: _Settled  # receives from any source given up by ops that stay

    def _post(self, op: _Op, link: Link, now: float) -> None:
        """Post ``op`` on ``link``: a send waits for its READY; a receive sends its
        READY and posts the receive of its bytes.

        Raises:
            LinkError: the link failed.
        """
        msg = op.msg
        op.link = link
        if msg.op == "send":
            op.ready = bytearray(PAIR.size)
            op.work = link.irecv(memoryview(op.ready), wire_tag(msg.tag, READY))
            op.timeout_s = self._floor_s
        elif op.any is not None:  # from any source: the peer's send offers itself first
            link.isend(memoryview(PAIR.pack(msg.code, msg.numel)), wire_tag(msg.tag, READY), NEWS)
            op.offer = bytearray(PAIR.size)
            op.work = link.irecv(memoryview(op.offer), wire_tag(msg.tag, OFFER))
            op.timeout_s = self._floor_s + msg.nbytes * self._per_byte_s
        else:
            ready = PAIR.pack(msg.code, msg.numel)
            link.isend(memoryview(ready), wire_tag(msg.tag, READY))
            op.work = link.irecv(bytes_of(msg.buf), wire_tag(msg.tag, DATA))
            op.timeout_s = self._floor_s + msg.nbytes * self._per_byte_s
        op.deadline = now + op.timeout_s

    def _step(self, op: _Op, now: float) -> _Outcome | None:
        """Move ``op`` on; its outcome once it ended, else None.

        Raises:
            LinkError: the link failed, or the op's deadline passed.
        """
        work, link = op.work, op.link
        assert link is not None
        if not work.done:
            ended = work.error is not None or link.pg is None
            if ended and op.any is not None and op.offer is not None and not op.any.open:
                return False  # left to decline a send: a link that ended owes it nothing
            if work.error is not None:
                raise LinkError(f"{link}: {op.msg.what} failed: {work.error}")
            if link.pg is None:
                raise LinkError(f"{link}: {op.msg.what}: the link was closed")
            if op.offer is not None and now >= op.deadline:
                self._unclaimed(op)
                return None
            if now >= op.deadline:
                raise LinkError(
                    f"{link}: {op.msg.what} did not complete within its deadline of "
                    f"{op.timeout_s:.1f} s"
                )
            return None
        if op.ready is not None and self._held and op.msg.tag in self._held:
            return None  # an earlier send of its tag may need this READY (_declined)
        link.ledger.end_wait(work, finished=True)
        if op.ready is not None:
            return self._answer(op, link, now)
        if op.offer is not None:
            return self._offered(op, link, now)
        if op.claim is not None:
            return self._replied(op, link, now)
        if op.msg.op == "recv" and work.news:
            return self._refused(op, link)
        return True

    def _answer(self, op: _Op, link: Link, now: float) -> _Outcome | None:
        """A send's READY came: write the bytes if the receive agrees, else tell it why
        not (INFO, then an empty DATA flagged NEWS) and fail the send."""
        msg = op.msg
        assert op.ready is not None
        code, numel = PAIR.unpack(op.ready)
        op.ready = None
        if op.work.news:  # a receive from any source's: offer this send, wait for its REPLY
            link.isend(memoryview(PAIR.pack(msg.code, msg.numel)), wire_tag(msg.tag, OFFER))
            op.claim = (code, numel)
            op.work = link.irecv(memoryview(bytearray()), wire_tag(msg.tag, REPLY))
            op.timeout_s = self._floor_s
            op.deadline = now + op.timeout_s
            return self._step(op, now)
        if code == msg.code and numel == msg.numel:
            return self._write(op, link, now, DATA)
        link.isend(memoryview(PAIR.pack(msg.code, msg.numel)), wire_tag(msg.tag, INFO))
        link.isend(EMPTY, wire_tag(msg.tag, DATA), NEWS)
        return mismatch(self.rank, msg, self.peer_rank, code, numel)

    def _write(self, op: _Op, link: Link, now: float, kind: int) -> _Outcome | None:
        """Write a send's bytes (its receive agreed) as frame ``kind``."""
        msg = op.msg
        op.work = link.isend(bytes_of(msg.buf), wire_tag(msg.tag, kind))
        op.timeout_s = self._floor_s + msg.nbytes * self._per_byte_s
        op.deadline = now + op.timeout_s
        return self._step(op, now)

    def _replied(self, op: _Op, link: Link, now: float) -> _Outcome | None:
        """A send's OFFER was answered: taken (write the bytes, or fail on a mismatch,
        which the receive sees too) or declined (another peer's send took it)."""
        msg = op.msg
        assert op.claim is not None
        code, numel = op.claim
        op.claim = None
        if op.work.news:
            return self._declined(op, link, now)
        if code == msg.code and numel == msg.numel:
            return self._write(op, link, now, DATA_ANY)
        return mismatch(self.rank, msg, self.peer_rank, code, numel)

    def _declined(self, op: _Op, link: Link, now: float) -> _Outcome | None:
        """The send waits for the next READY of its tag, ahead of the later sends of
        the tag (held in _advance meanwhile): each takes over the READY receive of the
        next, and the last one a new one, so the tag's sends meet READYs in issue order."""
        tag, ops = op.msg.tag, self._ops
        later = [o for o in ops[ops.index(op) + 1 :] if o.link is link and o.ready is not None]
        chain = [op, *(o for o in later if o.msg.tag == tag)]
        frame = bytearray(PAIR.size)
        new = link.irecv(memoryview(frame), wire_tag(tag, READY))
        slots = [(o.work, o.ready) for o in chain[1:]] + [(new, frame)]
        for o, (work, ready) in zip(chain, slots, strict=True):
            o.work, o.ready = work, ready
        op.timeout_s = self._floor_s
        op.deadline = now + op.timeout_s
        return self._step(op, now)

    def _offered(self, op: _Op, link: Link, now: float) -> _Outcome | None:
        """A send of the peer offered itself to a receive from any source: take it if
        the receive is still open (then its bytes come as DATA_ANY), else decline."""
        msg, any_ = op.msg, op.any
        assert op.offer is not None and any_ is not None
        code, numel = PAIR.unpack(op.offer)
        op.offer = None
        if not any_.claim(self.peer_rank):
            link.isend(EMPTY, wire_tag(msg.tag, REPLY), NEWS)
            return False
        link.isend(EMPTY, wire_tag(msg.tag, REPLY))
        if code != msg.code or numel != msg.numel:
            return mismatch(self.rank, msg, self.peer_rank, code, numel)
        op.work = link.irecv(bytes_of(msg.buf), wire_tag(msg.tag, DATA_ANY))
        op.timeout_s = self._floor_s + msg.nbytes * self._per_byte_s
        op.deadline = now + op.timeout_s
        return self._step(op, now)

    def _unclaimed(self, op: _Op) -> None:
        """A receive from any source's deadline passed before this peer's send offered
        itself: the receive fails (once, here or at another peer's op) unless taken,
        and the op stays, with no deadline, to decline this peer's next send of its tag
        (the link stays up: nothing is under way on it)."""
        assert op.any is not None
        if op.any.give_up():
            why = f"no rank sent within its deadline of {op.timeout_s:.1f} s"
            self._late.append((op.msg, LinkError(f"rank {self.rank}: {op.msg.what}: {why}")))
        op.deadline = math.inf

    def _failed(self, op: _Op, exc: BaseException) -> _Settled:
        """What ``op`` failing with ``exc`` settles: its message, but a receive from any
        source only when this peer took it or no other peer is left to."""
        if op.any is None or op.any.lost(self.peer_rank):
            return [(op.msg, exc)]
        return []

    def _refused(self, op: _Op, link: Link) -> _Outcome:
        """A receive's sender refused it (a mismatch): its INFO came ahead of the empty
        DATA frame, so it is here already.

        Raises:
            LinkError: it is not (the peer broke the protocol).
        """
        msg = op.msg
        info = bytearray(PAIR.size)
        work = link.irecv(memoryview(info), wire_tag(msg.tag, INFO))
        if not work.done:
            raise LinkError(f"{link}: {msg.what}: a refusal without the sender's dtype and count")
        link.ledger.end_wait(work, finished=True)
        return mismatch(self.rank, msg, self.peer_rank, *PAIR.unpack(info))
