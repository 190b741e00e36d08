"""The health board: which NICs and links each rank sees down, shared through the store.

A rank learns of its own dead NIC in ~10 ms (:mod:`resilient.detect.nic`), and of a link
that failed under one of its ops at once. Its peer on the other end does not: its
ops on that link just stop making progress, and gloo would only give up at their
deadline (seconds). So every rank publishes what it sees down under
``health/e<epoch>/r<rank>`` and bumps ``health/e<epoch>/v``; a watcher thread per
rank wakes on a doorbell (:mod:`resilient.detect.doorbell`: an etcd watch, a TCPStore queue,
or at worst a poll every ``interval_s``), reads that counter and, on a change,
cuts its own end of every link a peer reported dead. Cutting fails the pending ops
at once, which is what starts a failover (:mod:`resilient.collectives.failover`).

The board also answers "which rails can carry traffic between me and this peer?"
for choosing a backup rail, and "is this rail healthy here?" for the rail weights
every rank agrees on (a rail broken anywhere gets no share until it is repaired).
The watcher's reads are non-blocking store calls (a queue bell blocks on a
connection of its own), so it never waits behind a rendezvous on the same client.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Final

from torch._C._distributed_c10d import Store

from resilient.detect.doorbell import Bell, open_bell
from resilient.failures import FailureSite
from resilient.links.repair import LinkRepair
from resilient.links.table import Link, LinkTable

__all__ = ["HealthBoard", "PeerState", "left_after"]

logger = logging.getLogger(__name__)

# After a failed look the watcher waits this long: the store is gone (shutdown) or
# busy, and the board must see peers' reports soon after it is back.
RETRY_S: Final = 0.2


@dataclass(slots=True)
class PeerState:
    """What one rank published: its rails with a NIC down, and its broken links."""

    nic_down: set[int] = field(default_factory=set)
    broken: set[tuple[int, int]] = field(default_factory=set)  # (peer, rail)
    lost: set[int] = field(default_factory=set)  # ranks it saw gone this epoch


def left_after(store: Store, epoch: int, rank: int) -> int | None:
    """How many of ``epoch``'s calls had succeeded at group rank ``rank`` (its
    position in the epoch's members) when it shut its group down
    (:meth:`HealthBoard.leave`), read from ``store`` now; None: it has not left.
    For readers with no board of that epoch (a replacement waiting to be admitted).

    Raises:
        Exception: whatever the store raises (an outage).
    """
    key = f"health/e{epoch}/r{rank}"
    if not store.check([key]):
        return None
    left = json.loads(bytes(store.get(key)).decode()).get("left")
    return int(left) if left is not None else None


class HealthBoard:
    """Publishes this rank's NIC/link state and acts on its peers'; see the module doc."""

    def __init__(
        self,
        *,
        rank: int,
        world: int,
        store: Store,
        epoch: int = 0,
        interval_s: float = 0.005,
        repair_timeout_s: float | None = None,
    ) -> None:
        self.rank, self.world, self.epoch = rank, world, epoch
        # Rebuilds broken links once both ends are up (None: links stay broken).
        self.repair = (
            LinkRepair(rank=rank, board=self, epoch=epoch, timeout_s=repair_timeout_s)
            if repair_timeout_s is not None and world > 1
            else None
        )
        self._store = store
        self._prefix = f"health/e{epoch}"
        self._interval = interval_s
        self._tables: list[LinkTable] = []
        self._nic_down: set[int] = set()
        # Ranks this rank saw gone, published so that ranks not talking to them
        # learn within one poll (resilient.detect.lost_peer); ``on_lost`` gets peers' reports.
        self._lost: set[int] = set()
        self._left: int | None = None  # calls succeeded when this rank shut down (leave)
        self.departed: set[int] = set()  # peers found to have left in order (logged once)
        self.on_lost: Callable[[int, int], None] | None = None
        self._peers: dict[int, PeerState] = {}
        self._version = 0
        # Bumped on every change this rank publishes (a NIC, a broken or repaired
        # link, a loss): news an elided call must not sit on (resilient.collectives.digest_check).
        self.changes = 0
        self._lock = threading.Lock()
        # Held across reading the record and storing it: see publish().
        self._publishing = threading.Lock()
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None
        self._bell: Bell | None = None  # made by start(): rings only reach started boards
        self._rang_unstarted = False

        # Each place that talks to the store counts its own failures (see
        # resilient.failures): a board that cannot read or publish says so.
        def site(name: str, action: str) -> FailureSite:
            return FailureSite(name, rank=rank, epoch=epoch, action=action, log=logger)

        self._watch_failures = site("health board watch", f"retrying every {RETRY_S} s")
        self._bell_failures = site("health board doorbell wait", f"looking again in {RETRY_S} s")
        self._publish_failures = site("health record publish", "peers learn at their deadline")
        self._ring_failures = site("health board ring", "peers look at their safety interval")
        self._read_failures = site("health record read", "judging by the links alone")

    # -- this rank ----------------------------------------------------------------
    def attach(self, table: LinkTable) -> None:
        """Report ``table``'s links when they break; cut them when peers say so."""
        table.on_broken = self._link_broken
        self._tables.append(table)
        if self.repair is not None:
            self.repair.attach(table)

    def start(self) -> HealthBoard:
        if self._thread is None and self.world > 1:
            self._bell = open_bell(self._store, self._prefix, self.rank, poll_s=self._interval)
            if self._rang_unstarted:  # published before there was a bell to ring
                self._ring()
            self._thread = threading.Thread(target=self._run, name="health-board", daemon=True)
            self._thread.start()
            if self.repair is not None:
                self.repair.start()
        return self

    def stop(self, *, wait_repair: bool = True) -> None:
        """Stop watching and repairing (``wait_repair``: see LinkRepair.stop)."""
        self._halt.set()
        if self._bell is not None:
            self._bell.close()
        if self._thread is not None:
            self._thread.join(2.0)
        if self.repair is not None:
            self.repair.stop(wait=wait_repair)

    def seed_nic_down(self, rails: Iterable[int]) -> None:
        """Start knowing these rails' NICs down here (they went down in an earlier
        epoch); published at once, so peers never build links on them."""
        down = set(rails)
        if down:
            with self._lock:
                self._nic_down |= down
            self.publish()

    def nic_changed(self, rail: int, up: bool) -> None:
        """NIC monitor callback: a dead NIC cuts every link of its rail, then is published."""
        with self._lock:
            (self._nic_down.discard if up else self._nic_down.add)(rail)
        if not up:
            for table in self._tables:
                table.abort(f"the NIC of rail {rail} went down", rail=rail)
        self.publish()

    def _link_broken(self, link: Link) -> None:
        self.publish()

    def rail_ok(self, rail: int) -> bool:
        """This rank's NIC on ``rail`` is up and none of its links there is broken."""
        if rail in self._nic_down:
            return False
        return not any(link.rail == rail for t in self._tables for link in t.broken())

    def usable(self, peer: int, rail: int, table: LinkTable) -> bool:
        """Whether ``table``'s (peer, rail) link can carry traffic, as far as is known."""
        state = self._peers.get(peer, PeerState())
        if rail in self._nic_down or rail in state.nic_down:
            return False
        link = table.links().get((peer, rail))
        return link is None or not link.broken

    def nic_up_both(self, peer: int, rail: int) -> bool:
        state = self._peers.get(peer, PeerState())
        return rail not in self._nic_down and rail not in state.nic_down

    def peer_sees_broken(self, peer: int, rail: int) -> bool:
        """``peer``'s latest record lists its link to this rank on ``rail`` as broken."""
        return (self.rank, rail) in self._peers.get(peer, PeerState()).broken

    def peer_cut_rails(self, peer: int) -> set[int]:
        """The rails on which ``peer``'s record, read from the store now, says it may
        have cut its link to this rank: a NIC of that rail down, or that link
        reported broken. Empty when the record cannot be read (the links' own
        evidence then stands)."""
        data = self._read_record(peer)
        if data is None:
            return set()
        mine = {int(r) for p, r in data["broken"] if int(p) == self.rank}
        return {int(r) for r in data["nic_down"]} | mine

    def peer_left_after(self, peer: int) -> int | None:
        """How many of this epoch's calls had succeeded at ``peer`` when it shut its
        group down (read from the store now; see :meth:`leave`), or None: it has
        not left, or its record cannot be read."""
        data = self._read_record(peer)
        left = data.get("left") if data is not None else None
        return int(left) if left is not None else None

    def _read_record(self, peer: int) -> dict[str, Any] | None:
        key = f"{self._prefix}/r{peer}"
        try:
            if not self._store.check([key]):
                return None
            data: dict[str, Any] = json.loads(bytes(self._store.get(key)).decode())
        except Exception as exc:
            self._read_failures.failed(exc)
            return None
        self._read_failures.succeeded()
        return data

    def mark_lost(self, peer: int) -> None:
        """Publish that ``peer`` is gone (never raises)."""
        self._lost.add(peer)
        self.publish()

    def leave(self, succeeded: int) -> None:
        """Record, before this rank's links close, that it shuts its group down with
        the first ``succeeded`` calls of this epoch done (never raises; nobody is
        rung: a peer reads it when it sees the closes).

        A peer still inside a call then knows whether that call is one that
        succeeded here (all its data was sent: an orderly end, not a loss) or one
        this rank failed or never made (a program that failed and shut its group
        down: still a loss; see resilient.detect.lost_peer.left_in_order)."""
        self._left = succeeded
        try:
            with self._publishing:
                self._store.set(f"{self._prefix}/r{self.rank}", self._record())
        except Exception:  # the peers then judge by the closes alone, as before
            logger.debug("rank %d (epoch %d): recording the departure failed", self.rank,
                         self.epoch, exc_info=True)  # fmt: skip

    def _record(self) -> str:
        broken = sorted({(lk.peer, lk.rail) for t in self._tables for lk in t.broken()})
        return json.dumps(
            {"nic_down": sorted(self._nic_down), "broken": broken, "lost": sorted(self._lost),
             "left": self._left}
        )  # fmt: skip

    def publish(self) -> None:
        """Write this rank's record and bump the version (never raises)."""
        self.changes += 1
        try:
            # Threads publish at once (a NIC watch, a link's break, a repair): one
            # that read the record before a change must not store it after the
            # record that has the change, which nothing would publish again.
            with self._publishing:
                self._store.set(f"{self._prefix}/r{self.rank}", self._record())
                self._store.add(f"{self._prefix}/v", 1)
        except Exception as exc:  # the peers then learn at their own deadline
            self._publish_failures.failed(exc)
            return
        self._publish_failures.succeeded()
        self._ring()

    def _ring(self) -> None:
        bell = self._bell
        if bell is None:
            self._rang_unstarted = True
            return
        try:
            bell.ring(p for p in range(self.world) if p != self.rank)
        except Exception as exc:  # the peers then look at their safety interval or deadline
            self._ring_failures.failed(exc)
            return
        self._ring_failures.succeeded()

    # -- peers ----------------------------------------------------------------------
    def _run(self) -> None:
        bell = self._bell
        assert bell is not None
        while not self._halt.is_set():
            # Looking and waiting fail apart (a bell's own connection may die while
            # the store answers), so each has its own streak: one must not end the
            # other's on every round.
            try:
                # Look first: whatever was published before this thread started.
                version = self._read_version()
                if version != self._version:
                    self._version = version
                    self._refresh()
            except Exception as exc:  # store gone (shutdown) or busy: try again later
                self._failed(self._watch_failures, exc)
                continue
            self._watch_failures.succeeded()
            if self._halt.is_set():
                break
            try:
                bell.wait(bell.safety_s)
            except Exception as exc:  # a queue bell's server gone: look, then wait again
                self._failed(self._bell_failures, exc)
                continue
            self._bell_failures.succeeded()

    def _failed(self, site: FailureSite, exc: Exception) -> None:
        if not self._halt.is_set():  # a failure because the board stopped is no news
            site.failed(exc)
        self._halt.wait(RETRY_S)

    def _read_version(self) -> int:
        # A read, not add(0): through etcd an add is a compare-and-swap write.
        key = f"{self._prefix}/v"
        return int(bytes(self._store.get(key)).decode()) if self._store.check([key]) else 0

    def _refresh(self) -> None:
        keys = [f"{self._prefix}/r{p}" for p in range(self.world) if p != self.rank]
        present = [k for k in keys if self._store.check([k])]
        values = self._store.multi_get(present) if present else []
        for key, raw in zip(present, values, strict=True):
            peer = int(key.rsplit("/r", 1)[1])
            data = json.loads(bytes(raw).decode())
            state = PeerState(
                set(data["nic_down"]),
                {(int(p), int(r)) for p, r in data["broken"]},
                {int(p) for p in data.get("lost", [])},
            )
            old = self._peers.get(peer, PeerState())
            self._peers[peer] = state
            for gone in sorted(state.lost - old.lost):
                if self.on_lost is not None and gone != self.rank:
                    self.on_lost(gone, peer)
            # Only what is new: a report still standing from before our link was
            # rebuilt must not cut the rebuilt one.
            self._act(peer, state.nic_down - old.nic_down, state.broken - old.broken)

    def _act(self, peer: int, nic_down: set[int], broken: set[tuple[int, int]]) -> None:
        """Cut our end of whatever ``peer`` newly reported dead."""
        for rail in sorted(nic_down):
            self._cut(peer, [rail], f"rank {peer} reported its NIC of rail {rail} down")
        rails = sorted(r for p, r in broken if p == self.rank)
        self._cut(peer, rails, f"rank {peer} reported this link broken")

    def _cut(self, peer: int, rails: Iterable[int], reason: str) -> None:
        for rail in rails:
            for table in self._tables:
                table.abort(reason, rail=rail, peer=peer)
