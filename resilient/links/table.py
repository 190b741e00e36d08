"""Links: one per (rank pair, rail), the unit that fails and is repaired.

A link (:mod:`resilient.links.link`) is a two-rank connection bound to this rank's
address on one rail: a plain TCP socket pair by default for CPU links
(:mod:`resilient.links.socket_link`; ``data_transport`` and ``control_transport``
"socket"), a two-rank gloo group when those say "gloo", an NCCL pair for CUDA
tensors. It rendezvouses through a store prefix that holds the epoch and a link
generation, so a rebuilt link never meets stale keys. Every operation has a
deadline derived from its size and the link's expected bandwidth, with a floor; a
missed deadline or an error of the connection becomes
:class:`~resilient.errors.LinkError`. :class:`LinkTable` holds a rank's links,
builds them on first use and moves them from epoch to epoch.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections.abc import Callable, Iterable, Mapping

from torch._C._distributed_c10d import Store

from resilient.config import DataPlaneConfig
from resilient.errors import LinkError
from resilient.links.build_turns import BuildTurns, Wanted
from resilient.links.handshake import Handshake
from resilient.links.ledger import salt_of
from resilient.links.lending import BorrowedLink, usable
from resilient.links.link import Link
from resilient.links.socket_link import SocketLink

__all__ = ["Counters", "Link", "LinkTable"]

# (peer, rail, tx_ops, rx_ops, open_ops, dirty): see LinkTable.counters
Counters = tuple[int, int, int, int, int, int]

logger = logging.getLogger(__name__)

# How often a rendezvous wait reads whether its peer shut its group down (a store
# read): a peer that left keeps its partner waiting this much longer at most.
GONE_EVERY_S = 0.25


class LinkTable:
    """This rank's links, created on first use, keyed by (peer, rail)."""

    def __init__(
        self,
        *,
        rank: int,
        rails: tuple[str, ...],
        store: Store,
        config: DataPlaneConfig,
        epoch: int = 0,
        device_type: str = "cpu",
        name: str = "link",
        transport: str = "gloo",
    ) -> None:
        self.name = name  # rendezvous namespace: data links and control links differ
        # "gloo": two-rank gloo groups; "socket": plain TCP sockets (resilient.links.socket_link,
        # resilient.links.socket_pair). CUDA links are NCCL pairs whatever the transport.
        cpu_socket = transport == "socket" and device_type == "cpu"
        self._kind: type[Link] = SocketLink if cpu_socket else Link
        # Whether data messages can carry a call digest (resilient.collectives.digest_check).
        self.sockets = cpu_socket
        self.device_type = device_type
        self.rank = rank
        self.rails = rails
        self.store = store
        self.config = config
        self.epoch = epoch
        self._links: dict[tuple[int, int], Link] = {}
        self._generation: dict[tuple[int, int], int] = {}
        # Rebuilt links waiting for the call every rank agrees to switch on (see
        # stage); off, a rebuilt link goes into service at once.
        self._staged: dict[tuple[int, int], tuple[Link, int]] = {}
        self.stage_installs = False
        # (peer, rail) pairs whose traffic goes through the store (resilient.collectives.relay):
        # reported once, until the link is back in service.
        self.relayed: set[tuple[int, int]] = set()
        self._lock = threading.Lock()  # the dicts above; never held across a rendezvous
        self._turns = BuildTurns(self._build_order)
        self._shake = Handshake(self)
        self.on_broken: Callable[[Link], None] | None = None
        # Why this rank will not build its link to (peer, rail) now (its NIC there is
        # down, or the peer's), or None; see ensure.
        self.refuse: Callable[[int, int], str | None] | None = None
        # Why a peer will never come to a rendezvous (it shut its group down), or
        # None; a handshake asks while it waits (resilient.links.handshake).
        self.gone: Callable[[int], str | None] | None = None
        # This epoch's peers a build found gone so, and why (see peer_gone): lost,
        # if a call needed them; and when peer_gone may next read a peer's record.
        self.left_peers: dict[int, str] = {}
        self._gone_next: dict[int, float] = {}
        self.closed = False
        # Why this epoch's calls are being given up (a peer was lost), or None: then
        # no failover is attempted, since the peers stopped taking part too.
        self.abandoned: str | None = None
        # A subgroup's: the world group's link to (peer, rail) in this table's
        # numbering, which a new link borrows when both ends have it
        # (resilient.links.lending).
        self.borrow: Callable[[int, int], Link | None] | None = None

    def prefix(self, peer: int, rail: int) -> str:
        lo, hi = min(self.rank, peer), max(self.rank, peer)
        gen = self._generation.get((peer, rail), 0)
        return f"{self.name}/e{self.epoch}/{self.device_type}/{lo}-{hi}/r{rail}/g{gen}/"

    def _new_link(
        self,
        peer: int,
        rail: int,
        config: DataPlaneConfig | None = None,
        *,
        met: bool = False,
        background: bool = False,
    ) -> Link:
        link = self._kind(
            rank=self.rank, peer=peer, rail=rail, address=self.rails[rail], store=self.store,
            prefix=self.prefix(peer, rail), config=config or self.config,
            device_type=self.device_type, salt=salt_of(self.epoch),
            over=self._over(self.epoch, peer), met=met, background=background,
        )  # fmt: skip
        return self._wire(link)

    def _over(self, epoch: int, peer: int) -> Callable[[], bool]:
        """Whether a build with ``peer`` begun in ``epoch`` has nobody waiting for it
        any more, or can never finish (the peer shut its group down)."""
        return lambda: (
            self.closed
            or self.abandoned is not None
            or self.epoch != epoch
            or self.peer_gone(peer) is not None
        )

    def peer_gone(self, peer: int) -> str | None:
        """Why ``peer`` will never come to a rendezvous in this epoch (``gone``'s
        answer), or None. Every wait asks as it polls; the store is read at most
        every GONE_EVERY_S per peer, and a departure found is remembered in
        :attr:`left_peers` until the epoch ends."""
        if (why := self.left_peers.get(peer)) is not None or self.gone is None:
            return why
        now = time.monotonic()
        if now < self._gone_next.get(peer, 0.0):
            return None
        self._gone_next[peer] = now + GONE_EVERY_S
        if (why := self.gone(peer)) is not None:
            self.left_peers[peer] = why
        return why

    def _wire(self, link: Link) -> Link:
        # Waits of the signature exchange last as long as the latest rank takes to
        # arrive (a checkpoint, an evaluation): not a link stall.
        link.epoch = self.epoch
        link.watch_stalls = self.name != "ctl"
        link.has_backup = len(self.rails) > 1
        link.on_broken = self._broken
        return link

    def _broken(self, link: Link) -> None:
        if self.on_broken is not None:
            self.on_broken(link)

    def ensure(
        self, pairs: Iterable[tuple[int, int]] = (), *, wanted: Wanted | None = None
    ) -> None:
        """Create the missing links among ``(peer, rail)`` pairs (or ``wanted``'s, which
        the caller said ahead with :meth:`want` and unwants).

        Links are built in one global order (lowest rank pair first, then rail) on
        every rank, whichever thread asks (:mod:`resilient.links.build_turns`), so
        blocking rendezvous can never wait in a cycle around a ring. The table's
        lock is not held while a rendezvous waits: the health board and the calls
        read the table meanwhile (a link that breaks publishes the record).

        Raises:
            LinkError: a rendezvous failed with one rail, a peer did not come within
                ``connect_timeout_s``, or the table left its epoch meanwhile.
        """
        own, epoch = wanted is None, self.epoch
        if wanted is None:
            missing = [k for k in pairs if k not in self._links]
            if not missing:  # every call asks; its links were built long ago
                return
            wanted = self._turns.want(missing)
        try:
            for key in wanted.keys:
                if not self._turns.take(key, wanted.era, self._links.__contains__):
                    continue
                try:
                    link, why = self._build(*key)
                    with self._lock:
                        stale = self.closed or self.epoch != epoch
                        if not stale:
                            self._links[key] = link
                finally:
                    self._turns.done()
                if stale:
                    link.close(background=True)
                    raise LinkError(f"rank {self.rank}: {link!r} was built for an ended epoch")
                if why is None:
                    logger.debug("rank %d: %r up in %.3f s", self.rank, link, link.connect_s)
                else:  # marking it broken publishes the table's state
                    link.refused(why)
        finally:
            if own:
                self._turns.drop(wanted)

    def want(self, pairs: Iterable[tuple[int, int]]) -> Wanted:
        """Say now that this rank will build the missing links among ``pairs`` (then
        pass it to :meth:`ensure`): no build of this table gets ahead of them
        meanwhile. A build in the background says so before any call needs links.
        Whoever wants must :meth:`unwant` once done (built, failed or given up)."""
        return self._turns.want(k for k in pairs if k not in self._links)

    def unwant(self, wanted: Wanted) -> None:
        self._turns.drop(wanted)

    def _build_order(self, pr: tuple[int, int]) -> tuple[int, int, int]:
        """Where ``(peer, rail)`` comes in the order every rank builds links in:
        lowest rank pair first, then rail."""
        return min(self.rank, pr[0]), max(self.rank, pr[0]), pr[1]

    def _build(self, peer: int, rail: int) -> tuple[Link, str | None]:
        """The link to ``peer`` on ``rail``, and None; or, with another rail to fail
        over to, an unbuilt one and why, when either end refuses to build it (its NIC
        is down) or the rendezvous fails. A failure with one rail raises LinkError.

        Both ends first say whether they build (``build<rank>`` under the link's
        prefix), so one end never waits out a rendezvous the other never starts, and
        then whether it succeeded (``built<rank>``), so a link is in service at both
        ends or at neither.
        """
        prefix = self.prefix(peer, rail)
        try:
            shared = self.borrowed(peer, rail)
        except LinkError as exc:
            if len(self.rails) == 1:
                raise
            return self._unbuilt(peer, rail, prefix), f"its rendezvous failed: {exc}"
        if shared is not None:
            return shared, None
        if len(self.rails) == 1:
            return self._new_link(peer, rail), None
        why = self.refuse(peer, rail) if self.refuse is not None else None
        theirs = self._shake.meet(prefix, peer, rail, why)
        if why is None and theirs:
            why = f"rank {peer} does not build it: {theirs}"
        if why is None:
            # Both ends are at this rendezvous now, so a gloo pair takes milliseconds;
            # a failure (a NIC that just went down) must not stall the call for long.
            # (An NCCL communicator's own setup can take seconds.)
            config = self.config
            if self.device_type == "cpu":
                config = dataclasses.replace(config, connect_timeout_s=self._met_bound_s())
            built: Link | None = None
            try:
                built = self._new_link(peer, rail, config, met=True)  # both said "build"
            except LinkError as exc:
                why = f"its rendezvous failed: {exc}"
            # One end may give up at the bound just as the other gets through (a
            # flapping NIC): both say how it went, and only a link built at both
            # ends goes into service (else one end would wait on it for a deadline).
            agreed = self._shake.agree_built(prefix, peer, rail, built is not None)
            why = why or agreed
            if why is None and built is not None:
                return built, None
            if built is not None:
                built.close(background=True)
        return self._unbuilt(peer, rail, prefix), why

    def _unbuilt(self, peer: int, rail: int, prefix: str) -> Link:
        link = self._kind.unbuilt(
            rank=self.rank, peer=peer, rail=rail, prefix=prefix, config=self.config,
            device_type=self.device_type, salt=salt_of(self.epoch),
        )  # fmt: skip
        return self._wire(link)

    def borrowed(self, peer: int, rail: int, timeout_s: float | None = None) -> Link | None:
        """The link to ``peer`` on ``rail`` over the world group's connection
        (:mod:`resilient.links.lending`), or None: build one of its own.

        Both ends say what they could borrow (``share<rank>``: the lent link's
        prefix, and at its lower end the slot it handed out) and borrow only when
        both name the same connection, so no end ever waits on a connection the
        other does not use. Every subgroup table (``borrow`` set) of socket links
        says so, even with nothing to lend, since its peer may have something.

        Raises:
            LinkError: the peer did not say within ``timeout_s`` (default
                ``connect_timeout_s``), or the store failed.
        """
        if self.borrow is None or self._kind is not SocketLink:
            return None
        owner = self.borrow(peer, rail)
        if not usable(owner):
            owner = None
        slot = None
        if owner is not None and owner.rank < owner.peer:
            slot = owner.pg.take_slot()  # the lower end hands slots out
        mine = "" if owner is None else f"{owner.prefix} {slot or 0}"
        prefix = self.prefix(peer, rail)
        theirs = self._shake.tell(f"{prefix}share", mine, peer, rail, timeout_s)
        if owner is None or not theirs or theirs.split(" ")[0] != owner.prefix:
            return None
        agreed = max(int(theirs.split(" ")[1]), slot or 0)  # the lower end's
        if agreed == 0:
            return None
        assert isinstance(owner, SocketLink)
        link = BorrowedLink.over(
            owner, rank=self.rank, peer=peer, prefix=prefix, config=self.config,
            salt=salt_of(self.epoch), slot=agreed,
        )  # fmt: skip
        logger.debug("rank %d: %r borrows %r", self.rank, link, owner)
        return self._wire(link)

    def get(self, peer: int, rail: int) -> Link:
        link = self._links.get((peer, rail))
        if link is None:
            self.ensure([(peer, rail)])
            link = self._links[(peer, rail)]
        return link

    def links(self) -> dict[tuple[int, int], Link]:
        return dict(self._links)

    def has(self, peer: int, rail: int) -> bool:
        """Whether a link to ``peer`` on ``rail`` exists (built, broken or not)."""
        return (peer, rail) in self._links

    def has_all(self, pairs: Iterable[tuple[int, int]]) -> bool:
        """Whether a link to every ``(peer, rail)`` in ``pairs`` exists, once a build of
        one under way here ended (waited for up to :meth:`_met_bound_s`): an elided call
        asks, and every rank must answer alike (see BuildTurns.await_building)."""
        keys = list(pairs)
        if not all(k in self._links for k in keys):
            self._turns.await_building(keys, self._links.__contains__, self._met_bound_s())
        return all(k in self._links for k in keys)

    def _met_bound_s(self) -> float:
        """How long a CPU link's rendezvous may take once both ends said they build
        it (see _build): a failure must not stall a call for long."""
        return min(self.config.connect_timeout_s, self.config.repair_timeout_s)

    def generation(self, peer: int, rail: int) -> int:
        return self._generation.get((peer, rail), 0)

    def rebuild(self, peer: int, rail: int, generation: int, timeout_s: float) -> Link:
        """A new link to ``peer`` on ``rail`` at ``generation``, not in service yet.

        The generation is taken even if the build fails, so the next attempt never
        meets this one's rendezvous keys.

        Raises:
            LinkError: the rendezvous failed or took longer than ``timeout_s``.
        """
        with self._lock:
            self._generation[(peer, rail)] = generation
        shared = self.borrowed(peer, rail, timeout_s)
        if shared is not None:
            return shared
        config = dataclasses.replace(self.config, connect_timeout_s=timeout_s)
        # Both ends say they are here first, so the rendezvous itself is short
        # (``met``): an end that waits for a connection never sits out five times
        # the bound across a partition (resilient.links.gloo_connects ends the other side's
        # attempt, which alone was the hazard of a short gloo timeout).
        self._shake.meet(self.prefix(peer, rail), peer, rail, timeout_s=timeout_s)
        return self._new_link(peer, rail, config, met=True, background=True)

    def install(self, link: Link) -> bool:
        """Put a rebuilt link in service in place of the broken one (closed in the
        background); False (and ``link`` closed) if the table is closed."""
        with self._lock:
            old = None if self.closed else self._links.get((link.peer, link.rail))
            if not self.closed:
                self._links[(link.peer, link.rail)] = link
                self.relayed.discard((link.peer, link.rail))
        if self.closed:
            link.close()
            return False
        if old is not None:
            old.close(background=True)
        return True

    def stage(self, link: Link, generation: int, epoch: int | None = None) -> bool:
        """Keep rebuilt ``link`` until :meth:`promote` (or install it now when
        ``stage_installs`` is off). Both ends must switch on the same call: one end
        sending on the new link while the other still fails over from the old one
        would wait for each other until a deadline. False (and ``link`` closed) if
        the table is closed or has left ``epoch``, the one the link was built in."""
        with self._lock:
            refused = self.closed or (epoch is not None and epoch != self.epoch)
            old = None if refused else self._staged.get((link.peer, link.rail))
            if not refused and self.stage_installs:
                self._staged[(link.peer, link.rail)] = (link, generation)
        if refused:
            link.close()
            return False
        if not self.stage_installs:
            return self.install(link)
        if old is not None:
            old[0].close(background=True)
        return True

    def staged(self) -> list[tuple[int, int, int]]:
        """``(peer, rail, generation)`` of every staged link."""
        with self._lock:
            return [(p, r, g) for (p, r), (_, g) in self._staged.items()]

    def promote(self, peer: int, rail: int, generation: int) -> bool:
        """Put the staged link to ``peer`` on ``rail`` in service, if it is at
        ``generation``; call at a point every rank agreed on."""
        with self._lock:
            entry = self._staged.get((peer, rail))
            if entry is None or entry[1] != generation:
                return False
            del self._staged[(peer, rail)]
        return self.install(entry[0])

    def broken(self) -> list[Link]:
        """Links that broke and were not rebuilt yet (staged ones count as rebuilt)."""
        with self._lock:
            staged = set(self._staged)
        return [
            link for key, link in list(self._links.items()) if link.broken and key not in staged
        ]

    def abort(self, reason: str, *, rail: int, peer: int | None = None) -> int:
        """Cut this rank's links on ``rail`` (to ``peer`` only, when given); returns
        how many were healthy until now."""
        hit = [
            link
            for (p, r), link in list(self._links.items())
            if r == rail and (peer is None or p == peer) and not link.broken
        ]
        for link in hit:
            link.abort(reason)
        return len(hit)

    def counters(self) -> list[Counters]:
        """``(peer, rail, tx_ops, rx_ops, open_ops, dirty)`` of every link not broken:
        ``open_ops`` unfinished ops a thread is blocked on, ``dirty`` the tag salts
        the link must not be kept into (see resilient.links.ledger)."""
        return [
            (p, r, lk.tx_ops, lk.rx_ops, lk.open_ops, lk.ledger.dirty_mask())
            for (p, r), lk in sorted(self._links.items())
            if not lk.broken
        ]

    def freeze(self) -> None:
        """This epoch's calls are given up: waits for their unfinished ops fail at
        once instead of blocking (resilient.links.ledger)."""
        with self._lock:
            links = list(self._links.values())
        for link in links:
            link.ledger.freeze()

    def cut_busy(self, reason: str) -> int:
        """Cut every link a thread is blocked on with an op its peer may never
        complete (the wait would close the pair at its deadline anyway); returns
        how many. Links with only unwaited leftovers stay (their tags are salted)."""
        busy = [lk for lk in list(self._links.values()) if lk.open_ops and not lk.broken]
        for link in busy:
            link.abort(reason)
        return len(busy)

    def renew(
        self,
        epoch: int,
        keep: Iterable[tuple[int, int]],
        *,
        rank: int | None = None,
        renumber: Mapping[int, int] | None = None,
    ) -> int:
        """Enter ``epoch``: keep the links in ``keep`` (same objects), close every
        other one in the background; new links rendezvous under the new epoch, at
        generation 0. Returns how many links were dropped.

        ``rank`` and ``renumber`` (old peer number -> new) move the table to the
        numbering of a group that lost or gained members: the kept links' peers are
        renumbered. The numbering must keep the ranks' order (a pair's two ends
        are told apart by which rank is lower).
        """
        wanted = set(keep)
        with self._lock:
            self.epoch = epoch
            self.abandoned = None
            self.left_peers, self._gone_next = {}, {}  # in the old numbering
            drop = [lk for key, lk in self._links.items() if key not in wanted]
            drop += [lk for lk, _ in self._staged.values()]
            kept = {k: lk for k, lk in self._links.items() if k in wanted}
            gens = {k: g for k, g in self._generation.items() if k in kept}
            if rank is not None and renumber is not None:
                kept = {(renumber[p], r): lk for (p, r), lk in kept.items()}
                gens = {(renumber[p], r): g for (p, r), g in gens.items()}
                for (peer, _), link in kept.items():
                    link.renumber(rank, peer)
                self.rank = rank
            self._links, self._generation = kept, gens
            self._staged = {}
            self.relayed = set()
        self._turns.reset()  # builds of the epoch before end (Handshake.poll), wants are void
        for link in kept.values():
            link.renew(epoch)
        for link in drop:
            link.close(background=True)
        return len(drop)

    def close(self) -> None:
        self.closed = True
        self._turns.reset()
        with self._lock:
            links, self._links = list(self._links.values()), {}
            links += [link for link, _ in self._staged.values()]
            self._staged = {}
        for link in links:
            link.close()
