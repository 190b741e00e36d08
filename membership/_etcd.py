"""A bounded, retrying wrapper around the ``pyetcd`` (etcd-sdk-python) v3 client.

Everything the project sends to etcd goes through :class:`EtcdClient`, which

* bounds every RPC by ``request_timeout_s`` and every logical call (all its
  retries) by ``retry_budget_s`` (so a call returns or raises within about
  ``retry_budget_s + request_timeout_s``);
* retries transient errors (unavailable, deadline, no leader, endpoint locked out)
  with exponential backoff (tenacity), re-authenticating when a token expired;
* translates whatever gRPC/pyetcd raised into :mod:`resilient.errors` types with
  ``raise ... from exc``.

pyetcd locks a failed endpoint out for 300 s by default; endpoints are built here
with a short ``time_retry`` and failover on, so an etcd restart is picked up at once.
gRPC channels must be created after fork: build clients in the process that uses them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any, TypeVar
from urllib.parse import urlsplit

import grpc
import pyetcd
from pyetcd import exceptions as etcd_exc
from tenacity import (
    RetryCallState,
    Retrying,
    retry_if_exception,
    stop_after_delay,
    wait_exponential,
)

from resilient.config import EtcdConfig
from resilient.errors import EtcdUnavailable, MembershipError

__all__ = ["EtcdClient", "KeyValue", "is_transient"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

_TRANSIENT_CODES = {
    grpc.StatusCode.UNAVAILABLE,
    grpc.StatusCode.DEADLINE_EXCEEDED,
    grpc.StatusCode.INTERNAL,
    grpc.StatusCode.UNKNOWN,
}
_AUTH_CODES = {grpc.StatusCode.UNAUTHENTICATED}
# Server-side messages that mean "retry later", sent with non-transient codes.
_TRANSIENT_MESSAGES = ("no leader", "leader changed", "timed out", "too many requests")
_AUTH_MESSAGES = ("invalid auth token", "token")


class KeyValue:
    """One key as read from etcd: key (str), value (bytes), revisions and lease."""

    __slots__ = ("create_revision", "key", "lease", "mod_revision", "value")

    def __init__(self, key: str, value: bytes, mod_revision: int, create_revision: int, lease: int):
        self.key = key
        self.value = value
        self.mod_revision = mod_revision
        self.create_revision = create_revision
        self.lease = lease

    def __repr__(self) -> str:
        return f"KeyValue({self.key!r}, {self.value[:40]!r}, mod={self.mod_revision})"


def _grpc_code(exc: BaseException) -> grpc.StatusCode | None:
    code = getattr(exc, "code", None)
    if callable(code):
        try:
            result = code()
        except Exception:
            return None
        return result if isinstance(result, grpc.StatusCode) else None
    return None


def _details(exc: BaseException) -> str:
    details = getattr(exc, "details", None)
    if callable(details):
        try:
            return str(details() or "")
        except Exception:
            return ""
    return str(exc)


def is_auth_error(exc: BaseException) -> bool:
    code = _grpc_code(exc)
    if code in _AUTH_CODES:
        return True
    return code is not None and "invalid auth token" in _details(exc).lower()


def is_transient(exc: BaseException) -> bool:
    """True for errors worth retrying: etcd down, restarting, electing, or token expired."""
    if isinstance(
        exc,
        etcd_exc.ConnectionFailedError
        | etcd_exc.ConnectionTimeoutError
        | etcd_exc.NoServerAvailableError
        | etcd_exc.InternalServerError
        | etcd_exc.WatchTimedOut,
    ):
        return True
    if isinstance(exc, ValueError) and "failed node" in str(exc):
        return True
    if is_auth_error(exc):
        return True
    code = _grpc_code(exc)
    if code in _TRANSIENT_CODES:
        return True
    msg = _details(exc).lower()
    return code is not None and any(m in msg for m in _TRANSIENT_MESSAGES)


class EtcdClient:
    """Thread-safe etcd v3 access with bounded retries. See the module docstring.

    Raises (from every method):
        EtcdUnavailable: etcd did not answer within the retry budget.
        MembershipError: etcd refused the request (permission denied, bad request).
    """

    def __init__(self, config: EtcdConfig) -> None:
        self.config = config
        self._lock = threading.Lock()
        self._client: Any = None
        self._closed = False

    # -- connection ------------------------------------------------------------
    def _build(self) -> Any:
        cfg = self.config
        creds = None
        if cfg.secure:
            creds = pyetcd.MultiEndpointEtcd3Client.get_secure_creds(cfg.ca_cert, cfg.key, cfg.cert)
        endpoints = []
        for url in cfg.endpoints:
            parts = urlsplit(url)
            endpoints.append(
                pyetcd.Endpoint(
                    parts.hostname,
                    parts.port,
                    secure=cfg.secure,
                    creds=creds,
                    time_retry=0.2,
                    opts=[("grpc.enable_http_proxy", 0)],
                )
            )
        try:
            return pyetcd.MultiEndpointEtcd3Client(
                endpoints=endpoints,
                timeout=cfg.request_timeout_s,
                user=cfg.user,
                password=cfg.password,
                failover=True,
            )
        except BaseException:
            for ep in endpoints:
                ep.close()
            raise

    def raw(self) -> Any:
        """The underlying pyetcd client, connecting (and authenticating) if needed."""
        with self._lock:
            if self._closed:
                raise MembershipError("etcd client is closed")
            if self._client is None:
                self._client = self._build()
            return self._client

    def _reset(self) -> None:
        with self._lock:
            old, self._client = self._client, None
        if old is not None:
            try:
                old.close()
            except Exception:  # closing a broken channel must not mask the real error
                logger.debug("closing old etcd client failed", exc_info=True)

    def close(self) -> None:
        self._reset()
        with self._lock:
            self._closed = True

    # -- retry core ------------------------------------------------------------
    def call(
        self,
        what: str,
        fn: Callable[[Any], T],
        *,
        budget_s: float | None = None,
        passthrough: tuple[type[BaseException], ...] = (),
    ) -> T:
        """Run ``fn(raw_client)``, retrying transient failures within the budget.

        Exceptions of the ``passthrough`` types are re-raised untranslated.

        Raises:
            EtcdUnavailable: still failing when the budget ran out.
            MembershipError: a non-transient etcd error (the cause is chained).
        """
        budget = self.config.retry_budget_s if budget_s is None else budget_s

        def before_sleep(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
            if exc is not None and is_auth_error(exc):
                self._reset()  # simple-token expired: authenticate again
            logger.debug(
                "etcd %s: attempt %d failed (%r); retrying", what, state.attempt_number, exc
            )

        retrying = Retrying(
            retry=retry_if_exception(is_transient),
            stop=stop_after_delay(budget),
            wait=wait_exponential(multiplier=0.05, min=0.05, max=1.0),
            before_sleep=before_sleep,
            reraise=True,
        )
        try:
            return retrying(lambda: fn(self.raw()))
        except MembershipError:
            raise
        except Exception as exc:
            if isinstance(exc, passthrough):
                raise
            if is_transient(exc):
                raise EtcdUnavailable(
                    f"etcd {what}: no answer from {self.url} within {budget:.1f} s "
                    f"({type(exc).__name__}: {_details(exc)[:200]})"
                ) from exc
            raise MembershipError(
                f"etcd {what} at {self.url} failed: {type(exc).__name__}: {_details(exc)[:200]}"
            ) from exc

    @property
    def url(self) -> str:
        return ",".join(self.config.endpoints)

    # -- KV ----------------------------------------------------------------------
    @staticmethod
    def _kv(kv: Any) -> KeyValue:
        return KeyValue(
            kv.key.decode(), bytes(kv.value), kv.mod_revision, kv.create_revision, kv.lease
        )

    def get(self, key: str) -> KeyValue | None:
        resp = self.call(f"get {key}", lambda c: c.get_response(key))
        return self._kv(resp.kvs[0]) if resp.kvs else None

    def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """All keys under ``prefix`` (sorted by key) and the store revision they were read at."""
        resp = self.call(
            f"get prefix {prefix}",
            lambda c: c.get_prefix_response(prefix, sort_order="ascend", sort_target="key"),
        )
        return [self._kv(kv) for kv in resp.kvs], int(resp.header.revision)

    def count_prefix(self, prefix: str) -> int:
        resp = self.call(
            f"count {prefix}", lambda c: c.get_prefix_response(prefix, count_only=True)
        )
        return int(resp.count)

    def put(self, key: str, value: bytes | str, *, lease: int | None = None) -> None:
        self.call(f"put {key}", lambda c: c.put(key, value, lease=lease))

    def delete(self, key: str) -> bool:
        return bool(self.call(f"delete {key}", lambda c: c.delete(key)))

    def delete_prefix(self, prefix: str) -> int:
        resp = self.call(f"delete prefix {prefix}", lambda c: c.delete_prefix(prefix))
        return int(resp.deleted)

    def txn(
        self,
        what: str,
        compare: Callable[[Any], Sequence[Any]],
        success: Callable[[Any], Sequence[Any]],
        failure: Callable[[Any], Sequence[Any]] | None = None,
    ) -> tuple[bool, list[Any]]:
        """Run one transaction; the callables receive ``client.transactions`` to build ops."""

        def run(c: Any) -> tuple[bool, list[Any]]:
            t = c.transactions
            ok, responses = c.transaction(
                compare=list(compare(t)),
                success=list(success(t)),
                failure=list(failure(t)) if failure else [],
            )
            return bool(ok), list(responses)

        return self.call(what, run)

    # -- leases ------------------------------------------------------------------
    def grant_lease(self, ttl_s: int) -> int:
        lease = self.call(f"grant lease ttl={ttl_s}", lambda c: c.lease(ttl_s))
        return int(lease.id)

    def refresh_lease(self, lease_id: int, *, budget_s: float | None = None) -> int:
        """Send one keep-alive; returns the remaining TTL (0: the lease is gone)."""

        def run(c: Any) -> int:
            ttl = 0
            for resp in c.refresh_lease(lease_id):
                ttl = int(resp.TTL)
            return ttl

        return self.call(f"keep-alive lease {lease_id:x}", run, budget_s=budget_s)

    def revoke_lease(self, lease_id: int, *, budget_s: float | None = None) -> None:
        self.call(
            f"revoke lease {lease_id:x}", lambda c: c.revoke_lease(lease_id), budget_s=budget_s
        )

    # -- watches -----------------------------------------------------------------
    def add_watch_prefix(
        self, prefix: str, callback: Callable[[Any], None], *, start_revision: int | None
    ) -> int:
        """Register a raw pyetcd prefix watch; ``callback`` gets responses or exceptions.

        Raises ``pyetcd.exceptions.RevisionCompactedError`` untranslated: the caller
        (``membership.watch``) handles compaction by re-listing.
        """

        def run(c: Any) -> int:
            kwargs: dict[str, Any] = {}
            if start_revision is not None:
                kwargs["start_revision"] = start_revision
            return int(c.add_watch_prefix_callback(prefix, callback, **kwargs))

        return self.call(f"watch {prefix}", run, passthrough=(etcd_exc.RevisionCompactedError,))

    def cancel_watch(self, watch_id: int) -> None:
        client = self._client
        if client is None:
            return
        try:
            client.cancel_watch(watch_id)
        except Exception:  # the stream may already be dead; nothing to cancel then
            logger.debug("cancel watch %s failed", watch_id, exc_info=True)
