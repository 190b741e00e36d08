"""Links: one two-rank gloo group per (rank pair, rail), the unit that fails and is repaired.

A :class:`Link` binds its gloo device to this rank's address on one rail and
rendezvouses through a store prefix that holds the epoch and a link generation, so
a rebuilt link never meets stale keys. Every operation has a deadline derived from
its size and the link's expected bandwidth, with a floor; a missed deadline or a
gloo error becomes :class:`~resilient.errors.LinkError`. Dead groups are destroyed
in a background thread, because dropping a gloo group can block for seconds.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Iterable, Mapping
from datetime import timedelta
from typing import Any, Final

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, ProcessGroupGloo, Store

from recovery import events
from resilient import _faults, _sockets, _stall, _waiter
from resilient.config import DataPlaneConfig
from resilient.errors import ConfigError, LinkError

__all__ = ["Link", "LinkTable"]

logger = logging.getLogger(__name__)


# A connection with unacknowledged data and no ACK for this long is cut (see
# Link.network_stall and resilient._stall): well past a few retransmission timeouts.
STALL_CUT_MS: Final = 1000
# What gloo says when the process at the other end closed its socket or is gone.
_PEER_CLOSED: Final = ("closed by peer", "reset by peer", "Broken pipe")

_DEVICES: dict[str, Any] = {}
_DEVICES_LOCK = threading.Lock()


def _rail_device(address: str) -> Any:
    """One gloo device per rail address, shared by every link on that rail.

    Each gloo device runs its own event-loop thread; one per link would mean a
    thread per peer and rail, and on a busy CPU their wake-ups cost more than the
    transfers. Links stay separate groups (separate pairs and failure domains); a
    rail's links share its NIC anyway.
    """
    with _DEVICES_LOCK:
        device = _DEVICES.get(address)
        if device is None:
            device = _DEVICES[address] = ProcessGroupGloo.create_device(hostname=address)
        return device


def _gloo_pair(store: Store, index: int, address: str, config: DataPlaneConfig) -> Any:
    opts: Any = getattr(ProcessGroupGloo, "_Options")()  # noqa: B009 - private, untyped
    opts._timeout = timedelta(seconds=config.connect_timeout_s)
    opts._devices = [_rail_device(address)]
    return ProcessGroupGloo(store, index, 2, opts)


def _nccl_pair(store: Store, index: int, config: DataPlaneConfig) -> Any:
    """A two-rank NCCL communicator for CUDA tensors (ranks on distinct GPUs).

    NCCL picks its own NIC (NCCL_SOCKET_IFNAME / NCCL_IB_HCA), so a CUDA link is not
    bound to one rail's address the way a gloo link is; the rail split still gives
    each rail its own communicator and its own share of the bytes.
    """
    from torch.distributed import ProcessGroupNCCL  # absent from CPU-only builds

    opts: Any = ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=config.connect_timeout_s)
    return ProcessGroupNCCL(store, index, 2, opts)


class Link:
    """A two-rank group between ``rank`` and ``peer`` on ``rail``.

    ``device_type`` "cpu" builds a gloo pair bound to ``address``; "cuda" an NCCL pair.

    Raises:
        LinkError: the rendezvous failed or timed out (from the constructor).
    """

    def __init__(
        self,
        *,
        rank: int,
        peer: int,
        rail: int,
        address: str,
        store: Store,
        prefix: str,
        config: DataPlaneConfig,
        device_type: str = "cpu",
    ) -> None:
        if rank == peer:
            raise ConfigError(f"a link needs two ranks, got {rank} twice")
        self.rank, self.peer, self.rail = rank, peer, rail
        self.prefix = prefix
        self.config = config
        self.device_type = device_type
        self._peer_index = 0 if peer < rank else 1
        index = 0 if rank < peer else 1
        start = time.monotonic()
        try:
            own = PrefixStore(prefix, store)
            if device_type == "cuda":
                self.pg: Any = _nccl_pair(own, index, config)
                self._conns: list[_sockets.Conn] = []
            else:
                with _sockets.capture() as got:
                    self.pg = _gloo_pair(own, index, address, config)
                self._conns = _sockets.pair_up(own, index, got, config.connect_timeout_s)
        except (RuntimeError, dist.DistError) as exc:
            raise LinkError(
                f"link {rank}<->{peer} rail {rail} ({address}): rendezvous failed: {exc}"
            ) from exc
        self.connect_s = time.monotonic() - start
        if device_type != "cuda" and len(self._conns) != 1:
            logger.warning(
                "rank %d: %r has %d known connections (want 1): cutting it may not "
                "interrupt its ops", rank, self, len(self._conns),
            )  # fmt: skip
        self.broken = False
        self.cut_reason: str | None = None  # set when this rank cut it (abort)
        self.watch_stalls = True
        # Another rail to fail over to: only then is a wait worth interrupting early
        # (with one rail the op fails at its deadline either way).
        self.has_backup = False
        # Called once when the link breaks (the health board publishes it, so the
        # peer cuts its end too).
        self.on_broken: Callable[[Link], None] | None = None
        # (store, key) of failover records to publish as "finished" if this link
        # breaks after a receive channel finished on it (see resilient._channel).
        self.finished: deque[tuple[Store, str]] = deque(maxlen=8)
        # Receive channels now using this link: failed over the moment it breaks.
        self._receivers: list[Any] = []
        self._senders: list[Any] = []
        self._broken_lock = threading.Lock()
        self._waiters = _waiter.Waiters(repr(self))
        # Ops posted and ops still unfinished here. After an aborted collective both
        # ends compare them (resilient.recovery keeps a link only if nothing it
        # carried is left half-done: a stale posted receive would swallow the next
        # message with its tag).
        self.tx_ops = 0
        self.rx_ops = 0
        self.open_ops = 0
        # Set when the peer closed or reset the connection (its process is gone, or
        # it cut the link on purpose: the health board tells which).
        self.peer_closed = False
        self.socket_gone = False  # see check_closed

    def __repr__(self) -> str:
        return f"Link({self.rank}<->{self.peer}, rail {self.rail})"

    def renumber(self, rank: int, peer: int) -> None:
        """Give both ends new numbers (a group that shrank or grew); their order
        must not change, since it decides which end of the pair this is."""
        if (rank < peer) != (self.rank < self.peer):
            raise ConfigError(f"{self!r}: renumbering to {rank}<->{peer} swaps the pair's ends")
        self.rank, self.peer = rank, peer

    def _injected_failure(self, what: str) -> None:
        h = _faults.hook()
        if h is not None and h.failed(self.rank, self.peer, self.rail):
            raise self._failed(f"{self}: {what} failed: fault injected by chaos control")

    def watch_receiver(self, rx: Any) -> bool:
        """Fail ``rx`` over when this link breaks; False if it already is broken."""
        with self._broken_lock:
            if not self.broken:
                self._receivers.append(rx)
            return not self.broken

    def unwatch_receiver(self, rx: Any) -> None:
        with self._broken_lock:
            if rx in self._receivers:
                self._receivers.remove(rx)

    def watch_sender(self, tx: Any) -> bool:
        """Tell ``tx`` (``tx.cut(link)``) when this link breaks; False if it is broken."""
        with self._broken_lock:
            if not self.broken:
                self._senders.append(tx)
            return not self.broken

    def unwatch_sender(self, tx: Any) -> None:
        with self._broken_lock:
            if tx in self._senders:
                self._senders.remove(tx)

    def _failed(self, message: str, action: str = "raised LinkError") -> LinkError:
        """Mark the link broken and log ``link.down`` once; returns the error to raise."""
        if self.cut_reason is None and any(m in message for m in _PEER_CLOSED):
            self.peer_closed = True
        with self._broken_lock:
            first, self.broken = not self.broken, True
            receivers, self._receivers = self._receivers, []
            senders, self._senders = self._senders, []
        self._waiters.interrupt()
        if first:
            events.emit(
                "link.down",
                links=[(self.rank, self.peer, self.rail)],
                reason=message,
                action=action,
            )
            logger.warning("rank %d: %s", self.rank, message)
            if self.on_broken is not None:
                try:
                    self.on_broken(self)
                except Exception:  # reporting must never mask the link error itself
                    logger.exception("rank %d: reporting broken %r failed", self.rank, self)
            self._publish_finished()
            # Receivers first: they only publish where to resume, which is what the
            # peer's senders wait for.
            for rx in receivers:
                try:
                    rx.failover(self)
                except LinkError as exc:  # its own wait raises the same error, typed
                    logger.warning("rank %d: no failover for %r: %s", self.rank, self, exc)
                except Exception:
                    logger.exception("rank %d: failing over a receiver failed", self.rank)
            for tx in senders:
                tx.cut(self)
        return LinkError(message)

    def abort(self, reason: str) -> None:
        """Mark the link broken and cut its connection: pending ops fail at once.

        Used when the link is known dead from elsewhere (its NIC went down, the peer
        said so); waiting for its deadline would stall the collective for seconds.
        """
        self.cut_reason = reason  # first: failing over reads it (resilient._relay)
        self._failed(f"{self}: {reason}", action="cut its connection")
        if _sockets.cut(self._conns):
            logger.debug("rank %d: cut %r", self.rank, self)

    def sent(self) -> tuple[int, int, int, int] | None:
        """``(bytes_acked, busy_us, retransmitted, segments_out)`` of this link's
        sending side (see :func:`resilient._sockets.sent`), or None when the kernel
        cannot say."""
        stats = [_sockets.sent(conn) for conn in self._conns]
        if not stats or any(s is None for s in stats):
            return None
        a, b, c, d = zip(*(s for s in stats if s is not None), strict=True)
        return sum(a), sum(b), sum(c), sum(d)

    def network_stall(self, min_ms: int = STALL_CUT_MS) -> str | None:
        """Why this link's connection looks dead to the kernel, or None.

        Dead means: data is waiting for an ACK, the retransmission timer fired,
        and no ACK came for ``min_ms``. A slow or late peer shows none of that
        (its ACKs still come), nor does a throttled link.
        """
        for conn in self._conns:
            p = _sockets.progress(conn)
            if p is not None and p.unacked and p.retransmits and p.since_ack_ms >= min_ms:
                return (
                    f"{p.unacked} segment(s) unacknowledged, {p.retransmits} retransmission "
                    f"timeout(s), no ACK for {p.since_ack_ms} ms"
                )
        return None

    def check_closed(self) -> bool:
        """Mark the link broken if the kernel saw its peer close or reset the
        connection (no op needs to be pending on it); True if it did.

        Also notes in :attr:`socket_gone` that the connection's descriptor is gone:
        gloo closes a pair's socket itself once it read the peer's FIN or RST, and
        then the kernel has no state left to show (resilient._lost weighs it).
        """
        if self.broken:
            return False
        states = [_sockets.tcp_state(conn) for conn in self._conns]
        self.socket_gone = bool(states) and all(s is None for s in states)
        if not any(s in _sockets.PEER_GONE_STATES for s in states):
            return False
        self._failed(f"{self}: connection closed by peer (seen by the kernel)", "marked broken")
        return True

    def _publish_finished(self) -> None:
        """Tell senders still waiting on this link that our receives here had finished."""
        while self.finished:
            store, key = self.finished.popleft()
            try:
                store.set(key, "done")
            except Exception:  # the sender then fails at its own deadline, typed
                logger.warning("rank %d: publishing %s failed", self.rank, key, exc_info=True)

    def isend(self, tensor: torch.Tensor, tag: int) -> Any:
        """Post a send of a contiguous tensor; returns the gloo work to :meth:`wait` on."""
        self._injected_failure("send")
        try:
            work = self.pg.send([tensor], self._peer_index, tag)
        except (RuntimeError, dist.DistError) as exc:
            raise self._failed(f"{self}: send failed: {exc}") from exc
        self.tx_ops += 1
        self.open_ops += 1
        return work

    def irecv(self, tensor: torch.Tensor, tag: int) -> Any:
        """Post a receive into a contiguous tensor."""
        self._injected_failure("recv")
        try:
            work = self.pg.recv([tensor], self._peer_index, tag)
        except (RuntimeError, dist.DistError) as exc:
            raise self._failed(f"{self}: recv failed: {exc}") from exc
        self.rx_ops += 1
        self.open_ops += 1
        return work

    def wait(
        self, work: Any, nbytes: int, *, watch: bool = True, interruptible: bool = False
    ) -> None:
        """Wait for ``work`` within the deadline for ``nbytes``.

        ``watch=False`` keeps the wait out of stall reports (acknowledgements wait
        for the peer to finish, not for bytes); a dead connection is cut either way.
        ``interruptible`` (ops of at least ``_waiter.MIN_BYTES`` on a link with a
        backup rail) makes the wait end as soon as the link breaks, even when gloo's
        own wait would not (see :mod:`resilient._waiter`).

        Raises:
            LinkError: the peer failed, the connection broke or the deadline passed.
        """
        timeout = self.config.deadline_s(nbytes)
        start = time.monotonic()
        # Every wait is watched for a dead connection; only data waits are reported
        # as stalls (a late peer is not a stalled link).
        stalls = _stall.watch()
        token = stalls.begin(
            (self.rank, self.peer, self.rail),
            self,
            nbytes / self.config.expected_link_bytes_per_s,
            report=self.watch_stalls and watch,
        )
        try:
            if interruptible and self.has_backup and self._conns and nbytes >= _waiter.MIN_BYTES:
                self._wait_interruptible(work, nbytes, timeout)
            else:
                work.wait(timedelta(seconds=timeout))
        except (RuntimeError, dist.DistError) as exc:
            raise self._failed(
                f"{self}: op on {nbytes} B failed or exceeded {timeout:.1f} s: {exc}"
            ) from exc
        finally:
            stalls.end(token)
        self.open_ops -= 1
        h = _faults.hook()
        if h is not None:
            self._injected_failure("op")
            delay = h.delay_s(self.rank, self.peer, self.rail, nbytes, time.monotonic() - start)
            if delay > 0:
                time.sleep(delay)

    def _wait_interruptible(self, work: Any, nbytes: int, timeout: float) -> None:
        job = self._waiters.wait(work, timeout)
        if job.interrupted:
            raise self._failed(f"{self}: cut while waiting for {nbytes} B")
        if job.error is not None:
            raise self._failed(
                f"{self}: op on {nbytes} B failed or exceeded {timeout:.1f} s: {job.error}"
            ) from job.error

    def close(self, *, background: bool | None = None) -> None:
        """Drop the group; a broken one in a background thread (closing it can block).

        Healthy groups are dropped synchronously: a gloo group still alive while the
        interpreter exits can abort the process.
        """
        self._waiters.close()
        pg, self.pg = getattr(self, "pg", None), None
        if pg is None:
            return
        if background if background is not None else self.broken:
            threading.Thread(target=_drop, args=(pg,), name=f"close-{self!r}", daemon=True).start()
        else:
            _drop(pg)


def _drop(pg: Any) -> None:
    try:
        pg.shutdown()
    except Exception:  # a dead group may refuse a clean shutdown; the sockets still close
        logger.debug("shutdown of a link group failed", exc_info=True)
    del pg


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
    ) -> None:
        self.name = name  # rendezvous namespace: data links and control links differ
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
        # (peer, rail) pairs whose traffic goes through the store (resilient._relay):
        # reported once, until the link is back in service.
        self.relayed: set[tuple[int, int]] = set()
        self._lock = threading.Lock()
        self.on_broken: Callable[[Link], None] | None = None
        self.closed = False
        # Why this epoch's calls are being given up (a peer was lost), or None: then
        # no failover is attempted, since the peers stopped taking part too.
        self.abandoned: str | None = None

    def prefix(self, peer: int, rail: int) -> str:
        lo, hi = min(self.rank, peer), max(self.rank, peer)
        gen = self._generation.get((peer, rail), 0)
        return f"{self.name}/e{self.epoch}/{self.device_type}/{lo}-{hi}/r{rail}/g{gen}/"

    def _new_link(self, peer: int, rail: int, config: DataPlaneConfig | None = None) -> Link:
        link = Link(
            rank=self.rank,
            peer=peer,
            rail=rail,
            address=self.rails[rail],
            store=self.store,
            prefix=self.prefix(peer, rail),
            config=config or self.config,
            device_type=self.device_type,
        )
        # Waits of the signature exchange last as long as the latest rank takes to
        # arrive (a checkpoint, an evaluation): not a link stall.
        link.watch_stalls = self.name != "ctl"
        link.has_backup = len(self.rails) > 1
        link.on_broken = self._broken
        return link

    def _broken(self, link: Link) -> None:
        if self.on_broken is not None:
            self.on_broken(link)

    def ensure(self, pairs: Iterable[tuple[int, int]]) -> None:
        """Create the missing links among ``(peer, rail)`` pairs.

        Links are built in one global order (lowest rank pair first, then rail) on
        every rank, so blocking rendezvous can never wait in a cycle around a ring.
        """
        todo = sorted(
            {(p, r) for p, r in pairs if (p, r) not in self._links},
            key=lambda pr: (min(self.rank, pr[0]), max(self.rank, pr[0]), pr[1]),
        )
        for peer, rail in todo:
            with self._lock:
                if (peer, rail) in self._links:
                    continue
                link = self._new_link(peer, rail)
                self._links[(peer, rail)] = link
            logger.debug("rank %d: %r up in %.3f s", self.rank, link, link.connect_s)

    def get(self, peer: int, rail: int) -> Link:
        link = self._links.get((peer, rail))
        if link is None:
            self.ensure([(peer, rail)])
            link = self._links[(peer, rail)]
        return link

    def links(self) -> dict[tuple[int, int], Link]:
        return dict(self._links)

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
        config = dataclasses.replace(self.config, connect_timeout_s=timeout_s)
        return self._new_link(peer, rail, config)

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

    def stage(self, link: Link, generation: int) -> bool:
        """Keep rebuilt ``link`` until :meth:`promote` (or install it now when
        ``stage_installs`` is off). Both ends must switch on the same call: one end
        sending on the new link while the other still fails over from the old one
        would wait for each other until a deadline. False if the table is closed."""
        if not self.stage_installs:
            return self.install(link)
        with self._lock:
            old = None if self.closed else self._staged.get((link.peer, link.rail))
            if not self.closed:
                self._staged[(link.peer, link.rail)] = (link, generation)
        if self.closed:
            link.close()
            return False
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

    def counters(self) -> list[tuple[int, int, int, int, int]]:
        """``(peer, rail, tx_ops, rx_ops, open_ops)`` of every link not broken."""
        return [
            (p, r, lk.tx_ops, lk.rx_ops, lk.open_ops)
            for (p, r), lk in sorted(self._links.items())
            if not lk.broken
        ]

    def cut_busy(self, reason: str) -> int:
        """Cut every link with an op still pending (its peer may never complete it);
        returns how many. Idle links stay as they are."""
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
        for link in drop:
            link.close(background=True)
        return len(drop)

    def close(self) -> None:
        self.closed = True
        with self._lock:
            links, self._links = list(self._links.values()), {}
            links += [link for link, _ in self._staged.values()]
            self._staged = {}
        for link in links:
            link.close()
