"""The frames of point-to-point messages, the message itself and a receive from any
source's claim (see :mod:`resilient.group.p2p_channel` for the protocol: READY from
the receiver, then DATA from the sender, or INFO and an empty DATA flagged NEWS on a
mismatch; a READY flagged NEWS is a receive from any source's, answered by OFFER,
then REPLY, then DATA_ANY)."""

from __future__ import annotations

import struct
import threading
from dataclasses import dataclass
from typing import Any, Final

import torch
from torch.futures import Future

from resilient.collectives.signature import SUPPORTED_DTYPES
from resilient.errors import CollectiveMismatch
from resilient.group.work import Failed

__all__ = [
    "DATA", "DATA_ANY", "EMPTY", "INFO", "OFFER", "PAIR", "READY", "REPLY",
    "AnyRecv", "Message", "describe", "mismatch", "wire_tag",
]  # fmt: skip

# Frame kinds, in the low 3 bits of a wire tag. The user's tag (32 bits) fills the
# bits around the ones the link's ledger adds (resilient.links.ledger): its low 21
# bits go to bits 3-23, its high 11 to bits 28-38, since bits 24-27 hold the epoch's
# salt and bits from 53 on a shared connection's slot; the wire tag stays
# non-negative (negative tags are the pair's own: the repair probe).
READY: Final = 1
DATA: Final = 2
INFO: Final = 3
OFFER: Final = 4  # sender -> receiver: a send met a READY from any source (its dtype, count)
REPLY: Final = 5  # receiver -> sender: empty; taken, or declined when flagged NEWS
DATA_ANY: Final = 6  # a send's bytes to a receive from any source that took it
_LOW_BITS: Final = 21
_LOW_MASK: Final = (1 << _LOW_BITS) - 1
_HIGH_SHIFT: Final = 28
PAIR: Final = struct.Struct("<qq")  # a dtype number and an element count
EMPTY: Final = memoryview(b"")


def wire_tag(tag: int, kind: int) -> int:
    """The socket pair's tag of frame ``kind`` of a message with user tag ``tag``."""
    tag &= 0xFFFFFFFF
    return ((tag & _LOW_MASK) << 3) | kind | ((tag >> _LOW_BITS) << _HIGH_SHIFT)


def describe(code: int, numel: int) -> str:
    name = str(SUPPORTED_DTYPES[code]) if 0 <= code < len(SUPPORTED_DTYPES) else f"dtype#{code}"
    return f"{name.removeprefix('torch.')}[{numel}]"


@dataclass(slots=True, eq=False)
class Message:
    """One send or receive: ``buf`` is the flat contiguous buffer on the wire;
    ``target`` the caller's tensor (a receive into a non-contiguous one lands in
    ``buf`` first and is copied over)."""

    op: str  # "send" or "recv"
    tag: int
    peer: int  # the peer's rank, for messages (-1: a receive from any source)
    buf: torch.Tensor
    target: torch.Tensor
    fut: Future[Any]

    @property
    def what(self) -> str:
        """What it is, for errors ("send of float32[10] (tag 3) to rank 1"); built only then."""
        side = "to" if self.op == "send" else "from"
        peer = "any rank" if self.peer < 0 else f"rank {self.peer}"
        return f"{self.op} of {self.desc} (tag {self.tag}) {side} {peer}"

    @property
    def desc(self) -> str:
        return describe(self.code, self.numel)

    @property
    def numel(self) -> int:
        return self.buf.numel()

    @property
    def nbytes(self) -> int:
        return self.buf.numel() * self.buf.element_size()

    @property
    def code(self) -> int:
        return SUPPORTED_DTYPES.index(self.buf.dtype)

    def finish(self) -> None:
        if self.op == "recv" and (
            self.buf.data_ptr() != self.target.data_ptr() or not self.target.is_contiguous()
        ):
            self.target.copy_(self.buf.view(self.target.shape))
        self.fut.set_result([self.target])

    def fail(self, exc: BaseException) -> None:
        if not self.fut.done():
            self.fut.set_result(Failed(exc))


def mismatch(rank: int, msg: Message, peer: int, code: int, numel: int) -> CollectiveMismatch:
    """The error of ``msg`` at ``rank``, whose peer ``peer`` posted the other side
    with dtype number ``code`` and ``numel`` elements."""
    theirs = f"{'recv' if msg.op == 'send' else 'send'} of {describe(code, numel)}"
    where = (
        f"at rank {peer}; nothing was received there"
        if msg.op == "send"
        else (f"from rank {peer}; nothing was received")
    )
    return CollectiveMismatch(
        f"rank {rank}: {msg.what} met a {theirs} {where}",
        calls={rank: msg.what, peer: theirs},
        fields=("dtype", "numel"),
    )


_GIVEN_UP: Final = -2  # AnyRecv.owner once it failed without a sender


class AnyRecv:
    """A receive from any source (``msg``), announced to ``arms`` peers at once.

    The first peer to :meth:`claim` it owns it (a send of that peer offered itself);
    every later claim fails, so that peer's send waits for another READY. ``arms``
    counts the peers still able to claim it; when the last one is lost (its link
    failed) the receive fails.
    """

    __slots__ = ("_lock", "arms", "msg", "owner")

    def __init__(self, msg: Message, arms: int) -> None:
        self.msg, self.arms = msg, arms
        self.owner: int | None = None  # the sender's rank once claimed
        self._lock = threading.Lock()

    @property
    def open(self) -> bool:
        return self.owner is None

    def claim(self, peer: int) -> bool:
        """Whether ``peer`` now owns the receive (False: taken, or it ended)."""
        with self._lock:
            if self.owner is not None:
                return False
            self.owner = peer
            return True

    def give_up(self) -> bool:
        """End it without a sender (its deadline passed); False if it ended already."""
        return self.claim(_GIVEN_UP)

    def lost(self, peer: int) -> bool:
        """``peer``'s arm is gone (its link failed); whether the receive fails with it
        (that peer owned it, or no other peer can claim it any more)."""
        with self._lock:
            self.arms -= 1
            if self.owner is None and self.arms <= 0:
                self.owner = _GIVEN_UP
                return True
            return self.owner == peer
