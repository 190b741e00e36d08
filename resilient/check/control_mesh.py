"""The signature exchange's all-gather over socket control links, with little Python.

Every collective's signature exchange is an all-gather of one row per rank. Run
through the data plane's machinery (a ring engine, a mesh schedule, failover
channels with their records) it cost ~0.8 ms of CPU per exchange and rank on a
4-rank DDP job sharing 2 cores, where the rows themselves take microseconds over
socket links (resilient.links.socket_link). Here each rank sends its row straight to
every peer on the exchange's rail and receives theirs, through the links' own
ops (so ledgers, stall checks and cuts see them as before).

Every row travels under one tag, so each pair's rows meet in order, exchange by
exchange, as they did on the channels: a rank that called one collective more
than the others sends a row the others read as the wrong call, and every rank
raises CollectiveMismatch (a tag per exchange would leave them waiting instead).

Failover is simpler than the channels' because a row is tiny and an exchange
idempotent: a rank keeps its last two rows (a peer is at most one exchange
behind: a rank that finished exchange ``s`` got every row of ``s``, so every peer
has finished ``s - 1``). When a control link breaks, at either end and from
whichever thread cuts it, the rank publishes those rows in the store under its
own key; a receiver whose link to a peer is broken, or breaks while it waits,
reads that peer's row from there. Breaks reach both ends (the health board, the
peer watch, a socket's close), so the rows always meet. With one rail nothing is
relayed (as in the data plane, a broken link then fails the call), and once the
epoch's calls are given up (a peer lost) a wait for a row ends at once.
"""

from __future__ import annotations

import contextlib
import struct
import threading
import time
import weakref
from collections import deque
from typing import Any, Final

import torch

from resilient import events
from resilient.collectives.relay import RELAY_RAIL
from resilient.errors import LinkError
from resilient.links.socket_link import SocketLink
from resilient.links.table import Link, LinkTable

__all__ = ["FALLBACK_TAG", "ControlMesh"]

_TAG: Final = 1 << 29
# The rows of elided calls that fall back (resilient.collectives.digest_check): in order among
# themselves, whatever full rows went out meanwhile.
FALLBACK_TAG: Final = _TAG + 1
_SEQ: Final = struct.Struct("<q")
_NAP_S: Final = 0.001
_MAX_NAP_S: Final = 0.02


def _rows_of(table: torch.Tensor) -> list[memoryview]:
    """Each row of a (contiguous, CPU) exchange table as a byte view: what a socket
    link sends and receives, without viewing a tensor as bytes again per op."""
    array: Any = table.numpy()  # numpy's stubs do not say ndarray is a buffer
    whole = memoryview(array).cast("B")
    size = len(whole) // len(table)
    return [whole[i : i + size] for i in range(0, len(whole), size)]


class _Publisher:
    """Registered with a control link: when it breaks, the rows go to the store."""

    def __init__(self, mesh: ControlMesh) -> None:
        self._mesh = weakref.ref(mesh)

    def cut(self, link: Link) -> None:  # called by Link._failed, from any thread
        mesh = self._mesh()
        if mesh is not None:
            mesh.publish()


class ControlMesh:
    """All-gathers of one row per rank for one epoch's control links."""

    def __init__(self, *, rank: int, world: int, links: LinkTable) -> None:
        self.rank, self.world, self.links = rank, world, links
        self.peers = [p for p in range(world) if p != rank]
        self._recent: deque[tuple[int, torch.Tensor]] = deque(maxlen=2)
        self._publisher = _Publisher(self)
        # Links told to publish when they break, by id (each lives as long as this
        # epoch's table: a repaired one replaces it under the same key).
        self._watched: dict[int, Link] = {}
        self._built = False
        # Rows taken from the store, as (peer, rail, RELAY_RAIL, seq): the data
        # plane's failover record (RingEngine.failovers) for the control links.
        self.failovers: list[tuple[int, int, int, int]] = []
        self._said: weakref.WeakSet[Link] = weakref.WeakSet()
        self._publishing = threading.Lock()

    def _key(self, rank: int) -> str:
        t = self.links
        return f"ctlrow/{t.name}/e{t.epoch}/{rank}"

    def publish(self) -> None:
        """Put this rank's last rows in the store (a control link broke)."""
        if len(self.links.rails) < 2:
            return
        # One publisher at a time, the rows read under the lock: a link's break
        # publishes from whichever thread cut it, while the exchange publishes
        # from its own, and a thread that read the rows before the exchange's
        # newest one was added must not store them over the newer set (the peer
        # waiting for that row would find it gone and give up at its deadline).
        with self._publishing:
            recent = list(self._recent)
            if not recent:
                return
            blob = b"".join(_SEQ.pack(seq) + row.numpy().tobytes() for seq, row in recent)
            try:
                self.links.store.set(self._key(self.rank), blob)  # type: ignore[arg-type]  # bytes
            except Exception as exc:  # a peer then waits for our row until its deadline
                raise LinkError(f"rank {self.rank}: publishing control rows failed: {exc}") from exc

    def _link(self, peer: int, rail: int) -> SocketLink:
        link = self.links.get(peer, rail)
        # A control mesh exists only over socket control links (resilient.check.exchange).
        assert isinstance(link, SocketLink), f"{link!r} is not a socket link"
        if id(link) not in self._watched:
            self._watched[id(link)] = link
            if not link.watch_sender(self._publisher):
                self.publish()
        return link

    def ready(self, rail: int) -> bool:
        """Whether a row can go out on ``rail`` now without building a link (any
        thread may then call :meth:`send`; building one is a rendezvous)."""
        return self._built and all(self.links.has(p, rail) for p in self.peers)

    def all_gather(self, table: torch.Tensor, seq: int, rail: int) -> None:
        """Fill every row of ``table`` (``(world, width)``, this rank's row set) with
        the peers' rows of exchange ``seq``, sent on ``rail``: :meth:`send`, then
        :meth:`receive`.

        Raises:
            LinkError: a peer's row did not come (its links closed, the epoch was
                given up, one rail only, or the deadline passed).
        """
        self.receive(table, seq, rail, self.send(table, seq, rail))

    def send(
        self, table: torch.Tensor, seq: int, rail: int, *, tag: int = _TAG
    ) -> list[tuple[Link, Any]]:
        """Send this rank's row of exchange ``seq`` to every peer on ``rail`` (through
        the store where its link is broken); returns the sends for :meth:`receive`.
        Exchanges are sent in order, each once (per ``tag``).

        Raises:
            LinkError: the row had to go through the store and could not.
        """
        links = self.links
        if not self._built:
            # Every rail's links, used or not, as the data plane builds them: a later
            # exchange on another rail must not start a rendezvous in the middle.
            # Once built, a link is only ever replaced under its key (a repair).
            links.ensure((p, r) for r in range(len(links.rails)) for p in self.peers)
            self._built = True
        mine = table[self.rank]
        self._recent.append((seq, mine))
        view = _rows_of(table)[self.rank]
        sends: list[tuple[Link, Any]] = []
        published = False
        for p in self.peers:
            link = self._link(p, rail)
            try:
                if not link.broken:
                    sends.append((link, link.isend_bytes(view, tag)))
                    continue
            except LinkError:
                pass
            if not published:  # this row has to go through the store
                self.publish()
                published = True
        return sends

    def receive(
        self,
        table: torch.Tensor,
        seq: int,
        rail: int,
        sends: list[tuple[Link, Any]],
        *,
        tag: int = _TAG,
    ) -> None:
        """Fill the peers' rows of exchange ``seq`` into ``table`` (see :meth:`send`).

        Raises:
            LinkError: a peer's row did not come (its links closed, the epoch was
                given up, one rail only, or the deadline passed).
        """
        rows = _rows_of(table)
        nbytes = len(rows[self.rank])
        recvs = []
        for p in self.peers:
            link = self._link(p, rail)
            # try/except rather than contextlib.suppress: this runs per peer and call,
            # and suppress is three Python calls.
            try:
                work = None if link.broken else link.irecv_bytes(rows[p], tag)
            except LinkError:  # broken: the row comes through the store
                work = None
            recvs.append((p, link, work))
        for p, link, work in recvs:
            if work is not None:
                if work.done:  # it was in the socket already (SocketPair.recv reads)
                    link.ledger.end_wait(work, finished=True)
                    continue
                try:
                    link.wait(work, nbytes, watch=False)
                    continue
                except LinkError:
                    pass
            self._from_store(p, seq, table[p], rail)
            self._relayed(link, seq)
        for sent_on, work in sends:
            if work.done:  # written to the socket at once (the usual case)
                sent_on.ledger.end_wait(work, finished=True)
                continue
            with contextlib.suppress(LinkError):  # its break published the rows already
                sent_on.wait(work, nbytes, watch=False)

    def _relayed(self, link: Link, seq: int) -> None:
        """Record a row that came through the store; say so once per broken link."""
        self.failovers.append((link.peer, link.rail, RELAY_RAIL, seq))
        if link in self._said:
            return
        self._said.add(link)
        events.emit(
            "link.rerouted",
            links=[(self.rank, link.peer, link.rail)],
            reason=f"{link!r} broke before exchange {seq} was through",
            action="control rows go through the store until the link is repaired",
        )

    def _from_store(self, peer: int, seq: int, into: torch.Tensor, rail: int) -> None:
        """Read ``peer``'s row ``seq`` from its published rows.

        Raises:
            LinkError: one rail only, the epoch given up, or nothing by the deadline.
        """
        links = self.links
        if len(links.rails) < 2:
            raise LinkError(f"rank {self.rank}: control link to rank {peer} broke (one rail)")
        key, size = self._key(peer), into.numel() * into.element_size()
        deadline = time.monotonic() + links.config.op_timeout_floor_s
        nap = _NAP_S
        held: list[int] | None = None  # the exchanges the peer's published rows are of
        while True:
            if links.closed or links.abandoned is not None:
                why = links.abandoned or "links closed"
                raise LinkError(f"rank {self.rank}: no row of rank {peer}: {why}")
            if links.store.check([key]):
                blob = bytes(links.store.get(key))
                held = []
                for at in range(0, len(blob), _SEQ.size + size):
                    held.append(_SEQ.unpack_from(blob, at)[0])
                    if held[-1] == seq:
                        start = at + _SEQ.size
                        raw = bytearray(blob[start : start + size])
                        into.view(torch.uint8).copy_(torch.frombuffer(raw, dtype=torch.uint8))
                        return
            if time.monotonic() > deadline:
                # What the store held tells a peer that never published (its link
                # looked fine to it) from one that was at another exchange.
                found = "nothing" if held is None else f"rows of exchanges {held}"
                # links() rather than get(): get() would build a missing link here.
                link = links.links().get((peer, rail))
                state = "missing" if link is None else ("broken" if link.broken else "not broken")
                raise LinkError(
                    f"rank {self.rank}: rank {peer}'s row of exchange {seq} came neither "
                    f"over its control links nor through the store (it held {found}; "
                    f"here the rail-{rail} link is {state})"
                )
            time.sleep(nap)
            nap = min(nap * 2, _MAX_NAP_S)
