"""One peer's point-to-point traffic: its own link, its threads and the wire protocol.

A :class:`Channel` carries this rank's ``send`` and ``recv`` calls with one peer
(:class:`~resilient.group.p2p.PointToPoint` keeps one per peer and epoch). Its link
is a socket link of its own, in a :class:`~resilient.links.table.LinkTable` named
``p2p`` (its own rendezvous keys and its own socket engine), never one of the
collectives' links: those are driven by the communication and rail threads, and
frames interleaved from here would corrupt both streams. The link is built on the
first call either end makes to the other (both ends build it then: a call names
its peer, and the peer's matching call names this rank), on rail 0 or the first
rail whose link builds; both ends agree on that (LinkTable.ensure).

On the wire each message is three frames, each tag-matched by the socket pair
(:mod:`resilient.links.socket_pair`) on a wire tag made of the user's tag and the
frame's kind:

* sender -> receiver: a header (dtype number, element count), then the bytes;
* receiver -> sender: an acknowledgement once the header was checked against the
  receive (match, or the receive's dtype and count).

The sender posts header and bytes at once (eager); the receiver checks the header
before it posts a receive for the bytes, so a message never lands in a buffer of
another size (which fails a socket pair as a whole). On a mismatch the receiver
reads the bytes aside, acknowledges with its own dtype and count, and both ends
raise :class:`~resilient.errors.CollectiveMismatch`; the link stays in service.

Sends are posted by one thread (in issue order) and completed by another, in the
same order, once their bytes left and their acknowledgement came; receives run on
a third. So a send never waits for an acknowledgement before the next send is
posted (a receiver taking tags out of order waits for a later message), and large
sends and receives in both directions make progress together.

Every wait has the link's deadline (``op_timeout_floor_s`` plus the bytes at
``expected_link_bytes_per_s``); a missed one, or any error of the link, fails the
op with :class:`~resilient.errors.LinkError` and cuts the link, so the peer's ops
on it fail at once too. The next call either end makes builds it again (the next
generation; both ends saw the same link break).
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Final

import torch
from torch._C._distributed_c10d import Store
from torch.futures import Future

from resilient.collectives.signature import SUPPORTED_DTYPES
from resilient.config import DataPlaneConfig
from resilient.errors import CollectiveMismatch, LinkError
from resilient.group.handoff import Handoff
from resilient.group.work import Failed
from resilient.links.byte_views import bytes_of
from resilient.links.table import Link, LinkTable

__all__ = ["Channel", "Message", "wire_tag"]

logger = logging.getLogger(__name__)

# Frame kinds, in the low bits of a wire tag. The user's tag (32 bits) sits from
# bit 28 up: bits 24-27 hold the epoch's salt (resilient.links.ledger), and the wire
# tag stays non-negative (negative tags are the pair's own: the repair probe).
_HEADER: Final = 1
_DATA: Final = 2
_ACK: Final = 3
_TAG_SHIFT: Final = 28
_HEADER_BYTES: Final = 16  # int64 dtype number, int64 element count
_ACK_BYTES: Final = 24  # int64 status (0 match, 1 mismatch), the receive's dtype and count
_JOIN_S: Final = 5.0


def wire_tag(tag: int, kind: int) -> int:
    """The socket pair's tag of frame ``kind`` of a message with user tag ``tag``."""
    return ((tag & 0xFFFFFFFF) << _TAG_SHIFT) | kind


def _dtype_code(dtype: torch.dtype) -> int:
    return SUPPORTED_DTYPES.index(dtype)


def _describe(code: int, numel: int) -> str:
    name = str(SUPPORTED_DTYPES[code]) if 0 <= code < len(SUPPORTED_DTYPES) else f"dtype#{code}"
    return f"{name.removeprefix('torch.')}[{numel}]"


@dataclass(slots=True)
class Message:
    """One send or receive: ``buf`` is the flat contiguous buffer on the wire;
    ``target`` the caller's tensor (a receive into a non-contiguous one lands in
    ``buf`` first and is copied over)."""

    tag: int
    buf: torch.Tensor
    target: torch.Tensor
    fut: Future[Any]
    what: str  # "send of float32[10] (tag 3) to rank 1", for errors

    @property
    def nbytes(self) -> int:
        return self.buf.numel() * self.buf.element_size()

    @property
    def code(self) -> int:
        return _dtype_code(self.buf.dtype)

    def finish(self) -> None:
        if self.buf.data_ptr() != self.target.data_ptr() or not self.target.is_contiguous():
            self.target.copy_(self.buf.view(self.target.shape))
        self.fut.set_result([self.target])

    def fail(self, exc: BaseException) -> None:
        if not self.fut.done():
            self.fut.set_result(Failed(exc))


# What the send poster hands the completer: the message, its link, and the works of
# its header, its bytes (None when empty) and its acknowledgement, with that buffer.
_Posted = tuple[Message, Link, Any, Any, Any, torch.Tensor]


class Channel:
    """This rank's point-to-point traffic with one peer (see the module docstring).

    ``pos`` and ``peer`` number both ends inside ``epoch`` (after a shrink they
    differ from the ranks ``rank`` and ``peer_rank``).
    """

    def __init__(
        self,
        *,
        rank: int,
        peer_rank: int,
        pos: int,
        peer: int,
        rails: tuple[str, ...],
        store: Store,
        config: DataPlaneConfig,
        epoch: int,
    ) -> None:
        self.rank, self.peer_rank, self.peer, self.epoch = rank, peer_rank, peer, epoch
        self._config = config
        self._table = LinkTable(
            rank=pos, rails=rails, store=store, config=config, epoch=epoch,
            name="p2p", transport="socket",
        )  # fmt: skip
        self._link: Link | None = None
        self._link_lock = threading.Lock()
        self._closed = False
        self._sends: Handoff[Message | None] = Handoff()
        self._posted: Handoff[_Posted | None] = Handoff()
        self._recvs: Handoff[Message | None] = Handoff()
        name = f"{rank}-{peer_rank}"
        self._threads = [
            threading.Thread(target=fn, name=f"resilient-p2p-{what}-{name}", daemon=True)
            for fn, what in (
                (self._post_loop, "send"),
                (self._complete_loop, "ack"),
                (self._recv_loop, "recv"),
            )
        ]
        for thread in self._threads:
            thread.start()

    def send(self, msg: Message) -> None:
        """Queue ``msg`` for the peer (posted in issue order)."""
        self._sends.put(msg)

    def recv(self, msg: Message) -> None:
        """Queue a receive of ``msg`` from the peer (run in issue order)."""
        self._recvs.put(msg)

    # -- the link -------------------------------------------------------------------------
    def _link_now(self) -> Link:
        """The channel's link: built on first use, built again (the next generation)
        once it broke.

        Raises:
            LinkError: the channel is closed, or no rail's link could be built.
        """
        with self._link_lock:
            if self._closed:
                raise LinkError(
                    f"rank {self.rank}: point-to-point with rank {self.peer_rank} is closed"
                )
            link = self._link
            if link is not None and not link.broken and not link.check_closed():
                return link
            self._link = self._build(link)
            return self._link

    def _build(self, old: Link | None) -> Link:
        table = self._table
        if old is not None:
            # Both ends saw this link break (a cut reaches the peer), so both ask for
            # the same next generation, whichever end calls first.
            gen = table.generation(self.peer, old.rail) + 1
            logger.info(
                "rank %d (epoch %d): rebuilding the point-to-point link to rank %d "
                "(rail %d, generation %d)", self.rank, self.epoch, self.peer_rank, old.rail, gen,
            )  # fmt: skip
            link = table.rebuild(self.peer, old.rail, gen, self._config.connect_timeout_s)
            table.install(link)
            return link
        for rail in range(len(table.rails)):
            link = table.get(self.peer, rail)  # one rail: raises LinkError on failure
            if not link.broken:
                return link
        raise LinkError(
            f"rank {self.rank} (epoch {self.epoch}): no rail reaches rank {self.peer_rank} "
            "for point-to-point"
        )

    def _broke(self, link: Link, msg: Message, exc: BaseException) -> None:
        """Fail ``msg`` and cut ``link`` (its other ops fail at once, at both ends)."""
        logger.warning("rank %d (epoch %d): %s failed: %s", self.rank, self.epoch, msg.what, exc)
        # Cut even when the failure already marked it broken: the peer's end must
        # see the connection close (its next call then builds the link again too).
        link.abort(f"point-to-point op failed: {exc}")
        msg.fail(exc)

    # -- sending --------------------------------------------------------------------------
    def _post_loop(self) -> None:
        while (msg := self._sends.get()) is not None:
            link: Link | None = None
            try:
                link = self._link_now()
                ack = torch.empty(3, dtype=torch.int64)
                # The acknowledgement's receive first: it is pending before it can come.
                ack_work = link.irecv(ack, wire_tag(msg.tag, _ACK))
                header = torch.tensor([msg.code, msg.buf.numel()], dtype=torch.int64)
                head_work = link.isend(header, wire_tag(msg.tag, _HEADER))
                data_work = (
                    link.isend(bytes_of(msg.buf), wire_tag(msg.tag, _DATA)) if msg.nbytes else None
                )
            except LinkError as exc:
                if link is None:
                    msg.fail(exc)
                else:
                    self._broke(link, msg, exc)
                continue
            except Exception as exc:  # delivered to whoever waits on the work
                logger.exception("rank %d: posting %s failed", self.rank, msg.what)
                msg.fail(exc)
                continue
            self._posted.put((msg, link, head_work, data_work, ack_work, ack))
        self._posted.put(None)

    def _complete_loop(self) -> None:
        while (item := self._posted.get()) is not None:
            msg, link, head_work, data_work, ack_work, ack = item
            try:
                # A late receiver is not a stalled link: kept out of stall reports.
                link.wait(head_work, _HEADER_BYTES, watch=False)
                if data_work is not None:
                    link.wait(data_work, msg.nbytes, watch=False)
                link.wait(ack_work, _ACK_BYTES, watch=False)
            except LinkError as exc:
                self._broke(link, msg, exc)
                continue
            status, code, numel = (int(v) for v in ack.tolist())
            if status == 0:
                msg.fut.set_result([msg.target])
                continue
            theirs = f"recv of {_describe(code, numel)}"
            msg.fail(
                CollectiveMismatch(
                    f"rank {self.rank}: {msg.what} met a {theirs} at rank {self.peer_rank}; "
                    "nothing was received there",
                    calls={self.rank: msg.what, self.peer_rank: theirs},
                    fields=("dtype", "numel"),
                )
            )

    # -- receiving ------------------------------------------------------------------------
    def _recv_loop(self) -> None:
        while (msg := self._recvs.get()) is not None:
            link: Link | None = None
            try:
                link = self._link_now()
                self._receive(link, msg)
            except LinkError as exc:
                if link is None:
                    msg.fail(exc)
                else:
                    self._broke(link, msg, exc)
            except CollectiveMismatch as exc:
                msg.fail(exc)
            except Exception as exc:  # delivered to whoever waits on the work
                logger.exception("rank %d: %s failed", self.rank, msg.what)
                msg.fail(exc)

    def _receive(self, link: Link, msg: Message) -> None:
        """Receive ``msg``'s header, acknowledge it, then its bytes.

        Raises:
            LinkError: the link failed or a deadline passed.
            CollectiveMismatch: the sender's dtype or count differ (its bytes were
                read aside; the link stays in service).
        """
        head = torch.empty(2, dtype=torch.int64)
        link.wait(link.irecv(head, wire_tag(msg.tag, _HEADER)), _HEADER_BYTES, watch=False)
        code, numel = (int(v) for v in head.tolist())
        mine = (msg.code, msg.buf.numel())
        ok = (code, numel) == mine
        ack = torch.tensor([0 if ok else 1, *mine], dtype=torch.int64)
        ack_work = link.isend(ack, wire_tag(msg.tag, _ACK))
        if ok:
            if msg.nbytes:
                link.wait(link.irecv(bytes_of(msg.buf), wire_tag(msg.tag, _DATA)), msg.nbytes)
            link.wait(ack_work, _ACK_BYTES, watch=False)
            msg.finish()
            return
        if not 0 <= code < len(SUPPORTED_DTYPES) or numel < 0:
            raise LinkError(f"rank {self.rank}: a malformed header from rank {self.peer_rank}")
        theirs = numel * SUPPORTED_DTYPES[code].itemsize
        if theirs:  # read the bytes aside: the stream goes on after them
            aside = memoryview(bytearray(theirs))
            link.wait(link.irecv(aside, wire_tag(msg.tag, _DATA)), theirs)
        link.wait(ack_work, _ACK_BYTES, watch=False)
        raise CollectiveMismatch(
            f"rank {self.rank}: {msg.what} met a send of {_describe(code, numel)} from "
            f"rank {self.peer_rank}; nothing was received",
            calls={self.rank: msg.what, self.peer_rank: f"send of {_describe(code, numel)}"},
            fields=("dtype", "numel"),
        )

    # -- shutdown -------------------------------------------------------------------------
    def close(self) -> None:
        """Fail what is queued or in flight, close the link and end the threads."""
        with self._link_lock:
            self._closed = True
        self._table.close()  # pending waits fail at once; a build in progress gives up
        self._sends.put(None)
        self._recvs.put(None)
        for thread in self._threads:
            thread.join(_JOIN_S)
        if any(t.is_alive() for t in self._threads):
            logger.warning(
                "rank %d (epoch %d): point-to-point threads with rank %d still running at close",
                self.rank, self.epoch, self.peer_rank,
            )  # fmt: skip
            return
        for queue in (self._sends, self._posted, self._recvs):
            queue.close()
