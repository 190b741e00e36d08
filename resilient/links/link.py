"""One link: the connection between this rank and a peer on one rail, the unit that
fails and is repaired.

:class:`Link` moves its ops over a two-rank group bound to this rank's address on
the rail (:mod:`resilient.links.pair_groups`: a gloo pair for CPU tensors, an NCCL
communicator for CUDA ones). CPU links are plain TCP sockets by default
(``data_transport`` and ``control_transport`` "socket"):
:class:`~resilient.links.socket_link.SocketLink` is a Link whose group is a socket
pair, under the same rules. A link rendezvouses through a store prefix (epoch and
generation, from :class:`~resilient.links.table.LinkTable`). Every operation has a
deadline derived from its size and the link's expected bandwidth, with a floor; a
missed deadline or an error of the group becomes
:class:`~resilient.errors.LinkError` and breaks the link (its receivers fail over,
its senders are told). Broken groups are dropped in a background thread, because
dropping a gloo group can block for seconds.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from datetime import timedelta
from typing import Any, ClassVar, Final

import torch
import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store

from resilient import events
from resilient.config import DataPlaneConfig
from resilient.errors import ConfigError, LinkError
from resilient.links import fault_hook, gloo_sockets, gloo_wait, pair_groups, stall
from resilient.links.byte_views import as_tensor
from resilient.links.ledger import OpLedger, salt_of

__all__ = ["PEER_CLOSED", "STALL_CUT_MS", "Link"]

logger = logging.getLogger(__name__)


# A connection with unacknowledged data and no ACK for this long is cut (see
# Link.network_stall and resilient.links.stall): well past a few retransmission timeouts.
STALL_CUT_MS: Final = 1000
# What gloo says when the process at the other end closed its socket or is gone.
PEER_CLOSED: Final = ("closed by peer", "reset by peer", "Broken pipe")


class Link:
    """A two-rank group between ``rank`` and ``peer`` on ``rail``.

    ``device_type`` "cpu" builds a gloo pair bound to ``address``; "cuda" an NCCL pair.

    Raises:
        LinkError: the rendezvous failed or timed out (from the constructor).
    """

    # Whether cutting the connection ends every wait on it by itself; gloo's does
    # not for a message half-way in (resilient.links.gloo_wait), so its large waits run
    # in helper threads.
    cut_wakes_waits: ClassVar[bool] = False
    # Whether the group takes byte views as well as tensors (a SocketPair does).
    takes_bytes: ClassVar[bool] = False

    def __init__(
        self,
        *,
        rank: int,
        peer: int,
        rail: int,
        address: str,
        store: Store | None,
        prefix: str,
        config: DataPlaneConfig,
        device_type: str = "cpu",
        salt: int = 0,
        unbuilt: bool = False,
        over: Callable[[], bool] | None = None,
        met: bool = False,
        background: bool = False,
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
        self.pg: Any = None
        self._conns: list[gloo_sockets.Conn] = []
        if not unbuilt:
            if store is None:
                raise ConfigError(f"link {rank}<->{peer} rail {rail}: no store to build it")
            self._rendezvous(store, index, address, over, met=met, background=background)
        self.connect_s = time.monotonic() - start
        self._init_state(salt)

    @classmethod
    def unbuilt(
        cls, *, rank: int, peer: int, rail: int, prefix: str, config: DataPlaneConfig,
        device_type: str = "cpu", salt: int = 0,
    ) -> Link:  # fmt: skip
        """A link that was never built (its NIC is down at one end): every op on it
        raises LinkError, so its traffic fails over at once; the caller marks it
        broken (:meth:`refused`), and the repair thread builds it once both NICs are up."""
        return cls(
            rank=rank, peer=peer, rail=rail, address="", store=None,
            prefix=prefix, config=config, device_type=device_type, salt=salt, unbuilt=True,
        )  # fmt: skip

    def _rendezvous(
        self,
        store: Store,
        index: int,
        address: str,
        over: Callable[[], bool] | None,
        *,
        met: bool = False,
        background: bool = False,
    ) -> None:
        """Build the pair; ``met``: both ends are known to be at this rendezvous
        already (resilient.links.table says so in the store first), so the whole
        rendezvous is bounded by ``connect_timeout_s``; ``background``: a repair
        (see gloo_sockets.capture)."""
        rank, peer, rail, config = self.rank, self.peer, self.rail, self.config
        try:
            own = PrefixStore(self.prefix, store)
            if self.device_type == "cuda":
                self.pg = pair_groups.nccl_pair(own, index, config)
            else:
                label = f"rank {rank}: {self!r} at {self.prefix}"
                self.pg, self._conns = pair_groups.build_gloo(
                    own, index, address, config, over,
                    peer=peer, label=label, met=met, background=background,
                )  # fmt: skip
        except (RuntimeError, dist.DistError) as exc:
            raise LinkError(
                f"link {rank}<->{peer} rail {rail} ({address}): rendezvous failed: {exc}"
            ) from exc
        if self.device_type != "cuda" and len(self._conns) != 1:
            logger.warning(
                "rank %d: %r has %d known connections (want 1): cutting it may not "
                "interrupt its ops", rank, self, len(self._conns),
            )  # fmt: skip

    def _init_state(self, salt: int) -> None:
        # DataPlaneConfig.deadline_s, precomputed (every op's wait uses it).
        self._floor_s = self.config.op_timeout_floor_s
        self._per_byte_s = 1.0 / self.config.expected_link_bytes_per_s
        self._key = (self.rank, self.peer, self.rail)  # the stall watch's name for it
        self.epoch = 0  # for the events; the table sets it (resilient.links.table)
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
        # breaks after a receive channel finished on it (see resilient.collectives.failover).
        self.finished: deque[tuple[Store, str]] = deque(maxlen=8)
        # Receive channels now using this link: failed over the moment it breaks.
        self._receivers: list[Any] = []
        self._senders: list[Any] = []
        self._broken_lock = threading.Lock()
        self._waiters = gloo_wait.Waiters(repr(self))
        # Ops posted here (link statistics; recovery.agree reads them from records).
        self.tx_ops = 0
        self.rx_ops = 0
        # Unfinished ops and the epoch's tag salt (see resilient.links.ledger).
        self.ledger = OpLedger(salt)
        # Set when the peer closed or reset the connection (its process is gone, or
        # it cut the link on purpose: the health board tells which).
        self.peer_closed = False
        self.socket_gone = False  # see check_closed

    def __repr__(self) -> str:
        return f"Link({self.rank}<->{self.peer}, rail {self.rail})"

    def renew(self, epoch: int) -> None:
        """Carry this link into ``epoch`` (resilient.links.table keeps it): new ops take the
        epoch's tag salt; the unfinished ops of earlier epochs stay pending in gloo,
        unmatched and unwaited (resilient.links.ledger)."""
        self.epoch = epoch
        self.ledger.renew(salt_of(epoch))

    def renumber(self, rank: int, peer: int) -> None:
        """Give both ends new numbers (a group that shrank or grew); their order
        must not change, since it decides which end of the pair this is."""
        if (rank < peer) != (self.rank < self.peer):
            raise ConfigError(f"{self!r}: renumbering to {rank}<->{peer} swaps the pair's ends")
        self.rank, self.peer = rank, peer
        self._key = (rank, peer, self.rail)

    def _injected_failure(self, what: str) -> None:
        h = fault_hook.hook()
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

    def _interrupt(self, why: str) -> None:
        """End the waits on this link now that it is broken (before anything that can
        block, such as publishing the break: the store may be the stopped peer's)."""
        self._waiters.interrupt()

    def unwatch_sender(self, tx: Any) -> None:
        with self._broken_lock:
            if tx in self._senders:
                self._senders.remove(tx)

    def _failed(self, message: str, action: str = "raised LinkError", **extra: object) -> LinkError:
        """Mark the link broken and log ``link.down`` once; returns the error to raise."""
        if self.cut_reason is None and any(m in message for m in PEER_CLOSED):
            self.peer_closed = True
        with self._broken_lock:
            first, self.broken = not self.broken, True
            receivers, self._receivers = self._receivers, []
            senders, self._senders = self._senders, []
        self._interrupt(message)
        if first:
            events.emit(
                "link.down",
                epoch=self.epoch,
                links=[(self.rank, self.peer, self.rail)],
                reason=message,
                action=action,
                **extra,
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

    def refused(self, reason: str) -> None:
        """Mark an unbuilt link (:meth:`unbuilt`) broken: logged as ``link.down`` with
        ``unbuilt`` set, published like any broken link, repaired like one."""
        self.cut_reason = reason  # the peer is alive: it answered (resilient.collectives.relay)
        self._failed(
            f"{self}: not built: {reason}",
            action="left unbuilt; its traffic goes over another rail until it is repaired",
            unbuilt=True,
        )

    def abort(self, reason: str) -> None:
        """Mark the link broken and cut its connection: pending ops fail at once.

        Used when the link is known dead from elsewhere (its NIC went down, the peer
        said so); waiting for its deadline would stall the collective for seconds.
        """
        self.cut_reason = reason  # first: failing over reads it (resilient.collectives.relay)
        self._failed(f"{self}: {reason}", action="cut its connection")
        if gloo_sockets.cut(self._conns):
            logger.debug("rank %d: cut %r", self.rank, self)

    def sent(self) -> tuple[int, int, int, int] | None:
        """``(bytes_acked, busy_us, retransmitted, segments_out)`` of this link's
        sending side (see :func:`resilient.links.gloo_sockets.sent`), or None when the kernel
        cannot say."""
        stats = [gloo_sockets.sent(conn) for conn in self._conns]
        if not stats or any(s is None for s in stats):
            return None
        a, b, c, d = zip(*(s for s in stats if s is not None), strict=True)
        return sum(a), sum(b), sum(c), sum(d)

    def network_stall(self, min_ms: int = STALL_CUT_MS) -> str | None:
        """Why this link's connection looks dead to the kernel, or None.

        Dead means no ACK came for ``min_ms`` while data was lost in transit or
        could not leave (:meth:`resilient.links.gloo_sockets.Progress.dead`). A slow or late
        peer shows none of that (its ACKs still come, or its window is shut), nor
        does a throttled link.
        """
        for p in self._progresses():
            why = p.dead(min_ms) if p is not None else None
            if why is not None:
                return why
        return None

    def _progresses(self) -> list[gloo_sockets.Progress | None]:
        """Each connection's TCP progress (None: its descriptor is gone)."""
        return [gloo_sockets.progress(conn) for conn in self._conns]

    def _states(self) -> list[int | None]:
        """Each connection's TCP state (None: its descriptor is gone)."""
        return [gloo_sockets.tcp_state(conn) for conn in self._conns]

    def check_closed(self) -> bool:
        """Mark the link broken if the kernel saw its peer close or reset the
        connection (no op needs to be pending on it); True if it did.

        Also notes in :attr:`socket_gone` that the connection's descriptor is gone:
        gloo closes a pair's socket itself once it read the peer's FIN or RST, and
        then the kernel has no state left to show (resilient.detect.lost_peer weighs it).
        """
        if self.broken:
            return False
        states = self._states()
        self.socket_gone = bool(states) and all(s is None for s in states)
        if not any(s in gloo_sockets.PEER_GONE_STATES for s in states):
            return False
        self._read_before_close()
        self._failed(f"{self}: connection closed by peer (seen by the kernel)", "marked broken")
        return True

    def _read_before_close(self) -> None:
        """Deliver what a peer the kernel saw close sent before it, where the
        transport can (socket links); gloo pairs read it themselves."""

    def _publish_finished(self) -> None:
        """Tell senders still waiting on this link that our receives here had finished."""
        while self.finished:
            store, key = self.finished.popleft()
            try:
                store.set(key, "done")
            except Exception:  # the sender then fails at its own deadline, typed
                logger.warning("rank %d: publishing %s failed", self.rank, key, exc_info=True)

    def isend(self, tensor: torch.Tensor | memoryview, tag: int, digest: int = 0) -> Any:
        """Post a send of a contiguous tensor (or a byte view of one); returns the
        gloo work to :meth:`wait` on.
        ``digest``: the call's, on socket links only (resilient.collectives.digest_check)."""
        self._injected_failure("send")
        if self.pg is None:
            raise self._failed(f"{self}: send on a link that is not built or is closed")
        if not self.takes_bytes:
            tensor = as_tensor(tensor)
        try:
            if digest:
                work = self.pg.send([tensor], self._peer_index, self.ledger.tag(tag), digest)
            else:
                work = self.pg.send([tensor], self._peer_index, self.ledger.tag(tag))
        except (RuntimeError, dist.DistError) as exc:
            raise self._failed(f"{self}: send failed: {exc}") from exc
        self.tx_ops += 1
        self.ledger.posted(work)
        return work

    def irecv(self, tensor: torch.Tensor | memoryview, tag: int, digest: int = 0) -> Any:
        """Post a receive into a contiguous tensor or byte view (``digest``: see :meth:`isend`;
        a message of another call fails its wait with DigestMismatch)."""
        self._injected_failure("recv")
        if self.pg is None:
            raise self._failed(f"{self}: recv on a link that is not built or is closed")
        if not self.takes_bytes:
            tensor = as_tensor(tensor)
        try:
            if digest:
                work = self.pg.recv([tensor], self._peer_index, self.ledger.tag(tag), digest)
            else:
                work = self.pg.recv([tensor], self._peer_index, self.ledger.tag(tag))
        except (RuntimeError, dist.DistError) as exc:
            raise self._failed(f"{self}: recv failed: {exc}") from exc
        self.rx_ops += 1
        self.ledger.posted(work)
        return work

    @property
    def open_ops(self) -> int:
        """Unfinished ops a thread is blocked on now (such a link is cut when its
        call is given up: the wait would close the pair at its deadline)."""
        return self.ledger.blocked()

    def wait(
        self, work: Any, nbytes: int, *, watch: bool = True, interruptible: bool = False
    ) -> None:
        """Wait for ``work`` within the deadline for ``nbytes``.

        ``watch=False`` keeps the wait out of stall reports (acknowledgements wait
        for the peer to finish, not for bytes); a dead connection is cut either way.
        ``interruptible`` (ops of at least ``gloo_wait.MIN_BYTES`` on a link with a
        backup rail) makes the wait end as soon as the link breaks, even when gloo's
        own wait would not (see :mod:`resilient.links.gloo_wait`).

        Raises:
            LinkError: the peer failed, the connection broke or the deadline passed
                (the link is then broken); or ``work`` belongs to a given-up call and
                has not finished (the link stays as it is: see resilient.links.ledger).
        """
        if getattr(work, "done", False) and fault_hook.hook() is None:
            # A socket op that already completed (most are by the time they are
            # waited for: a send the socket took, a receive the driver filled) has
            # nothing to watch or time; only its ledger entry is closed.
            self.ledger.end_wait(work, finished=True)
            return
        if not self.ledger.begin_wait(work):
            raise LinkError(f"{self}: an op of a given-up call is not waited for")
        finished = False
        try:
            self._wait(work, nbytes, watch=watch, interruptible=interruptible)
            finished = True
        finally:
            self.ledger.end_wait(work, finished=finished)

    def _wait(self, work: Any, nbytes: int, *, watch: bool, interruptible: bool) -> None:
        # Inlined deadline_s and one registration with the stall watch: this runs
        # for every op of every collective.
        expected_s = nbytes * self._per_byte_s
        timeout = self._floor_s + expected_s
        start = time.monotonic()
        stalls = stall.WATCH
        # Every wait is watched for a dead connection; only data waits are reported
        # as stalls (a late peer is not a stalled link).
        token = stalls.begin(self._key, self, expected_s, report=self.watch_stalls and watch)
        try:
            if (
                interruptible
                and not self.cut_wakes_waits
                and self.has_backup
                and self._conns
                and nbytes >= gloo_wait.MIN_BYTES
            ):
                self._wait_interruptible(work, nbytes, timeout)
            else:
                work.wait(timedelta(seconds=timeout))
        except (RuntimeError, dist.DistError) as exc:
            raise self._failed(
                f"{self}: op on {nbytes} B failed or exceeded {timeout:.1f} s: {exc}"
            ) from exc
        finally:
            stalls.end(token)
        h = fault_hook.hook()
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
