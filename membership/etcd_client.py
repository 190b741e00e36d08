"""A bounded, retrying wrapper around the ``pyetcd`` (etcd-sdk-python) v3 client.

Everything the project sends to etcd goes through :class:`EtcdClient`, which

* bounds every RPC by ``request_timeout_s`` and every logical call (all its
  retries) by ``retry_budget_s`` (so a call returns or raises within about
  ``retry_budget_s + request_timeout_s``);
* retries transient errors (unavailable, deadline, no leader, endpoint locked out)
  with exponential backoff (tenacity), re-authenticating when a token expired;
* fails at once, without retrying, on errors a retry cannot fix: a wrong password,
  permission denied, no credentials on an auth-enabled server, and a TLS handshake
  rejected over a certificate (wrong CA, missing or untrusted client certificate);
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
# The token is no longer good but the credentials may be: authenticate again. A simple
# token dies after --auth-token-ttl (300 s) without use (keep-alives do not count)
# and on every etcd restart; a JWT token at its ttl. A JWT token also carries the
# auth revision it was issued at: after any user/role change etcd refuses it with
# "revision in header is old" (code UNKNOWN, so it would be retried with the same
# stale token until the budget ran out) or "revision of auth store is old"; etcd's
# own Go client re-authenticates on those too.
_AUTH_MESSAGES = ("invalid auth token", "revision in header is old", "auth store is old")
# TLS failures over a certificate or a host name. gRPC reports them as UNAVAILABLE
# (pyetcd then raises a detail-less ConnectionFailedError), UNKNOWN or UNAUTHENTICATED,
# like a down server or an expired token, but retrying cannot fix a wrong CA, a
# rejected client certificate or an endpoint name the server certificate lacks; and
# hiding a misconfiguration behind EtcdUnavailable (an "outage" callers ride out)
# would leave it unnoticed.
_TLS_MESSAGES = (
    "certificate_verify_failed",
    "alert_bad_certificate",
    "alert_unknown_ca",
    "alert_certificate_required",
    "alert_certificate_unknown",
    "alert_certificate_expired",
    "does not match ssl server name",
    "hostname verification check failed",
    "not in peer certificate",
)


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


def _rpc_error(exc: BaseException) -> BaseException:
    """The gRPC error behind ``exc``: pyetcd replaces UNAVAILABLE, DEADLINE_EXCEEDED and
    INTERNAL with its own detail-less exceptions, raised inside the handler, so the
    original (with the reason, e.g. a TLS handshake failure) is the implicit context."""
    ctx = exc.__context__
    if isinstance(exc, etcd_exc.Etcd3Exception) and ctx is not None and _grpc_code(ctx):
        return ctx
    return exc


def _details(exc: BaseException) -> str:
    exc = _rpc_error(exc)
    details = getattr(exc, "details", None)
    if callable(details):
        try:
            return str(details() or "")
        except Exception:
            return ""
    return str(exc)


def is_auth_error(exc: BaseException) -> bool:
    """True when etcd rejected the token (expired, stale): re-authenticating may help."""
    code = _grpc_code(exc)
    if code in _AUTH_CODES:
        return True
    msg = _details(exc).lower()
    return code is not None and any(m in msg for m in _AUTH_MESSAGES)


def is_tls_error(exc: BaseException) -> bool:
    """True when TLS failed over a certificate or host name (a configuration error)."""
    if _grpc_code(_rpc_error(exc)) is None:
        return False
    msg = _details(exc).lower()
    return any(m in msg for m in _TLS_MESSAGES)


def is_transient(exc: BaseException) -> bool:
    """True for errors worth retrying: etcd down, restarting, electing, or token expired."""
    if is_tls_error(exc):  # first: pyetcd dresses it as a ConnectionFailedError
        return False
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
    # Another thread re-authenticated and closed the client this call was using: new
    # calls see ValueError "Cannot invoke RPC on closed channel!" or "Cannot invoke
    # RPC: Channel closed!", calls in flight CANCELLED "Channel closed!".
    if isinstance(exc, ValueError) and "cannot invoke rpc" in str(exc).lower():
        return True
    if _grpc_code(exc) == grpc.StatusCode.CANCELLED and "channel closed" in _details(exc).lower():
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
        # pyetcd fails over only while the current endpoint is within time_retry of
        # its last failure; a retry that comes later (our backoff reaches 1 s) goes
        # back to the same dead member, again and again. With several members, keep a
        # failed one out for longer than the longest backoff; alone, retry it soon.
        time_retry = 0.2 if len(cfg.endpoints) == 1 else 2.5
        for url in cfg.endpoints:
            parts = urlsplit(url)
            endpoints.append(
                pyetcd.Endpoint(
                    parts.hostname,
                    parts.port,
                    secure=cfg.secure,
                    creds=creds,
                    time_retry=time_retry,
                    opts=[("grpc.enable_http_proxy", 0)],
                )
            )
        try:
            # With user/password this authenticates at once: a wrong password raises
            # a raw grpc.RpcError (INVALID_ARGUMENT) here, translated by call().
            client = pyetcd.MultiEndpointEtcd3Client(
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
        # pyetcd sends the token twice: as metadata and as per-call credentials. gRPC
        # refuses call credentials on a plaintext channel ("Established channel does
        # not have a sufficient security level"), which broke user/password without
        # TLS; the metadata alone carries the token on both kinds of channel.
        client.call_credentials = None
        return client

    def raw(self) -> Any:
        """The underlying pyetcd client, connecting (and authenticating) if needed."""
        with self._lock:
            if self._closed:
                raise MembershipError("etcd client is closed")
            if self._client is None:
                self._client = self._build()
            return self._client

    def _reset(self, failed: Any = None) -> None:
        """Drop (and close) the current client; with ``failed``, only if it still is that one.

        The check matters when a token expires under several threads at once: each
        sees the auth error, and without it a late thread would close the client
        that an earlier one had just authenticated, failing that thread's calls.
        """
        with self._lock:
            if failed is not None and self._client is not failed:
                return
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

        Exceptions of the ``passthrough`` types are re-raised untranslated. A rejected
        token (expired, or issued before a user/role change) makes the next attempt
        build a new client, which authenticates again.

        Raises:
            EtcdUnavailable: still failing when the budget ran out.
            MembershipError: a non-transient etcd error (the cause is chained): wrong
                password, permission denied, no credentials where auth is on, or a TLS
                handshake rejected over a certificate. These are not retried.
        """
        budget = self.config.retry_budget_s if budget_s is None else budget_s

        def attempt() -> T:
            client = self.raw()
            try:
                return fn(client)
            except Exception as exc:
                if is_auth_error(exc):
                    self._reset(client)
                raise

        def before_sleep(state: RetryCallState) -> None:
            exc = state.outcome.exception() if state.outcome else None
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
            return retrying(attempt)
        except MembershipError:
            raise
        except Exception as exc:
            if isinstance(exc, passthrough):
                raise
            raise self._translate(what, exc, budget) from exc

    def _translate(self, what: str, exc: Exception, budget: float) -> MembershipError:
        """The project error for what etcd/gRPC raised once retries were given up."""
        if is_tls_error(exc):
            return MembershipError(
                f"etcd {what} at {self.url}: TLS failed; check ca_cert, cert and key "
                f"against the server's certificate, its CA and its host names "
                f"({_details(exc)[-300:]})"
            )
        if is_transient(exc):
            return EtcdUnavailable(
                f"etcd {what}: no answer from {self.url} within {budget:.1f} s "
                f"({type(exc).__name__}: {_details(exc)[:200]})"
            )
        return MembershipError(
            f"etcd {what} at {self.url} failed: {type(exc).__name__}: {_details(exc)[:200]}"
        )

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
        *,
        budget_s: float | None = None,
    ) -> tuple[bool, list[Any]]:
        """Run one transaction; the callables receive ``client.transactions`` to build ops.

        ``budget_s`` bounds the retries as in :meth:`call` (default: the config's).
        """

        def run(c: Any) -> tuple[bool, list[Any]]:
            t = c.transactions
            ok, responses = c.transaction(
                compare=list(compare(t)),
                success=list(success(t)),
                failure=list(failure(t)) if failure else [],
            )
            return bool(ok), list(responses)

        return self.call(what, run, budget_s=budget_s)

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
