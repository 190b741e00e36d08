"""One peer's point-to-point traffic: its own link, the wire protocol, who moves it.

A :class:`Channel` carries this rank's ``send`` and ``recv`` calls with one peer
(:class:`~resilient.group.p2p.PointToPoint` keeps one per peer and epoch). Its link
is a socket link of its own, in a :class:`~resilient.links.table.LinkTable` named
``p2p`` (its own rendezvous keys and its own socket engine), never one of the
collectives' links: those are driven by the communication and rail threads, and
frames interleaved from here would corrupt both streams. The link is built on the
first call either end makes to the other (both ends build it then: a call names
its peer, and the peer's matching call names this rank), on rail 0 or the first
rail whose link builds; both ends agree on that (LinkTable.ensure).

On the wire the receiver speaks first; every frame is tag-matched by the socket
pair (:mod:`resilient.links.socket_pair`) on a wire tag made of the user's tag and
the frame's kind:

* receiver -> sender, READY (the receive's dtype number and element count), sent
  as the receive is posted, with the receive of the bytes posted at once into the
  caller's tensor (or the buffer a non-contiguous one lands in);
* sender -> receiver, DATA: the bytes, once the send met its READY and the two
  agree, so only a message of exactly the receive's dtype and size ever lands in
  a receive. On a mismatch the sender sends INFO (its own dtype and count) and an
  empty DATA frame flagged NEWS instead: both ends raise
  :class:`~resilient.errors.CollectiveMismatch`, nothing lands, the link stays.

A receive from any source (an :class:`~resilient.group.p2p_wire.AnyRecv`) is
announced on every peer's channel: READY flagged NEWS. A send that meets such a
READY sends OFFER (its dtype and count) and waits for REPLY: the first OFFER to
come takes the receive (an empty REPLY; the bytes then come as DATA_ANY, so they
never land in a named receive of the tag posted earlier), every later one is
declined (REPLY flagged NEWS), and that send takes the next READY of its tag, still
ahead of the tag's later sends, which wait meanwhile. A mismatch fails both ends
once taken, with no further frame. The READYs left at other peers stay: the
receiver's op there waits, with no deadline, to decline the OFFER that peer's next
send of the tag makes (so nothing is withdrawn, and no send is misdelivered). The
ops' steps are in :mod:`resilient.group.p2p_steps`.

There is no acknowledgement: a send completes once its READY came and its bytes
are in the socket, a receive once its bytes came. A receive usually posts its
READY before the peer reaches the matching send (a ping-pong's reply is posted
as the request leaves), so that send completes on the caller's thread at once.

Who moves the bytes: the caller's thread posts ops and advances every op that can
go on without waiting (a send whose READY is there is written and complete before
``send`` returns; a receive whose bytes are there completes too). One thread per
channel (the pump) builds the link and waits for the rest, on all of the
channel's ops at once (sends waiting for READYs of any tags, in any order;
receives for their bytes; large writes). Both post and advance in issue order
under the channel's lock, so messages of one tag meet in issue order. A sleeping
pump is not woken for an op issued on a built link: its issuer almost always waits
for it, and moves it then; :mod:`resilient.group.p2p_late_wakes` wakes the pump
when nobody did within a couple of milliseconds.

Every op has the link's deadline from the moment it waits for the peer
(``op_timeout_floor_s`` plus the bytes at ``expected_link_bytes_per_s``); a missed
one, or any error of the link, fails the op with
:class:`~resilient.errors.LinkError` and cuts the link, so every op posted on it
fails at once, at both ends. The next call either end makes builds it again (the
next generation; both ends saw the same link break).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Any, Final

from torch._C._distributed_c10d import Store

from resilient.config import DataPlaneConfig
from resilient.errors import LinkError
from resilient.group.handoff import WakePipe
from resilient.group.p2p_late_wakes import LateWakes
from resilient.group.p2p_steps import Steps, _Op, _Settled
from resilient.group.p2p_wire import EMPTY, AnyRecv, Message
from resilient.links.socket_engine import Engine, SocketWork
from resilient.links.table import Link, LinkTable

__all__ = ["Channel"]

logger = logging.getLogger(__name__)

_JOIN_S: Final = 5.0
_QUIET_S: Final = 0.05  # after this long without an op ending, check the link (_ready_link)
_PARK_S: Final = 30.0  # how long one engine wait lasts when no op has a deadline
_YOUNG_S: Final = 0.001  # an op whose wait began this recently is not yet undriven (kick)
_UNDEFERRED_OPS: Final = 64  # after an op nobody drove, issue this many with the pump woken


class _AnyOf(SocketWork):
    """What a thread waits for on the socket engine: any of ``works`` ending, or the
    channel having news since generation ``gen`` (ops came, or it closed)."""

    __slots__ = ("_chan", "_gen", "_until", "_works")

    def __init__(
        self, pair: Any, works: list[Any], chan: Channel, gen: int, until: float = math.inf
    ) -> None:
        super().__init__(pair, EMPTY, sending=False)
        self._works, self._chan, self._gen, self._until = works, chan, gen, until

    def is_completed(self) -> bool:
        # Runs under the engine's lock, many times a wait: reads only, no lock.
        chan = self._chan
        if chan.gen != self._gen or chan.closed:
            return True
        if any(w.done or w.error is not None for w in self._works):
            return True
        # Ops without a deadline (an any-source READY left at a peer) end the wait
        # here before the engine's deadline, which would fail the pair.
        return self._until < math.inf and time.monotonic() >= self._until


class Channel(Steps):
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
        late_wakes: LateWakes | None = None,
        borrow: Callable[[int, int], Link | None] | None = None,
    ) -> None:
        self.rank, self.peer_rank, self.peer, self.epoch = rank, peer_rank, peer, epoch
        self._late_wakes = late_wakes
        self._config = config
        self._floor_s = config.op_timeout_floor_s
        self._per_byte_s = 1.0 / config.expected_link_bytes_per_s
        self._table = LinkTable(
            rank=pos, rails=rails, store=store, config=config, epoch=epoch,
            name="p2p", transport="socket",
        )  # fmt: skip
        self._table.borrow = borrow
        self._link: Link | None = None
        self._link_lock = threading.Lock()
        self._lock = threading.Lock()  # the ops, their posting and progress
        self._ops: list[_Op] = []  # issued and not ended, in issue order
        self._held: set[int] = set()  # tags whose sends wait behind an OFFER (_advance)
        self._late: _Settled = []  # receives from any source given up by ops that stay
        self.closed = False
        self.gen = 0  # bumped when ops come: waits on the engine look again (_AnyOf)
        self._idle = False  # the pump sleeps on _wake
        self._drivers = 0  # callers waiting for their op (the pump leaves it to them)
        self._deferred = False  # ops came that the sleeping pump was not woken for
        self._undeferred = 0  # ops still to wake the pump at once for (kick)
        self._engine: Engine | None = None  # the link's socket engine, once built
        self._active = 0.0  # when an op last ended (monotonic)
        self._wake = WakePipe()
        self._pump = threading.Thread(
            target=self._pump_loop, name=f"resilient-p2p-{rank}-{peer_rank}", daemon=True
        )
        self._pump.start()

    def send(self, msg: Message) -> None:
        """Issue a send of ``msg`` to the peer (completed here if its READY came)."""
        self._issue(_Op(msg))

    def recv(self, msg: Message, any_: AnyRecv | None = None) -> None:
        """Issue a receive of ``msg`` from the peer; with ``any_``, its announcement to
        this peer (a receive from any source, which another peer may take)."""
        self._issue(_Op(msg, any=any_))

    def _issue(self, op: _Op) -> None:
        link = self._ready_link()
        settled: _Settled = []
        with self._lock:
            if self.closed:
                settled = [(op.msg, self._closed_error())]
                pending = idle = defer = False
            else:
                self._ops.append(op)
                settled = self._advance(link)
                pending = op in self._ops
                idle = self._idle
                if pending:
                    self.gen += 1  # a thread waiting on the engine must watch it too
                # Its issuer will most likely wait for it, and drive it then: the
                # pump is woken later, and only if nobody does (p2p_late_wakes).
                defer = (
                    pending and idle and op.any is None and op.link is not None
                    and self._late_wakes is not None and not self._undeferred
                )  # fmt: skip
                self._undeferred = max(0, self._undeferred - 1)
                self._deferred = self._deferred or defer
        self._settle(settled)
        if defer:
            self._late_wakes.defer(self)  # type: ignore[union-attr]
        elif pending:
            self._nudge(idle)

    def kick(self) -> bool:
        """Wake the pump for ops whose wake-up was deferred, unless a caller drives
        the channel now (it hands them to the pump when it leaves); whether it woke
        it. A channel whose ops go undriven stops deferring for a while."""
        with self._lock:
            if not self._deferred or self._drivers or not self._ops:
                self._deferred = False
                return False
            # Issued a moment ago, its waiter most likely on the way: look again later.
            began = max(op.deadline - op.timeout_s for op in self._ops)
            young = began > time.monotonic() - _YOUNG_S
            if not young:
                self._deferred = False
                self._undeferred = _UNDEFERRED_OPS
                idle = self._idle
        if young:
            self._late_wakes.defer(self)  # type: ignore[union-attr]
            return False
        self._nudge(idle)
        return True

    def _nudge(self, idle: bool) -> None:
        """Have the pump look at the ops again (after ``gen`` moved on): wake it, or
        end the engine wait of whoever waits there."""
        if idle:
            self._wake.ring()
            return
        engine_ = self._engine
        if engine_ is not None:
            with engine_.lock:
                engine_.ring()  # its driver serves the ring and hands over (_AnyOf)

    def wait_for(self, msg: Message, limit: float | None) -> None:
        """Move the channel's ops on this (the caller's) thread until ``msg`` ended,
        saving the hand-offs to and from the pump; returns early (the pump goes on)
        when ``msg`` is not posted yet, or ``limit`` (a monotonic time) comes before
        the ops' deadline: a wait on the engine fails the link at its deadline."""
        with self._lock:
            self._drivers += 1
        try:
            while not msg.fut.done():
                link = self._ready_link()
                with self._lock:
                    settled = self._advance(link)
                    gen = self.gen
                    posted = [op for op in self._ops if op.link is not None]
                    mine = any(op.msg is msg for op in posted)
                self._settle(settled)
                if not mine or (limit is not None and limit < min(o.deadline for o in posted)):
                    return
                if self._late_wakes is not None:  # ops on other channels must not wait for this
                    self._late_wakes.flush(self)
                self._wait_any(posted, gen)
        finally:
            with self._lock:
                self._drivers -= 1
                pending = bool(self._ops) and not self._drivers
                if pending:
                    self.gen += 1
                if pending or not self._ops:
                    self._deferred = False
                idle = self._idle
            if pending:
                self._nudge(idle)  # the pump left them to this thread

    # -- the link -------------------------------------------------------------------------
    def _ready_link(self) -> Link | None:
        """The channel's link if it is built and sound, without waiting; else None.

        Asks the kernel whether the peer closed it (a system call) only after a quiet
        spell: a peer whose op failed cut the link, and this end's next op must go
        on the next generation. Ops in a busy exchange are posted on the link as it
        is (a close the kernel saw shows when they are posted: see _advance)."""
        link = self._link
        if link is None or link.broken or link.pg is None or link.pg.error is not None:
            return None
        if time.monotonic() - self._active > _QUIET_S and link.check_closed():
            return None
        return link

    def _link_now(self) -> Link:
        """The channel's link: built on first use, built again (the next generation)
        once it broke.

        Raises:
            LinkError: the channel is closed, or no rail's link could be built.
        """
        with self._link_lock:
            if self.closed:
                raise self._closed_error()
            link = self._link
            if link is not None and not link.broken and not link.check_closed():
                return link
            self._link = link = self._build(link)
        engine_ = link.pg.engine if link.pg is not None else None
        if engine_ is not None:  # shared by every channel's link: its driver may be
            with engine_.lock:  # polling the sockets it had; it must watch this one too
                engine_.ring()
        return link

    def link_on(self, rail: int) -> Link | None:
        """This channel's link on ``rail``, if built."""
        return self._table.links().get((self.peer, rail))

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

    def _closed_error(self) -> LinkError:
        return LinkError(f"rank {self.rank}: point-to-point with rank {self.peer_rank} is closed")

    # -- progress (under self._lock) -----------------------------------------------------
    def _advance(self, link: Link | None) -> _Settled:
        """Post the unposted ops on ``link`` (None: not now) and move every op on as
        far as it goes without waiting, in issue order; returns the ops that ended.
        A failed link is cut, and every op posted on it fails."""
        settled: _Settled = []
        kept: list[_Op] = []
        broken: tuple[Link, str] | None = None
        dead: Link | None = None
        now = time.monotonic()
        if self._held:
            self._held.clear()
        for op in self._ops:
            if op.any is not None and op.link is None and not op.any.open:
                continue  # taken elsewhere before it was announced here: nothing to say
            if broken is None and (op.link is not None or link is not None):
                try:
                    if op.link is None:
                        self._post(op, link, now)  # type: ignore[arg-type]
                        if link.pg.error is not None:  # type: ignore[union-attr]
                            # Closed by the peer before this post (its op failed and
                            # cut it): nothing reached the peer, so the op waits for
                            # the link's next generation, which the pump builds.
                            dead, link, op.link = link, None, None
                            kept.append(op)
                            continue
                    outcome = self._step(op, now)
                except LinkError as exc:
                    broken = (op.link or link, str(exc))  # type: ignore[assignment]
                    settled += self._failed(op, exc)
                    continue
                if op.claim is not None:  # later sends of its tag wait for its REPLY
                    self._held.add(op.msg.tag)
                if outcome is not None:
                    if outcome is not False:
                        settled.append((op.msg, outcome))
                    continue
            kept.append(op)
        if broken is not None:
            kept = self._cut(kept, *broken, settled)
        if self._late:
            settled += self._late
            self._late = []
        if settled:
            self._active = now
        if dead is not None and not dead.check_closed():
            dead.abort(f"found closed by its peer: {dead.pg.error if dead.pg else 'closed'}")
        self._ops = kept
        return settled

    def _cut(self, kept: list[_Op], cut: Link, why: str, settled: _Settled) -> list[_Op]:
        """Cut the failed link ``cut``: the ops in ``kept`` posted on it fail (added to
        ``settled``); returns the others."""
        logger.warning("rank %d (epoch %d): point-to-point: %s", self.rank, self.epoch, why)
        # Cut even when the failure already marked it broken: the peer's end must
        # see the connection close (its next call then builds the link again too).
        cut.abort(f"point-to-point op failed: {why}")
        for op in kept:
            if op.link is cut:
                settled += self._failed(op, LinkError(f"{op.msg.what}: link failed: {why}"))
        return [op for op in kept if op.link is not cut]

    @staticmethod
    def _settle(settled: _Settled) -> None:
        """Complete ended ops' futures (outside the lock: their callbacks may call in)."""
        for msg, outcome in settled:
            if isinstance(outcome, BaseException):
                msg.fail(outcome)
            else:
                msg.finish()

    # -- the pump -------------------------------------------------------------------------
    def _pump_loop(self) -> None:
        while not self.closed:
            try:
                self._pump_once()
            except Exception as exc:  # never leave ops waiting on a dead pump
                logger.exception("rank %d: point-to-point pump failed", self.rank)
                with self._lock:
                    ops, self._ops = self._ops, []
                    settled = [x for op in ops for x in self._failed(op, exc)]
                self._settle(settled)

    def _pump_once(self) -> None:
        """Build the link if an op needs it, move the ops on, then wait for any of them;
        sleep while there are none, or while a caller waits for its own (wait_for)."""
        with self._lock:
            # A receive from any source taken before its READY went out needs no link.
            self._ops = [o for o in self._ops if o.link or o.any is None or o.any.open]
            unposted = any(op.link is None for op in self._ops)
            # Woken for ops a caller now waits for itself (wait_for): back to sleep.
            self._idle = idle = not self._ops or (self._drivers > 0 and not unposted)
        if idle:
            self._sleep()
            return
        link = self._ready_link()
        if link is None and unposted:
            link = self._build_or_fail()
        with self._lock:
            settled = self._advance(link)
            gen = self.gen
            posted = [op for op in self._ops if op.link is not None]
            unposted = len(posted) < len(self._ops)
            self._idle = idle = not self._ops or (self._drivers > 0 and not unposted)
        self._settle(settled)
        if idle:
            self._sleep()
        elif posted:
            self._wait_any(posted, gen)

    def _sleep(self) -> None:
        self._wake.wait()
        with self._lock:
            self._idle = False

    def _wait_any(self, posted: list[_Op], gen: int) -> None:
        """Wait on the engine until one of ``posted`` (all on one link) may move on, the
        channel has news since ``gen``, or the earliest deadline: that fails the link."""
        link = posted[0].link
        pair = link.pg if link is not None else None
        if pair is None:
            return  # closed: their ops fail in the next advance
        self._engine = pair.engine
        # A receive from any source waiting for an OFFER must not fail the pair at its
        # deadline (_unclaimed): the wait ends there instead, as when there is none.
        hard = min((op.deadline for op in posted if op.offer is None), default=math.inf)
        until = min((op.deadline for op in posted if op.offer is not None), default=math.inf)
        if hard == until == math.inf:
            until = time.monotonic() + _PARK_S
        works = [op.work for op in posted]
        pair.engine.wait(_AnyOf(pair, works, self, gen, until), min(hard, until + 1))

    def _build_or_fail(self) -> Link | None:
        """Build the link; on failure fail the ops waiting to be posted."""
        try:
            return self._link_now()
        except LinkError as exc:
            with self._lock:
                failed = [x for op in self._ops if op.link is None for x in self._failed(op, exc)]
                self._ops = [op for op in self._ops if op.link is not None]
            logger.warning("rank %d: point-to-point link not built: %s", self.rank, exc)
            self._settle(failed)
            return None

    # -- shutdown -------------------------------------------------------------------------
    def close(self) -> None:
        """Fail what is issued, close the link and end the pump."""
        with self._lock:  # not the link's lock: a build holds it (table.close ends it)
            self.closed = True
            ops, self._ops = self._ops, []
            failed = [x for op in ops for x in self._failed(op, self._closed_error())]
        self._table.close()  # pending waits fail at once; a build in progress gives up
        self._nudge(idle=True)
        self._settle(failed)
        self._pump.join(_JOIN_S)
        if self._pump.is_alive():
            logger.warning(
                "rank %d (epoch %d): point-to-point pump with rank %d still running at close",
                self.rank, self.epoch, self.peer_rank,
            )  # fmt: skip
            return
        self._wake.close()
