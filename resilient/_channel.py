"""Failover channels: one direction of one rank pair within one collective.

A schedule (ring, mesh, chain) talks to a peer on a rail through a :class:`Tx` (what
it sends there) and an :class:`Rx` (what it receives from there). Each channel
numbers its messages in the order they are posted. When the link under a channel
fails (an op error, or the link was cut because a NIC went down), the channel
*fails over* to the same pair on another rail without losing or repeating anything:

* the receiving end knows exactly how many messages it has consumed, ``n``; it
  picks the backup rail, publishes ``"n,rail"`` in the store under a key named by
  the collective, the pair, the original rail and the failover generation, and
  re-posts its receives from message ``n`` on the backup link;
* the sending end reads that record and re-sends messages ``n, n+1, ...`` on the
  backup link. Only the messages the receiver did not get travel again.

Re-sending from the caller's buffer is sound because no schedule overwrites a
region it sent before the receiver has consumed it: a region is only overwritten
by a result that could not exist without that message (see docs/ARCHITECTURE.md).

A sender cannot tell from gloo that its last messages arrived (a send completes
when the bytes are in the socket). So each Rx acknowledges once it consumed
everything, and each Tx waits for that before the collective returns. If the
link breaks after an Rx finished, the Rx side publishes "done" for the next
generation (:meth:`resilient.links.Link.abort`), which the Tx reads in place of the
acknowledgement.

Tags of re-routed messages are shifted by the original rail and generation, so
they never match the backup rail's own traffic.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any, Final

import torch
from torch._C._distributed_c10d import Store

from recovery import events
from resilient.errors import LinkError
from resilient.links import Link, LinkTable

__all__ = ["Route", "Rx", "Tx"]

logger = logging.getLogger(__name__)

_ACK_TAG: Final = 1 << 30
_POLL_S: Final = 0.001


class _Board:
    """What a route asks the health board (see resilient._health.HealthBoard)."""

    def usable(self, peer: int, rail: int) -> bool:
        return True


@dataclass(slots=True)
class Route:
    """What the channels of one collective share: its links, number and store."""

    links: LinkTable
    seq: int
    timeout_s: float
    board: Any = None  # HealthBoard | None; typed loosely to keep this module leaf-level

    @property
    def store(self) -> Store:
        return self.links.store

    def key(self, src: int, dst: int, rail: int, gen: int) -> str:
        t = self.links
        return f"fo/{t.name}/e{t.epoch}/{t.device_type}/{self.seq}/{src}-{dst}/r{rail}/g{gen}"

    def backup(self, peer: int, tried: set[int]) -> int:
        """The first rail, in index order, not tried yet and not known dead.

        Raises:
            LinkError: no rail is left.
        """
        for rail in range(len(self.links.rails)):
            if rail in tried:
                continue
            if self.board is None or self.board.usable(peer, rail):
                return rail
        raise LinkError(
            f"rank {self.links.rank}: no healthy rail left to rank {peer} (tried {sorted(tried)})"
        )

    def read(self, key: str) -> str:
        """Poll ``key`` (never a blocking get: the store client is shared).

        Raises:
            LinkError: it did not appear within ``timeout_s`` (the peer is gone).
        """
        end = time.monotonic() + self.timeout_s
        while True:
            if self.store.check([key]):
                return bytes(self.store.get(key)).decode()
            if time.monotonic() > end:
                raise LinkError(f"no failover record {key} after {self.timeout_s:.1f} s")
            time.sleep(_POLL_S)


def _shift(tag: int, rail: int, gen: int) -> int:
    return tag if gen == 0 else tag + ((rail + 1) << 20) + (gen << 16)


class _Channel:
    def __init__(self, route: Route, peer: int, rail: int) -> None:
        self.route, self.peer, self.rail = route, peer, rail
        self.link: Link = route.links.get(peer, rail)
        self.gen = 0
        self.tried = {rail}
        self._msgs: list[tuple[torch.Tensor, int]] = []
        self._works: list[Any] = []

    @property
    def me(self) -> int:
        return self.route.links.rank

    def _ack_tag(self) -> int:
        return _ACK_TAG + ((self.route.seq % 256) << 8) + (self.rail << 4) + self.gen

    def _event(self, n: int, old: Link, kind: str = "link.rerouted") -> None:
        events.emit(
            kind,
            links=[(self.me, self.peer, old.rail)],
            reason=f"{old!r} failed during call {self.route.seq}",
            action=f"resumed from message {n} on rail {self.link.rail}",
        )


class Tx(_Channel):
    """What this rank sends to ``peer`` on ``rail`` in one collective."""

    def __init__(self, route: Route, peer: int, rail: int) -> None:
        super().__init__(route, peer, rail)
        self._delivered = False  # the receiver said it had everything
        # The acknowledgement's receive is posted up front: were it posted only at
        # the end, every rank could be waiting for its left neighbour to post it.
        self._ack = torch.zeros(1, dtype=torch.int64)
        self._ack_work: Any = None
        if self.link.broken:
            self._failover()
        else:
            self._post_ack()

    def _post_ack(self) -> None:
        try:
            self._ack_work = self.link.irecv(self._ack, self._ack_tag())
        except LinkError:
            self._failover()

    def post(self, tensor: torch.Tensor, tag: int) -> int:
        idx = len(self._msgs)
        self._msgs.append((tensor, tag))
        self._works.append(None)
        if self._delivered:
            return idx
        try:
            self._works[idx] = self.link.isend(tensor, _shift(tag, self.rail, self.gen))
        except LinkError:
            self._failover()  # re-posts this one too
        return idx

    def wait(self, idx: int, nbytes: int) -> None:
        while self._works[idx] is not None:
            try:
                self.link.wait(self._works[idx], nbytes)
                self._works[idx] = None
            except LinkError:
                self._failover()

    def finish(self) -> None:
        """Wait until the receiver acknowledged everything (a failover may re-send)."""
        while not self._delivered:
            try:
                self.link.wait(self._ack_work, 8, watch=False)
                return
            except LinkError:
                self._failover()

    def _failover(self) -> None:
        old = self.link
        if not old.broken:
            old.abort("a send on it failed")
        while True:
            self.gen += 1
            record = self.route.read(self.route.key(self.me, self.peer, self.rail, self.gen))
            if record == "done":
                self._delivered = True
                self._works = [None] * len(self._works)
                return
            n, rail = (int(x) for x in record.split(","))
            self.tried.add(rail)
            self.link = self.route.links.get(self.peer, rail)
            try:
                for i, (tensor, tag) in enumerate(self._msgs):
                    shifted = _shift(tag, self.rail, self.gen)
                    self._works[i] = None if i < n else self.link.isend(tensor, shifted)
                self._ack_work = self.link.irecv(self._ack, self._ack_tag())
            except LinkError:
                continue  # the receiver fails over again too: read the next record
            self._event(n, old)
            return


class Rx(_Channel):
    """What this rank receives from ``peer`` on ``rail`` in one collective."""

    def __init__(self, route: Route, peer: int, rail: int) -> None:
        super().__init__(route, peer, rail)
        self.consumed = 0
        self._ack = torch.ones(1, dtype=torch.int64)
        self._ack_sent: Any = None
        if self.link.broken:
            self._failover()

    def post(self, into: torch.Tensor, tag: int) -> int:
        idx = len(self._msgs)
        self._msgs.append((into, tag))
        self._works.append(None)
        try:
            self._works[idx] = self.link.irecv(into, _shift(tag, self.rail, self.gen))
        except LinkError:
            self._failover()
        return idx

    def wait(self, idx: int, nbytes: int) -> None:
        """Wait for message ``idx``; messages must be waited for in posting order."""
        if idx != self.consumed:
            raise AssertionError(f"receive {idx} waited before {self.consumed}")
        while True:
            try:
                self.link.wait(self._works[idx], nbytes)
                self.consumed += 1
                return
            except LinkError:
                self._failover()

    def ack(self) -> None:
        """Post the acknowledgement once every message was consumed."""
        self._ack_sent = None
        try:
            self._ack_sent = self.link.isend(self._ack, self._ack_tag())
        except LinkError:
            self._failover()

    def finish(self) -> None:
        """Wait for the acknowledgement to go out; then, should the link break, say
        we were done (call after :meth:`ack` and the sending side's finish)."""
        while True:
            try:
                if self._ack_sent is None:
                    self._ack_sent = self.link.isend(self._ack, self._ack_tag())
                self.link.wait(self._ack_sent, 8, watch=False)
                break
            except LinkError:
                self._ack_sent = None
                self._failover()
        key = self.route.key(self.peer, self.me, self.rail, self.gen + 1)
        self.link.finished.append((self.route.store, key))
        if self.link.broken:  # broke between the ack and now: the sender may need it
            self.route.store.set(key, "done")

    def _failover(self) -> None:
        old = self.link
        if not old.broken:
            old.abort("a receive on it failed")
        while True:
            self.gen += 1
            rail = self.route.backup(self.peer, self.tried)
            self.tried.add(rail)
            n = self.consumed
            self.route.store.set(
                self.route.key(self.peer, self.me, self.rail, self.gen), f"{n},{rail}"
            )
            self.link = self.route.links.get(self.peer, rail)
            try:
                for i in range(n, len(self._msgs)):
                    into, tag = self._msgs[i]
                    self._works[i] = self.link.irecv(into, _shift(tag, self.rail, self.gen))
            except LinkError:
                continue
            self._event(n, old)
            return
