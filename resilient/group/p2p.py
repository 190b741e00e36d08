"""``send`` and ``recv`` between two ranks of a group, for CPU tensors.

``send`` and ``recv`` (and so torch's ``dist.send``/``recv``/``isend``/``irecv``,
``P2POp`` and ``batch_isend_irecv``) return a
:class:`~resilient.group.work.ResilientWork` at once; its future completes when the
op does. Every dtype of the group's collectives
(:data:`~resilient.collectives.signature.SUPPORTED_DTYPES`) is taken, contiguous or
not (a non-contiguous send is copied when it is issued; a non-contiguous receive
lands in a buffer and is copied into the tensor).

Only the two ranks of a pair issue a p2p call, so these calls skip the group's call
checks (every rank issues every collective in the same order there) and travel on
links of their own, one per peer (:mod:`resilient.group.p2p_channel`: the wire
protocol, the threads, deadlines and what breaks a link).

Semantics:

* **Order.** Messages between two ranks with the same tag match in issue order.
* **Tags.** A receive matches by tag: a receive whose tag is not the next
  message's still completes when the sender used its tag (the messages before it
  wait in the socket pair's stash, read aside). Tags are 32-bit integers.
* **Completion.** A send completes once the matching receive was posted (its
  READY, with its dtype and count, came and was checked here) and the bytes are in
  the socket: synchronous, as MPI's ``Ssend``, but with no acknowledgement round
  trip, and on the caller's thread when the READY is there already (the usual case:
  a receive announces itself as it is posted). Blocking sends that the peer
  receives in another order than sent wait for each other until a deadline. Use
  ``isend``/``batch_isend_irecv`` for such exchanges. ``wait`` moves the op on the
  waiting thread (no hand-off from the channel's thread).
* **Checks.** A receive of another dtype or element count than its send fails at
  both ends with :class:`~resilient.errors.CollectiveMismatch` (the sender checks,
  so no byte lands in the receive), and the pair goes on working. A peer rank
  outside the group or equal to this one raises ``ValueError`` on the caller's
  thread; a peer that left the group (a shrink)
  :class:`~resilient.errors.MembershipError`.
* **Deadlines.** A peer that never posts the matching op fails the op with
  :class:`~resilient.errors.LinkError` after ``op_timeout_floor_s`` plus the bytes at
  ``expected_link_bytes_per_s``; that link is cut and built again on the pair's
  next call (within ``connect_timeout_s``).
* **Any source.** ``recv_anysource`` (``dist.recv``/``irecv`` without ``src``)
  takes the first send of its tag that any other member offers (every peer is told
  with a READY flagged "any"; a send that meets one offers itself and writes its
  bytes only once the receive took it, else it waits for the next READY of its tag,
  still ahead of its later sends). The work's ``_source_rank()`` names the sender.
  A mismatch with the send taken fails both ends as above; with no send within the
  receive's deadline it fails with :class:`~resilient.errors.LinkError` and the
  links stay up (a later send to it is declined, and waits for another receive).

After a shrink, peers are named by rank and numbered inside the epoch
(``EpochControl.position``); a new epoch's calls build new links.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from datetime import timedelta
from typing import Any, Final

import torch
from torch.futures import Future

from resilient.collectives.signature import SUPPORTED_DTYPES
from resilient.group.epoch_control import EpochControl
from resilient.group.p2p_channel import Channel
from resilient.group.p2p_late_wakes import LateWakes
from resilient.group.p2p_wire import AnyRecv, Message
from resilient.group.shared_links import P2P
from resilient.group.work import ResilientWork
from resilient.links.table import Link

__all__ = ["PointToPoint"]

logger = logging.getLogger(__name__)

_TAG_MIN: Final = -(1 << 31)
_TAG_MAX: Final = (1 << 31) - 1


class _P2PWork(ResilientWork):
    """A p2p op's work: ``wait`` moves the channel's ops on the waiting thread
    (:meth:`Channel.wait_for`), so the op ends there without a hand-off from the
    channel's pump; the future completes the same either way."""

    def __init__(self, msg: Message, chan: Channel) -> None:
        super().__init__(msg.fut, msg.op)
        self._msg, self._chan = msg, chan

    def wait(self, timeout: timedelta | None = None) -> bool:
        """As :meth:`ResilientWork.wait`.

        Raises:
            CollectiveTimeout: not complete within ``timeout`` (the op goes on).
            CollectiveMismatch, LinkError: the op's own error.
        """
        if not self._msg.fut.done():
            secs = timeout.total_seconds() if timeout is not None else 0.0
            self._chan.wait_for(self._msg, time.monotonic() + secs if secs > 0 else None)
        return super().wait(timeout)

    # A caller that polls, or waits on the future, does not drive the channel: its
    # pump must not sleep through the grace of a deferred wake-up (p2p_late_wakes).
    def is_completed(self) -> bool:
        done = super().is_completed()
        if not done:
            self._chan.kick()
        return done

    def get_future(self) -> Future[Any]:
        self._chan.kick()
        return super().get_future()


class _AnyWork(ResilientWork):
    """A receive from any source's work: ``_source_rank()`` names the sender (torch's
    ``dist.recv`` returns it; ``irecv``'s caller asks the work)."""

    def __init__(self, any_: AnyRecv) -> None:
        super().__init__(any_.msg.fut, "recv")
        self._any = any_

    def _source_rank(self) -> int:
        """The sender's group rank, or -1 while none has (or if the receive failed)."""
        owner = self._any.owner
        return owner if owner is not None and owner >= 0 and self.is_success() else -1


class PointToPoint:
    """The p2p calls of rank ``rank`` in a group of ``size`` over ``epochs``."""

    def __init__(self, *, rank: int, size: int, epochs: EpochControl) -> None:
        self._rank, self._size, self._epochs = rank, size, epochs
        self._channels: dict[int, Channel] = {}  # by peer rank, for self._epoch
        self._epoch = epochs.epoch
        self._lock = threading.Lock()
        self._closed = False
        self._late_wakes = LateWakes()

    def send(self, tensors: Sequence[torch.Tensor], dst: int, tag: int) -> ResilientWork:
        """Send ``tensors[0]`` to rank ``dst``.

        Raises:
            ValueError: ``dst`` is not another rank of the group, not one tensor, or a
                tag outside 32 bits.
            TypeError: an unsupported dtype.
            NotImplementedError: a tensor not on the CPU.
            MembershipError: ``dst`` left the group.
            RuntimeError: the group is shut down.
            The work's ``wait``: CollectiveMismatch (the receive differs), LinkError
                (the link failed or the deadline passed).
        """
        t = self._check("send", tensors, dst, tag)
        src = t.detach()
        buf = src.reshape(-1) if src.is_contiguous() else src.contiguous().reshape(-1)
        msg = Message("send", tag, dst, buf, t, Future())
        chan = self._channel(dst, "send")
        chan.send(msg)
        return _P2PWork(msg, chan)

    def recv(self, tensors: Sequence[torch.Tensor], src: int, tag: int) -> ResilientWork:
        """Receive into ``tensors[0]`` from rank ``src``.

        Raises:
            As :meth:`send`.
        """
        t = self._check("recv", tensors, src, tag)
        into = t.detach()
        buf = into.view(-1) if into.is_contiguous() else torch.empty(t.numel(), dtype=t.dtype)
        msg = Message("recv", tag, src, buf, t, Future())
        chan = self._channel(src, "recv")
        chan.recv(msg)
        return _P2PWork(msg, chan)

    def recv_anysource(self, tensors: Sequence[torch.Tensor], tag: int) -> ResilientWork:
        """Receive into ``tensors[0]`` from whichever rank's send of tag ``tag`` comes
        first; the work's ``_source_rank()`` is that rank once it completed.

        Raises:
            ValueError: no other rank in the group, not one tensor, or a tag outside
                32 bits.
            TypeError, NotImplementedError, RuntimeError: as :meth:`send`.
            The work's ``wait``: CollectiveMismatch (the first send offered differs),
                LinkError (no send within the deadline, or every peer's link failed).
        """
        t = self._check("recv", tensors, None, tag)
        peers = [p for p in self._epochs.members if p != self._rank]
        if not peers:
            raise ValueError(f"resilient recv: rank {self._rank} has no other rank to receive from")
        into = t.detach()
        buf = into.view(-1) if into.is_contiguous() else torch.empty(t.numel(), dtype=t.dtype)
        any_ = AnyRecv(Message("recv", tag, -1, buf, t, Future()), len(peers))
        for peer in peers:  # announced to every peer: the first send to offer takes it
            self._channel(peer, "recv").recv(any_.msg, any_)
        return _AnyWork(any_)

    def _check(
        self, op: str, tensors: Sequence[torch.Tensor], peer: int | None, tag: int
    ) -> torch.Tensor:
        """The one tensor of a p2p call, checked (see :meth:`send` for what raises);
        ``peer`` None: from any source."""
        if self._closed:
            raise RuntimeError(f"resilient process group is shut down; cannot run {op}")
        if peer is not None and (isinstance(peer, bool) or not isinstance(peer, int)):
            raise ValueError(f"resilient {op}: peer rank must be an int, got {peer!r}")
        if peer is not None and (not 0 <= peer < self._size or peer == self._rank):
            raise ValueError(
                f"resilient {op}: rank {self._rank} cannot {op} {'to' if op == 'send' else 'from'} "
                f"rank {peer} (the group's ranks are 0..{self._size - 1}, this one excluded)"
            )
        if isinstance(tag, bool) or not isinstance(tag, int) or not _TAG_MIN <= tag <= _TAG_MAX:
            raise ValueError(f"resilient {op}: tag must be a 32-bit integer, got {tag!r}")
        if len(tensors) != 1:
            raise ValueError(f"resilient {op}: takes exactly one tensor, got {len(tensors)}")
        t = tensors[0]
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"resilient {op}: dtype {t.dtype} is not supported")
        if not t.is_cpu:
            raise NotImplementedError(
                f"resilient {op}: {t.device.type} tensors are not supported (cpu only)"
            )
        return t

    def _channel(self, peer: int, op: str) -> Channel:
        """The channel to rank ``peer`` in the current epoch (a new epoch's first call
        closes the last epoch's channels).

        Raises:
            MembershipError: ``peer`` left the group.
            RuntimeError: the group is shut down.
        """
        ep = self._epochs
        pos = ep.position(peer, op)
        with self._lock:
            if self._closed:
                raise RuntimeError(f"resilient process group is shut down; cannot run {op}")
            stale: list[Channel] = []
            if ep.epoch != self._epoch:
                stale, self._channels = list(self._channels.values()), {}
                self._epoch = ep.epoch
            chan = self._channels.get(peer)
            if chan is None:
                chan = self._channels[peer] = Channel(
                    rank=self._rank, peer_rank=peer, pos=ep.pos, peer=pos, rails=ep.rails,
                    store=ep.store, config=ep.config, epoch=ep.epoch, late_wakes=self._late_wakes,
                    borrow=ep.borrowing(P2P) if ep.borrowing is not None else None,
                )  # fmt: skip
        for old in stale:  # its links rendezvoused under the last epoch's numbering
            old.close()
        return chan

    def link_to(self, peer: int, rail: int) -> Link | None:
        """The link of the channel to ``peer`` on ``rail`` in this epoch, if built
        (what the world group lends a subgroup, resilient.group.shared_links)."""
        chan = self._channels.get(peer)
        return chan.link_on(rail) if chan is not None else None

    def close(self) -> None:
        """Close every channel: queued and pending ops fail, links close (shutdown)."""
        with self._lock:
            self._closed = True
            channels, self._channels = list(self._channels.values()), {}
        for chan in channels:
            chan.close()
        self._late_wakes.close()
