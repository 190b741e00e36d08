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
generation (:meth:`resilient.links.table.Link.abort`), which the Tx reads in place of the
acknowledgement.

Tags of re-routed messages are shifted by the original rail and generation, so
they never match the backup rail's own traffic.

When no rail is left and the failed link was cut by us (the peer is alive), the
receiver names the store itself as the backup (``RELAY_RAIL``, see
:mod:`resilient.collectives.relay`), if the route allows it.
"""

from __future__ import annotations

import collections
import logging
import threading
from typing import Any, Final

import torch

from resilient import events
from resilient.collectives.relay import RELAY_RAIL, StoreLink
from resilient.collectives.route import Route
from resilient.errors import LinkError
from resilient.links.native_steps import DONE
from resilient.links.table import Link

__all__ = ["Rx", "Tx", "ack_tag", "finished_receiving"]

logger = logging.getLogger(__name__)

_ACK_TAG: Final = 1 << 30
# Stands in for the acknowledgement tensor where there are none (one rail): never sent.
_NO_ACK: Final = torch.zeros(1, dtype=torch.int64)


def _shift(tag: int, rail: int, gen: int) -> int:
    return tag if gen == 0 else tag + ((rail + 1) << 20) + (gen << 16)


def ack_tag(route: Route, rail: int, gen: int = 0) -> int:
    """The acknowledgement's tag of a channel of ``rail`` (before the link's salt)."""
    return _ACK_TAG + ((route.seq % 256) << 8) + (rail << 4) + gen + route.base


def finished_receiving(route: Route, peer: int, rail: int, link: Link, gen: int = 0) -> None:
    """Every message from ``peer`` arrived and its acknowledgement went out on
    ``link``: should the link break later, tell the peer's sender (it may still be
    waiting for that acknowledgement) by the record of the next generation."""
    key = route.key(peer, route.links.rank, rail, gen + 1)
    link.finished.append((route.store, key))
    if link.broken:  # broke between the acknowledgement and now
        route.store.set(key, "done")


class _Channel:
    def __init__(self, route: Route, peer: int, rail: int) -> None:
        self.route, self.peer, self.rail = route, peer, rail
        self.link: Link | StoreLink = route.links.get(peer, rail)
        self.gen = 0
        self.tried = {rail}
        # Acknowledgements exist so that a failover can still re-send; with a single
        # rail there is nothing to fail over to, so they would only cost two gloo
        # ops per channel and call (measured: 8-9 points of DDP step overhead).
        self.acks = len(route.links.rails) > 1
        # Tensors, or byte views of them on socket links (resilient.collectives.mesh).
        self._msgs: list[tuple[torch.Tensor | memoryview, int]] = []
        self._works: list[Any] = []
        # What the C step moved of the next messages before it stopped, in posting
        # order (resilient.links.native_steps): DONE (sent), a work to finish, or None (not
        # begun). Taken only on the link the step used (generation 0).
        self.ahead: collections.deque[Any] = collections.deque()
        self.acked_in_c = False

    def _adopt(self, idx: int) -> bool:
        """Give message ``idx`` what the C step did of it; False: post it as usual."""
        ahead = self.ahead.popleft() if self.ahead else None
        # After a failover the messages are re-sent from the first unconsumed one,
        # unless the C step acknowledged them all (then they stand: Rx._final).
        if ahead is None or (self.gen and not self.acked_in_c):
            return False
        if ahead is not DONE:  # a work the pair finishes (or a finished receive)
            ledger = getattr(self.link, "ledger", None)  # generation 0: a Link's
            if ledger is not None:
                ledger.posted(ahead)
            self._works[idx] = ahead
        return True

    @property
    def me(self) -> int:
        return self.route.links.rank

    def _ack_tag(self) -> int:
        return ack_tag(self.route, self.rail, self.gen)

    def _wire(self, tag: int) -> int:
        """``tag`` as this channel posts it now (rail, failover generation, call)."""
        return _shift(tag, self.rail, self.gen) + self.route.base

    def _event(self, n: int, old: Link | StoreLink, kind: str = "link.rerouted") -> None:
        relayed = self.route.links.relayed
        if self.link.rail == RELAY_RAIL and (self.peer, old.rail) in relayed:
            return  # said once: every call takes the relay until the link is repaired
        if self.link.rail == RELAY_RAIL:
            relayed.add((self.peer, old.rail))
        self.route.log.append((self.peer, old.rail, self.link.rail, n))
        where = (
            "through the store (no rail left; until the link is repaired)"
            if self.link.rail == RELAY_RAIL
            else f"on rail {self.link.rail}"
        )
        logger.warning(
            "rank %d (%s call %d): %r failed; %s resumed from message %d %s",
            self.me, self.route.links.name, self.route.seq, old, type(self).__name__, n, where,
        )  # fmt: skip
        events.emit(
            kind,
            links=[(self.me, self.peer, old.rail)],
            reason=f"{old!r} failed during call {self.route.seq}",
            action=f"resumed from message {n} {where}",
        )


class Tx(_Channel):
    """What this rank sends to ``peer`` on ``rail`` in one collective.

    Fails over in its own thread when one of its ops fails, or in a thread of its
    own when its link is cut from elsewhere (failing over waits for the peer's
    record, which must never hold up the thread that cuts links).
    """

    def __init__(self, route: Route, peer: int, rail: int, *, ack: Any = None) -> None:
        """``ack``: what a stopped C step did of the acknowledgement's receive
        (resilient.collectives.native_acks): a finished work, one to finish, or None."""
        super().__init__(route, peer, rail)
        # The receiver said it had everything (in a C step, perhaps).
        self._delivered = ack is not None and ack.done
        self._lock = threading.RLock()
        # The acknowledgement's receive is posted up front: were it posted only at
        # the end, every rank could be waiting for its left neighbour to post it.
        self._ack = torch.zeros(1, dtype=torch.int64) if self.acks else _NO_ACK
        self._ack_work: Any = None
        # Failing over means waiting for the peer's record: never in the constructor,
        # where the peer may not have built its receiver yet. The dead link is kept,
        # not a flag: a cut may fail this channel over (in its own thread) before
        # the stale mark is acted on, and the backup must not be taken for it.
        link = self.link
        self._stale: Link | StoreLink | None = None if link.watch_sender(self) else link
        if ack is not None and not self._delivered:
            self._ack_work = ack  # half read by the C step: the pair reads the rest
            link.ledger.posted(ack)  # type: ignore[union-attr]
        elif self._stale is None and self.acks and not self._delivered:
            try:
                self._ack_work = link.irecv(self._ack, self._ack_tag())
            except LinkError:
                self._stale = link

    def _check(self) -> None:
        if self._stale is None:  # the common case, read without the lock
            return
        with self._lock:
            stale, self._stale = self._stale, None
            if stale is not None:
                self._failover(stale)  # a no-op if the channel left it already

    def post(self, tensor: torch.Tensor | memoryview, tag: int) -> int:
        self.route.check_epoch()
        with self._lock:
            idx = len(self._msgs)
            self._msgs.append((tensor, tag))
            self._works.append(None)
            self._check()  # a failover here re-posts this one too
            if self._adopt(idx):
                return idx
            if self._works[idx] is None and not self._delivered:
                link = self.link
                try:
                    self._works[idx] = link.isend(tensor, self._wire(tag), self.route.sent_digest)
                except LinkError:
                    self._failover(link)  # re-posts this one too
            return idx

    def wait(self, idx: int, nbytes: int) -> None:
        self._check()
        while True:
            with self._lock:
                link, work, gen = self.link, self._works[idx], self.gen
            if work is None:
                return
            try:
                link.wait(work, nbytes, interruptible=True)
            except LinkError:
                self._failover(link)
                continue
            with self._lock:
                if self.gen == gen:
                    self._works[idx] = None
                    return

    def finish(self) -> None:
        """Wait until the receiver acknowledged everything (a failover may re-send)."""
        self._check()
        if not self.acks:
            with self._lock:
                self.link.unwatch_sender(self)
            return
        while True:
            with self._lock:
                link, work, gen = self.link, self._ack_work, self.gen
                if self._delivered:
                    link.unwatch_sender(self)
                    return
            try:
                link.wait(work, 8, watch=False)
            except LinkError:
                self._failover(link)
                continue
            with self._lock:
                if self.gen == gen:
                    self._delivered = True

    def release(self) -> None:
        """Let go of the link: the call was refused (resilient.collectives.digest_check), so none of
        it is re-sent or failed over."""
        with self._lock:
            self.link.unwatch_sender(self)

    def cut(self, link: Link) -> None:
        """``link`` was cut from elsewhere: fail over in a thread of our own."""
        try:
            self.route.backup(self.peer, self.tried | {link.rail})
        except LinkError:
            if not self.route.can_relay(link) or RELAY_RAIL in self.tried:
                return  # nowhere to go: the owner's next op raises the LinkError

        def run() -> None:
            try:
                self._failover(link)
            except LinkError as exc:  # the owner's next op on the dead link raises too
                logger.warning("rank %d: failover to rank %d: %s", self.me, self.peer, exc)

        threading.Thread(target=run, name="tx-failover", daemon=True).start()

    def _failover(self, failed: Link | StoreLink) -> None:
        if (why := self.route.given_up()) is not None:
            # Not a broken link: the call is over, and the link may serve the next
            # epoch (resilient.links.ledger).
            raise LinkError(f"rank {self.me}: no failover to rank {self.peer}: {why}")
        with self._lock:
            if self.link is not failed or self._delivered:
                return  # done already (by the owner, or by the thread of a cut)
            old = self.link
            if not old.broken:
                old.abort("a send on it failed")
            old.unwatch_sender(self)
            self._resume(old)

    def _resume(self, old: Link | StoreLink) -> None:
        while True:
            self.gen += 1
            key = self.route.key(self.me, self.peer, self.rail, self.gen)
            record = self.route.read(key)
            # Read by this sender only; while a pair relays, every call writes one.
            self.route.store.delete_key(key)
            if record == "done":
                self._delivered = True
                self._works = [None] * len(self._works)
                return
            n, rail = (int(x) for x in record.split(","))
            self.tried.add(rail)
            self.link = self.route.link(self.peer, rail, self.rail, self.gen, sender=True)
            if not self.link.watch_sender(self):
                continue  # the receiver fails over again too: read the next record
            try:
                digest = self.route.sent_digest
                for i, (tensor, tag) in enumerate(self._msgs):
                    wire = self._wire(tag)
                    self._works[i] = None if i < n else self.link.isend(tensor, wire, digest)
                if self.acks:
                    self._ack_work = self.link.irecv(self._ack, self._ack_tag())
            except LinkError:
                continue
            self._event(n, old)
            return


class Rx(_Channel):
    """What this rank receives from ``peer`` on ``rail`` in one collective.

    Fails over from whichever thread learns first that its link is dead: its own,
    or the one that cut the link (see :meth:`resilient.links.table.Link.abort`). That
    never blocks, and publishing at once is what keeps two ranks from each waiting
    for the other's record. A message that completed on the old link while the
    failover ran is waited for again on the new one (the bytes are the same).
    """

    def __init__(
        self, route: Route, peer: int, rail: int, *, ack: Any = None, ahead: Any = ()
    ) -> None:
        """``ack``, ``ahead``: what a stopped C step did of the acknowledgement's send
        (DONE, a work to finish, or None; resilient.collectives.native_acks) and of
        each message (see ``_Channel.ahead``)."""
        super().__init__(route, peer, rail)
        self.ahead.extend(ahead)
        self.consumed = 0
        self._ack = torch.ones(1, dtype=torch.int64) if self.acks else _NO_ACK
        self._ack_sent: Any = None if ack is DONE else ack
        # Acknowledged in a C step: everything had arrived, so a failover now
        # re-sends nothing (it publishes "done"), and the step's receives stand.
        self._final = self.acked_in_c = ack is not None
        self._done = False
        self._lock = threading.RLock()
        if not self.link.watch_receiver(self):
            self.failover(self.link)  # never blocks: it only publishes where to resume

    def post(self, into: torch.Tensor | memoryview, tag: int) -> int:
        self.route.check_epoch()
        with self._lock:
            idx = len(self._msgs)
            self._msgs.append((into, tag))
            self._works.append(None)
            if self._adopt(idx):
                return idx
            # Every failover names the link that failed: breaking it may already
            # have failed this channel over (its receivers are told at once).
            link = self.link
            try:
                self._works[idx] = link.irecv(into, self._wire(tag), self.route.digest)
            except LinkError:
                self.failover(link)
            return idx

    def wait(self, idx: int, nbytes: int) -> None:
        """Wait for message ``idx``; messages must be waited for in posting order."""
        if idx != self.consumed:
            raise AssertionError(f"receive {idx} waited before {self.consumed}")
        while True:
            with self._lock:
                link, work, gen = self.link, self._works[idx], self.gen
            try:
                link.wait(work, nbytes, interruptible=True)
            except LinkError:
                self.failover(link)
                continue
            with self._lock:
                if self.gen == gen:
                    self.consumed += 1
                    return

    def ack(self) -> None:
        """Post the acknowledgement once every message was consumed.

        From here on a failover re-sends nothing, not even the acknowledgement: it
        publishes "done", which the sender reads if the acknowledgement was lost
        (a second acknowledgement could wait forever for a receive never posted).
        """
        if not self.acks:
            return
        with self._lock:
            if self._final:  # a C step sent it (or is sending it: ``_ack_sent``)
                return
            self._final = True
            if self._done:
                return
            link = self.link
            try:
                self._ack_sent = link.isend(self._ack, self._ack_tag())
            except LinkError:
                self.failover(link)

    def finish(self) -> None:
        """Wait for the acknowledgement to go out (call after :meth:`ack` and the
        sending side's finish); should the link break later, the sender learns
        from the record published then (see Link.finished)."""
        if not self.acks:
            with self._lock:
                self.link.unwatch_receiver(self)
            return
        with self._lock:
            link, sent = self.link, self._ack_sent
        if sent is not None:
            try:
                link.wait(sent, 8, watch=False)
            except LinkError:
                self.failover(link)
        with self._lock:
            self.link.unwatch_receiver(self)
            if self._done:
                return
            link, gen = self.link, self.gen
        finished_receiving(self.route, self.peer, self.rail, link, gen)  # type: ignore[arg-type]

    def news(self, idx: int) -> bool:
        """Whether message ``idx`` (waited for) came with the NEWS flag."""
        return bool(getattr(self._works[idx], "news", False))

    def release(self) -> None:
        """Let go of the link (see Tx.release)."""
        with self._lock:
            self.link.unwatch_receiver(self)

    def failover(self, failed: Link | StoreLink) -> None:
        """Resume on a backup rail from the first unconsumed message (never blocks).

        ``failed``: the link that broke; nothing is done if this channel already
        left it (breaking a link fails its receivers over at once, from whichever
        thread broke it).

        Raises:
            LinkError: no usable rail is left, or the call was given up.
        """
        if (why := self.route.given_up()) is not None:
            raise LinkError(f"rank {self.me}: no failover from rank {self.peer}: {why}")
        with self._lock:
            if self._done or self.link is not failed:
                return
            old = self.link
            if not old.broken:
                old.abort("a receive on it failed")
                if self.link is not old or self._done:
                    return  # the abort failed us over already
            old.unwatch_receiver(self)
            self._ack_sent = None
            if self._final:
                self.gen += 1
                key = self.route.key(self.peer, self.me, self.rail, self.gen)
                self.route.store.set(key, "done")
                self._done = True
                return
            self._resume(old)

    def _resume(self, old: Link | StoreLink) -> None:
        while True:
            self.gen += 1
            try:
                rail = self.route.backup(self.peer, self.tried)
            except LinkError:
                if not self.route.can_relay(old) or RELAY_RAIL in self.tried:
                    raise
                rail = RELAY_RAIL
            self.tried.add(rail)
            n = self.consumed
            # The relay's link first: it marks this side ready before the sender,
            # reading the record, can start waiting for that mark.
            link = self.route.link(self.peer, rail, self.rail, self.gen, sender=False)
            self.route.store.set(
                self.route.key(self.peer, self.me, self.rail, self.gen), f"{n},{rail}"
            )
            self.link = link
            if not self.link.watch_receiver(self):
                continue
            try:
                for i in range(n, len(self._msgs)):
                    into, tag = self._msgs[i]
                    wire = self._wire(tag)
                    self._works[i] = self.link.irecv(into, wire, self.route.digest)
            except LinkError:
                continue
            self._event(n, old)
            return
