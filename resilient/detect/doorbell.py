"""Doorbells: wake a rank's health watcher when a peer published, without polling.

The health board (:mod:`resilient.detect.health_board`) must learn of a peer's report within
milliseconds, but polling a counter that fast is what it used to do: 200 store
round trips a second per rank. Through etcd each of those was a read plus a
compare-and-swap write (etcd's ``add``), so on 4 ranks of a 2-core machine the
pollers and etcd together used ~0.9 of the 2.25 CPUs a training job got. Polling
also grows with the job: hundreds of ranks would send etcd tens of thousands of
requests a second. A doorbell waits instead:

* :class:`WatchBell` (an :class:`~membership.store.EtcdStore`): an etcd watch on the
  board's prefix; any record published there rings it. Watches survive etcd
  restarts (:class:`~membership.watch.PrefixWatch`); the owner still re-reads at a
  slow safety interval in case a stream broke silently.
* :class:`QueueBell` (a ``TCPStore``, also under ``PrefixStore``): one queue per rank
  on the store server; a publisher pushes to every peer's queue, and the watcher
  blocks in ``queue_pop`` on its own clone of the store (its own connection, so it
  never holds up anyone else's store calls). Closing pushes to its own queue.
* :class:`PollBell` (any other store): the old fixed-interval poll.

Every bell only says "look again"; the board itself reads the records, so a ring
that is lost or spurious costs a late or an extra read, never a wrong state.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterable
from datetime import timedelta
from typing import Any, Final, Protocol, cast

from torch._C._distributed_c10d import PrefixStore, Store, TCPStore

__all__ = ["Bell", "PollBell", "QueueBell", "WatchBell", "open_bell", "watch_or_poll"]

logger = logging.getLogger(__name__)

# A blocked queue_pop that reaches the store timeout is retried; it only has to be
# long enough not to fill logs (torch warns on each timeout).
_POP_TIMEOUT: Final = timedelta(hours=6)


class Bell(Protocol):
    """Tells one rank's watcher that a peer may have published something new."""

    #: How long the watcher may sleep between looks even when nothing rang.
    safety_s: float | None

    def ring(self, peers: Iterable[int]) -> None:
        """Wake ``peers``' watchers (after this rank published)."""

    def wait(self, timeout_s: float | None) -> None:
        """Return once rung, closed, or after ``timeout_s`` (None: no limit)."""

    def close(self) -> None:
        """Wake this rank's watcher for good and release what the bell holds."""


class PollBell:
    """No notification at all: the watcher looks every ``interval_s``."""

    def __init__(self, interval_s: float) -> None:
        self.safety_s: float | None = interval_s
        self._closed = threading.Event()

    def ring(self, peers: Iterable[int]) -> None:
        del peers

    def wait(self, timeout_s: float | None) -> None:
        self._closed.wait(timeout_s)

    def close(self) -> None:
        self._closed.set()


class QueueBell:
    """A queue per rank on a TCPStore server; see the module docstring."""

    def __init__(self, store: Store, prefix: str, rank: int) -> None:
        self.safety_s: float | None = None  # a pushed ring is never lost
        self._store, self._prefix, self._rank = store, prefix, rank
        self._client: Any = cast(Any, store).clone()  # blocks in queue_pop: its own connection
        self._client.set_timeout(_POP_TIMEOUT)

    def _key(self, rank: int) -> str:
        return f"{self._prefix}/bell{rank}"

    def ring(self, peers: Iterable[int]) -> None:
        for peer in peers:
            self._store.queue_push(self._key(peer), b"1")

    def wait(self, timeout_s: float | None) -> None:
        """Block until a ring (``timeout_s`` is not honoured: see ``safety_s``).

        Raises:
            torch.distributed.DistStoreError: the store server is gone or the pop
                timed out (the caller looks and waits again).
        """
        del timeout_s
        key = self._key(self._rank)
        self._client.queue_pop(key, True)
        while self._client.queue_len(key) > 0:  # rings that came together: one look
            self._client.queue_pop(key, False)

    def close(self) -> None:
        try:
            self._store.queue_push(self._key(self._rank), b"close")
        except Exception:  # server gone: the blocked pop fails and ends by itself
            logger.debug("rank %d: waking the health watcher failed", self._rank, exc_info=True)


class WatchBell:
    """An etcd watch on the board's prefix; see the module docstring."""

    def __init__(self, store: Any, prefix: str, *, safety_s: float = 1.0) -> None:
        from membership.watch import PrefixWatch

        self.safety_s: float | None = safety_s
        self._rung = threading.Event()
        self._watch = PrefixWatch(
            store.client(), store.prefix + prefix, lambda _e: self._rung.set(),
            name=f"bell:{prefix}",
        )  # fmt: skip
        self._watch.start()

    def ring(self, peers: Iterable[int]) -> None:
        del peers  # the record's own put is what the peers' watches see

    def wait(self, timeout_s: float | None) -> None:
        self._rung.wait(timeout_s)
        self._rung.clear()

    def close(self) -> None:
        self._rung.set()
        self._watch.stop(timeout_s=2.0)


def _base(store: Store) -> tuple[Any, bool]:
    """The store under any PrefixStore layers, and whether there were any."""
    wrapped = isinstance(store, PrefixStore)
    return (cast(Any, store)._underlying_non_prefix_store if wrapped else store), wrapped


def _etcd(store: Any) -> bool:
    from membership.store import EtcdStore

    return isinstance(store, EtcdStore)


def open_bell(store: Store, prefix: str, rank: int, *, poll_s: float) -> Bell:
    """The best bell ``store`` allows for the board keys under ``prefix``.

    Never raises: a store that cannot carry a bell gets a :class:`PollBell`.
    """
    try:
        base, wrapped = _base(store)
        if _etcd(base):
            # PrefixStore does not tell its prefix: under one, the watch covers the
            # whole etcd store (other keys there change rarely: link rendezvous).
            return WatchBell(base, "" if wrapped else prefix + "/")
        if isinstance(base, TCPStore):
            return QueueBell(store, prefix, rank)
    except Exception:  # etcd unreachable right now, a store without clone: poll
        logger.warning(
            "rank %d: no store notification for %s; polling every %.3f s",
            rank, prefix, poll_s, exc_info=True,
        )  # fmt: skip
    return PollBell(poll_s)


def watch_or_poll(store: Store, prefix: str, *, poll_s: float, safety_s: float) -> Bell:
    """A bell for keys under ``prefix`` that nobody rings: an etcd watch (looking
    again at least every ``safety_s``), or a poll every ``poll_s`` on other stores.

    Never raises.
    """
    try:
        base, wrapped = _base(store)
        if _etcd(base):
            return WatchBell(base, "" if wrapped else prefix, safety_s=safety_s)
    except Exception:  # etcd unreachable right now: poll
        logger.warning("no etcd watch on %s; polling every %.3f s", prefix, poll_s, exc_info=True)
    return PollBell(poll_s)
