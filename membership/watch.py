"""Prefix watches that survive etcd restarts and compaction.

A raw etcd watch is a gRPC stream: it dies when etcd restarts, and it cannot resume
from a revision that was compacted away. :class:`PrefixWatch` keeps a mirror of the
watched prefix and, when its stream dies, re-creates it from the last revision it
delivered (so no event is lost or repeated). If that revision was compacted, it
re-lists the prefix and delivers the difference against its mirror as synthetic
events, then resumes. Callbacks therefore always see a consistent sequence of
changes, whatever happened to etcd in between.
"""

from __future__ import annotations

import logging
import queue
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Literal

from pyetcd import events as etcd_events
from pyetcd import exceptions as etcd_exc

from membership.etcd_client import EtcdClient
from resilient.errors import MembershipError
from resilient.failures import FailureSite

__all__ = ["PrefixWatch", "WatchEvent"]

logger = logging.getLogger(__name__)

_STOP = object()


@dataclass(frozen=True, kw_only=True, slots=True)
class WatchEvent:
    """One change under a watched prefix.

    ``key`` is the full etcd key; ``value`` is None for deletes. ``synthetic`` is
    True when the event was derived from a re-list after compaction (or from the
    initial listing), not from the watch stream itself.
    """

    kind: Literal["put", "delete"]
    key: str
    value: bytes | None
    revision: int
    synthetic: bool = False


class PrefixWatch:
    """Deliver every change under ``prefix`` to ``callback``, across etcd restarts.

    ``initial=True`` first delivers the current keys as synthetic puts. The callback
    runs on the watch's own thread; exceptions in it are logged, never propagated.
    ``start()`` raises :class:`~resilient.errors.EtcdUnavailable` if etcd cannot be
    reached within the client's retry budget; later outages are retried forever
    (with backoff) until :meth:`stop`.
    """

    def __init__(
        self,
        client: EtcdClient,
        prefix: str,
        callback: Callable[[WatchEvent], None],
        *,
        initial: bool = False,
        name: str = "",
    ) -> None:
        self._client = client
        self._prefix = prefix
        self._callback = callback
        self._initial = initial
        self._name = name or prefix
        self._queue: queue.Queue[Any] = queue.Queue()
        self._mirror: dict[str, bytes] = {}
        self._revision = 0  # last revision delivered (or listed)
        self._watch_id: int | None = None
        self._stopped = threading.Event()
        self._thread: threading.Thread | None = None
        self.reconnects = 0
        self.relists = 0
        # An outage is retried forever and a failing callback on every event: these
        # count them, warn at a bounded rate and emit an event when they persist.
        self.subscribe_failures = FailureSite(
            f"watch {self._name}: resubscribe", action="retrying with backoff up to 1 s",
            log=logger,
        )  # fmt: skip
        self.callback_failures = FailureSite(
            f"watch {self._name}: callback", action="delivering the next events", log=logger
        )

    @property
    def revision(self) -> int:
        """The last etcd revision whose changes were delivered."""
        return self._revision

    def snapshot(self) -> dict[str, bytes]:
        """A copy of the mirror: the keys under the prefix as last delivered."""
        return dict(self._mirror)

    def start(self) -> PrefixWatch:
        kvs, revision = self._client.get_prefix(self._prefix)
        self._mirror = {kv.key: kv.value for kv in kvs}
        self._revision = revision
        if self._initial:
            for kv in kvs:
                self._deliver(
                    WatchEvent(
                        kind="put",
                        key=kv.key,
                        value=kv.value,
                        revision=kv.mod_revision,
                        synthetic=True,
                    )
                )
        self._subscribe_once()
        self._thread = threading.Thread(target=self._run, name=f"watch:{self._name}", daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout_s: float = 5.0) -> None:
        self._stopped.set()
        self._queue.put(_STOP)
        if self._watch_id is not None:
            self._client.cancel_watch(self._watch_id)
            self._watch_id = None
        if self._thread is not None and self._thread is not threading.current_thread():
            self._thread.join(timeout_s)

    def __enter__(self) -> PrefixWatch:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # -- internals ---------------------------------------------------------------
    def _subscribe_once(self) -> None:
        """Open a stream from the revision after the last one delivered.

        Raises RevisionCompactedError (handled by the caller) or EtcdUnavailable.
        """
        q = self._queue
        self._watch_id = self._client.add_watch_prefix(
            self._prefix, q.put, start_revision=self._revision + 1
        )

    def _resubscribe(self, *, compacted: bool) -> None:
        """Re-open the stream; re-list first when the resume revision is compacted."""
        delay = 0.05
        while not self._stopped.is_set():
            try:
                if compacted:
                    self._relist()
                    compacted = False
                self._subscribe_once()
                self.reconnects += 1
                logger.info("watch %s: resumed at revision %d", self._name, self._revision + 1)
                self.subscribe_failures.succeeded()
                return
            except etcd_exc.RevisionCompactedError:
                compacted = True  # compacted again between re-list and subscribe
                continue
            except MembershipError as exc:  # etcd unavailable
                if self._stopped.is_set():
                    return  # stop() raced the retry: no news
                self.subscribe_failures.failed(exc)
            self._stopped.wait(delay)
            delay = min(delay * 2, 1.0)

    def _relist(self) -> None:
        kvs, revision = self._client.get_prefix(self._prefix)
        fresh = {kv.key: kv for kv in kvs}
        self.relists += 1
        logger.warning(
            "watch %s: revision %d was compacted; re-listed at %d",
            self._name,
            self._revision + 1,
            revision,
        )
        for key in sorted(set(self._mirror) - set(fresh)):
            self._apply(
                WatchEvent(kind="delete", key=key, value=None, revision=revision, synthetic=True)
            )
        for key, kv in fresh.items():
            if self._mirror.get(key) != kv.value:
                self._apply(
                    WatchEvent(
                        kind="put",
                        key=key,
                        value=kv.value,
                        revision=kv.mod_revision,
                        synthetic=True,
                    )
                )
        self._revision = revision

    def _run(self) -> None:
        while not self._stopped.is_set():
            try:
                item = self._queue.get(timeout=0.5)
            except queue.Empty:
                continue
            if item is _STOP:
                return
            if isinstance(item, BaseException):
                if self._stopped.is_set():
                    return
                # etcd reports a compacted start revision after creating the watch,
                # as an error on the stream; anything else is a dead stream.
                compacted = isinstance(item, etcd_exc.RevisionCompactedError)
                logger.info("watch %s: stream ended (%r); reconnecting", self._name, item)
                self._watch_id = None
                self._resubscribe(compacted=compacted)
                continue
            for raw in getattr(item, "events", ()):
                self._apply(self._convert(raw))

    def _convert(self, raw: Any) -> WatchEvent:
        key = raw.key.decode()
        if isinstance(raw, etcd_events.DeleteEvent):
            return WatchEvent(kind="delete", key=key, value=None, revision=int(raw.mod_revision))
        return WatchEvent(
            kind="put", key=key, value=bytes(raw.value), revision=int(raw.mod_revision)
        )

    def _apply(self, event: WatchEvent) -> None:
        if not event.synthetic and event.revision < self._revision:
            return  # older than what was delivered before a reconnect
        if event.kind == "delete":
            self._mirror.pop(event.key, None)
        else:
            assert event.value is not None
            self._mirror[event.key] = event.value
        if not event.synthetic:
            self._revision = event.revision
        self._deliver(event)

    def _deliver(self, event: WatchEvent) -> None:
        try:
            self._callback(event)
        except Exception as exc:
            self.callback_failures.failed(exc, about=f"{event.kind} {event.key}")
            return
        self.callback_failures.succeeded()
