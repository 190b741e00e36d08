"""An etcd-backed ``torch.distributed.Store``: rendezvous without a TCPStore on rank 0.

``ProcessGroupGloo(PrefixStore("pg0", EtcdStore(cfg, "/resilient/<job>/store/")), ...)``
rendezvouses through etcd. Every key lives under the store's prefix, so two stores
with different prefixes never see each other, and :meth:`EtcdStore.delete_prefix`
removes one rendezvous' keys at once.

What torch calls (measured on torch 2.13, gloo): the C++ side reaches a Python store
through a pybind trampoline that looks methods up by *name*: ``set``, ``get``,
``wait(keys, timeout)`` (gloo's rendezvous passes its own connect timeout),
``compare_set``, ``add``, ``check``, ``getNumKeys``, ``deleteKey``, ``clone``,
``append``, ``multi_get``, ``multi_set`` and ``has_extended_api``. Gloo's
rendezvous itself only uses ``set``, ``wait(keys, timeout)`` and ``get``. The
``timeout`` property and ``set_timeout`` are C++ (non-virtual): that value is the
default deadline of ``get``/``wait`` here. A zero timeout means "no deadline", as
in torch (``kNoTimeout``).

A Python exception raised inside a store method reaches the Python caller of the
C++ code (``ProcessGroupGloo(...)``, ``PrefixStore.get``) unchanged, so timeouts
raise :class:`EtcdStoreTimeout`, which is both a ``torch.distributed.DistStoreError``
(what torch's own stores raise) and a :class:`resilient.errors.StoreTimeout`.

Blocking calls poll etcd (2 ms backoff doubling to 50 ms): polling survives an etcd
restart with no watch to re-create, and a two-rank rendezvous sees its keys within
a few milliseconds. etcd being unreachable during a poll is retried until the
deadline; every other call raises :class:`~resilient.errors.EtcdUnavailable` once
the client's retry budget is spent.

With a :class:`~membership.guarded.JobGuard` (the job token's hash) every call,
read or write, is one etcd transaction that first compares the job's token key
(:mod:`membership.guarded`): a store with the wrong token raises
:class:`~resilient.errors.JobTokenMismatch` and reads or changes nothing. Without
one (tools and tests that never had a token) the store checks nothing.
"""

from __future__ import annotations

import logging
import os
import random
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from datetime import timedelta
from typing import Any, TypeVar, cast

import torch.distributed as dist
from torch._C._distributed_c10d import Store  # torch.distributed re-exports it untyped

from membership.etcd_client import EtcdClient, KeyValue
from membership.guarded import GuardedClient, JobGuard, first_row
from resilient.config import EtcdConfig
from resilient.errors import ConfigError, EtcdUnavailable, MembershipError, StoreTimeout

__all__ = ["DEFAULT_TIMEOUT", "EtcdStore", "EtcdStoreTimeout"]

logger = logging.getLogger(__name__)

T = TypeVar("T")

DEFAULT_TIMEOUT = timedelta(seconds=300)
_POLL_MIN_S = 0.002
_POLL_MAX_S = 0.05
_TXN_CHUNK = 64  # etcd refuses transactions with more than 128 operations by default
_INT_RE = re.compile(rb"^\s*([+-]?\d+)")

# torch's C++ side holds a Python store by its C++ part only: once the last Python
# reference goes, the methods defined here vanish and C++ calls fail with "Not
# implemented" (``PrefixStore("pg", EtcdStore(...))`` inline, or a ``clone()``).
# Every open store is therefore kept alive here until ``close()``.
_LIVE: dict[int, EtcdStore] = {}
_LIVE_LOCK = threading.Lock()

Value = str | bytes


class EtcdStoreTimeout(StoreTimeout, dist.DistStoreError):
    """``get``/``wait`` did not see its keys in time (a torch ``DistStoreError`` too)."""

    def __init__(self, message: str, *, missing: Sequence[str], timeout: timedelta) -> None:
        super().__init__(message)
        self.missing = tuple(missing)
        self.timeout = timeout


def _to_bytes(value: Value) -> bytes:
    return value.encode() if isinstance(value, str) else bytes(value)


def _parse_int(key: str, raw: bytes) -> int:
    """Leading integer of ``raw``, like C++ ``std::stoll`` (what torch's stores use)."""
    match = _INT_RE.match(raw)
    if match is None:
        raise ValueError(f"store key {key!r} holds {raw[:40]!r}, which is not an integer")
    return int(match.group(1))


def _no_ops(t: Any) -> list[Any]:
    return []


def _chunks(items: Sequence[T]) -> Iterator[Sequence[T]]:
    for start in range(0, len(items), _TXN_CHUNK):
        yield items[start : start + _TXN_CHUNK]


def _restore(
    config: EtcdConfig, prefix: str, timeout: timedelta, guard: JobGuard | None = None
) -> EtcdStore:
    return EtcdStore(config, prefix, timeout=timeout, guard=guard)


class EtcdStore(Store):
    """A ``torch.distributed.Store`` whose keys live in etcd under ``prefix``.

    Args:
        client_or_config: an :class:`EtcdClient` to share (the caller closes it), or
            an :class:`EtcdConfig`: the store then builds its own client on first
            use (in the process that uses it: safe to create before fork/spawn;
            the store pickles as its config) and closes it in :meth:`close`.
        prefix: etcd key prefix, e.g. ``/resilient/<job>/store/`` ("/" is appended
            when missing, so ``/a/s`` never sees the keys of ``/a/s2``).
        timeout: default deadline of ``get``/``wait``/``multi_get`` (``set_timeout``
            changes it; zero means no deadline, as in torch).
        guard: the job token's hash: every call then checks it in the same etcd
            transaction (default: a :class:`GuardedClient`'s guard, else none).

    Call :meth:`close` (or use ``with``) when done: an open store keeps itself alive
    so that ``PrefixStore("pg", EtcdStore(...))`` works without a Python reference.

    Raises (every method that talks to etcd):
        EtcdUnavailable: etcd did not answer within the client's retry budget
            (non-blocking calls; blocking ones retry until their deadline).
        MembershipError: etcd refused the request.
        JobTokenMismatch: (with a guard) the job belongs to another token.
    """

    def __init__(
        self,
        client_or_config: EtcdClient | EtcdConfig,
        prefix: str,
        *,
        timeout: timedelta = DEFAULT_TIMEOUT,
        guard: JobGuard | None = None,
    ) -> None:
        super().__init__()
        if not prefix:
            raise ConfigError("EtcdStore prefix must not be empty")
        self._prefix = prefix if prefix.endswith("/") else prefix + "/"
        self._lock = threading.Lock()
        if isinstance(client_or_config, GuardedClient):
            guard = guard or client_or_config.guard
            client_or_config = client_or_config.base
        self._guard = guard
        self._view: GuardedClient | None = None  # the guarded view of ``_client``
        if isinstance(client_or_config, EtcdClient):
            self._config = client_or_config.config
            self._client: EtcdClient | None = client_or_config
            self._owns_client = False
        else:
            self._config = client_or_config
            self._client = None
            self._owns_client = True
        self._pid = os.getpid()
        self._closed = False
        self._clones: list[EtcdStore] = []
        self.set_timeout(timeout)
        with _LIVE_LOCK:
            _LIVE[id(self)] = self

    # -- plumbing ------------------------------------------------------------------
    @property
    def prefix(self) -> str:
        return self._prefix

    @property
    def config(self) -> EtcdConfig:
        return self._config

    def __repr__(self) -> str:
        return f"EtcdStore({self._prefix!r}, etcd={','.join(self._config.endpoints)})"

    def __reduce__(self) -> tuple[Callable[..., EtcdStore], tuple[Any, ...]]:
        return (_restore, (self._config, self._prefix, self._default_timeout(), self._guard))

    @property
    def guard(self) -> JobGuard | None:
        return self._guard

    def _etcd(self) -> EtcdClient:
        """The client (guarded when the store has a guard); an owned one is (re)built
        lazily in the process that uses it."""
        with self._lock:
            if self._closed:
                raise MembershipError(f"{self!r} is closed")
            pid = os.getpid()
            if self._owns_client and (self._client is None or self._pid != pid):
                # A gRPC channel does not survive fork: never reuse the parent's.
                self._client = EtcdClient(self._config)
                self._pid = pid
            assert self._client is not None
            if self._guard is None:
                return self._client
            if self._view is None or self._view.base is not self._client:
                self._view = GuardedClient(self._client, self._guard)
            return self._view

    def client(self) -> EtcdClient:
        """The etcd client under this store (for watches on its keys, see
        :mod:`resilient.detect.doorbell`): with a guard, a :class:`GuardedClient`.
        Raises MembershipError once the store is closed."""
        return self._etcd()

    def _key(self, key: str) -> str:
        return self._prefix + key

    def _default_timeout(self) -> timedelta:
        # ``timeout`` is the C++ property (set_timeout); torch's stubs do not list it.
        return cast(timedelta, getattr(self, "timeout"))  # noqa: B009

    def _txn(
        self, what: str, compare: Any, success: Any, failure: Any = None, budget: Any = None
    ) -> Any:
        return self._etcd().txn(what, compare, success, failure, budget_s=budget)

    # -- simple calls ----------------------------------------------------------------
    def set(self, key: str, value: Value) -> None:
        """Write ``value`` under ``key`` (overwrites). Retried within the client budget."""
        self._etcd().put(self._key(key), _to_bytes(value))

    def check(self, keys: list[str]) -> bool:
        """True when every key exists (one transaction per 64 keys); never blocks."""
        return not self._missing(keys)

    def delete_key(self, key: str) -> bool:
        """Delete ``key``; True if it existed."""
        return self._etcd().delete(self._key(key))

    def deleteKey(self, key: str) -> bool:  # the name torch's C++ side calls
        return self.delete_key(key)

    def num_keys(self) -> int:
        """Number of keys under this store's prefix."""
        return self._etcd().count_prefix(self._prefix)

    def getNumKeys(self) -> int:  # the name torch's C++ side calls
        return self.num_keys()

    def list_keys(self) -> list[str]:
        """The keys of this store (prefix removed), sorted."""
        kvs, _ = self._etcd().get_prefix(self._prefix)
        return [kv.key[len(self._prefix) :] for kv in kvs]

    def multi_set(self, keys: list[str], values: Sequence[Value]) -> None:
        """Write several keys, atomically per chunk of 64 keys."""
        if len(keys) != len(values):
            raise ValueError(f"multi_set: {len(keys)} keys but {len(values)} values")
        pairs = list(zip(keys, values, strict=True))
        for chunk in _chunks(pairs):
            self._txn(
                f"multi_set {self._prefix}",
                _no_ops,
                lambda t, c=chunk: [t.put(self._key(k), _to_bytes(v)) for k, v in c],
            )

    def has_extended_api(self) -> bool:
        """True: append, multi_get and multi_set are implemented natively."""
        return True

    def clone(self) -> EtcdStore:
        """Another store on the same prefix, sharing this one's etcd client.

        The clone stays open (see ``_LIVE``) until it or this store is closed.
        """
        other = EtcdStore(self._etcd(), self._prefix, timeout=self._default_timeout())
        with self._lock:
            self._clones.append(other)
        return other

    # -- read-modify-write -------------------------------------------------------------
    def _cas_loop(self, what: str, key: str, update: Callable[[bytes | None], bytes]) -> bytes:
        """Apply ``update(current)`` with a compare-and-swap on mod_revision; returns the new value.

        A lost race re-reads and retries (somebody else made progress); each round trip
        is retried by the client on transient errors. Caveat: a commit whose reply
        was lost (etcd failing over mid-call) is not detectable and may apply twice.
        """
        full = self._key(key)
        kv: KeyValue | None = self._etcd().get(full)
        while True:
            new = update(None if kv is None else kv.value)
            guard = 0 if kv is None else kv.mod_revision
            ok, responses = self._txn(
                f"{what} {full}",
                lambda t, g=guard: [t.mod(full) == g],
                lambda t, n=new: [t.put(full, n)],
                lambda t: [t.get(full)],
            )
            if ok:
                return new
            kv = first_row(responses)
            time.sleep(random.uniform(0, _POLL_MIN_S))  # spread contending writers

    def add(self, key: str, value: int) -> int:
        """Atomically add ``value`` to the integer in ``key`` (missing: 0); returns the sum.

        Raises:
            ValueError: the key holds something that is not an integer.
        """

        def update(current: bytes | None) -> bytes:
            base = 0 if current is None else _parse_int(key, current)
            return str(base + int(value)).encode()

        return int(self._cas_loop("add", key, update))

    def append(self, key: str, value: Value) -> None:
        """Atomically append ``value`` to ``key`` (a missing key starts empty)."""
        extra = _to_bytes(value)
        self._cas_loop("append", key, lambda cur: (cur or b"") + extra)

    def compare_set(
        self,
        key: str,
        expected_value: Value,
        desired_value: Value,
        *,
        also: Mapping[str, Value] | None = None,
    ) -> bytes:
        """Set ``key`` to ``desired`` if it holds ``expected``; returns the value after the call.

        torch's semantics: a missing key is set when ``expected`` is empty and left
        missing otherwise (``expected`` is returned then); an existing key holding
        something else is left alone and its value returned. ``also`` (key -> value)
        is written in the same etcd transaction as the swap, only when the swap
        happens (:mod:`membership.epoch`: the epoch and its history record).
        """
        full = self._key(key)
        expected, desired = _to_bytes(expected_value), _to_bytes(desired_value)
        extra = [(self._key(k), _to_bytes(v)) for k, v in (also or {}).items()]

        def puts(t: Any) -> list[Any]:
            return [t.put(full, desired), *(t.put(k, v) for k, v in extra)]

        while True:
            if expected == b"":
                ok, responses = self._txn(
                    f"compare_set {full}",
                    lambda t: [t.version(full) == 0],
                    puts,
                    lambda t: [t.get(full)],
                )
                if ok:
                    return desired
                row = first_row(responses)
                if row is None:
                    continue  # deleted in between: try again
                if row.value != b"":
                    return bytes(row.value)
            ok, responses = self._txn(
                f"compare_set {full}",
                lambda t: [t.value(full) == expected],
                puts,
                lambda t: [t.get(full)],
            )
            if ok:
                return desired
            row = first_row(responses)
            if row is not None:
                return bytes(row.value)
            if expected != b"":
                return expected

    # -- blocking calls ------------------------------------------------------------------
    def get(self, key: str) -> bytes:
        """The value of ``key``, waiting for it up to the store timeout.

        Raises:
            EtcdStoreTimeout: the key did not appear in time (etcd outages included).
        """
        full = self._key(key)

        def probe(budget: float | None) -> tuple[bytes | None, list[str]]:
            _, responses = self._txn(f"get {full}", _no_ops, lambda t: [t.get(full)], budget=budget)
            row = first_row(responses)
            return (row.value, []) if row is not None else (None, [key])

        return self._poll("get", [key], None, probe)

    def wait(self, keys: list[str], timeout: timedelta | None = None) -> None:
        """Block until every key exists, up to ``timeout`` (default: the store timeout).

        Raises:
            EtcdStoreTimeout: some keys are still missing at the deadline; the error
                names them and the timeout.
        """

        def probe(budget: float | None) -> tuple[bool | None, list[str]]:
            missing = self._missing(keys, budget)
            return (None if missing else True), missing

        self._poll("wait", keys, timeout, probe)

    def multi_get(self, keys: list[str]) -> list[bytes]:
        """The values of ``keys`` in order, waiting for all of them up to the store timeout."""

        def probe(budget: float | None) -> tuple[list[bytes] | None, list[str]]:
            values = self._read_many(keys, budget)
            missing = [k for k, v in zip(keys, values, strict=True) if v is None]
            return (None if missing else [v or b"" for v in values]), missing

        return self._poll("multi_get", keys, None, probe)

    def _read_many(self, keys: Sequence[str], budget: float | None = None) -> list[bytes | None]:
        """Current values (None: missing), one transaction per chunk of 64 keys."""
        out: list[bytes | None] = []
        for chunk in _chunks(list(keys)):
            _, responses = self._txn(
                f"read {self._prefix}",
                _no_ops,
                lambda t, ks=chunk: [t.get(self._key(k)) for k in ks],
                budget=budget,
            )
            out.extend(bytes(rows[0][0]) if rows else None for rows in responses)
        return out

    def _missing(self, keys: Sequence[str], budget: float | None = None) -> list[str]:
        values = self._read_many(keys, budget)
        return [k for k, v in zip(keys, values, strict=True) if v is None]

    def _poll(
        self,
        what: str,
        keys: Sequence[str],
        timeout: timedelta | None,
        probe: Callable[[float | None], tuple[T | None, list[str]]],
    ) -> T:
        """Call ``probe`` with backoff until it returns a result or the deadline passes.

        ``probe(budget)`` returns (result or None, missing keys); ``budget`` bounds its
        etcd retries so an outage cannot hold the call far past the deadline (one RPC,
        ``request_timeout_s``, at most). EtcdUnavailable is retried until the deadline.
        """
        limit = self._default_timeout() if timeout is None else timeout
        limit_s = limit.total_seconds()
        deadline = time.monotonic() + limit_s if limit_s > 0 else None  # 0: no deadline
        delay = _POLL_MIN_S
        missing = list(keys)
        last_error: EtcdUnavailable | None = None
        while True:
            budget = self._config.retry_budget_s
            if deadline is not None:
                budget = max(0.0, min(budget, deadline - time.monotonic()))
            try:
                result, missing = probe(budget)
                last_error = None
            except EtcdUnavailable as exc:
                if last_error is None:
                    logger.warning("%r %s: etcd unreachable, retrying: %s", self, what, exc)
                last_error = exc
            else:
                if result is not None:
                    return result
            now = time.monotonic()
            if deadline is not None and now >= deadline:
                raise self._timeout_error(what, keys, missing, limit, last_error)
            pause = delay if deadline is None else min(delay, deadline - now)
            time.sleep(pause)
            delay = min(delay * 2, _POLL_MAX_S)

    def _timeout_error(
        self,
        what: str,
        keys: Sequence[str],
        missing: Sequence[str],
        limit: timedelta,
        cause: EtcdUnavailable | None,
    ) -> EtcdStoreTimeout:
        note = f" (etcd unreachable: {cause})" if cause is not None else ""
        err = EtcdStoreTimeout(
            f"{self!r} {what}: keys {list(missing)} of {list(keys)} not set within "
            f"{limit.total_seconds():.3f} s{note}",
            missing=missing,
            timeout=limit,
        )
        err.__cause__ = cause
        return err

    # -- lifecycle ---------------------------------------------------------------------
    def delete_prefix(self) -> int:
        """Delete every key of this store (one rendezvous); returns how many were removed."""
        return self._etcd().delete_prefix(self._prefix)

    def close(self) -> None:
        """Close the etcd client if this store built it, and the clones; later calls raise.

        Until it is closed a store keeps itself alive (torch's C++ side does not, see
        ``_LIVE``); afterwards C++ holders must not use it. Idempotent.
        """
        with self._lock:
            client, self._client = self._client, None
            clones, self._clones = self._clones, []
            self._closed = True
        with _LIVE_LOCK:
            _LIVE.pop(id(self), None)
        for other in clones:
            other.close()
        if client is not None and self._owns_client and self._pid == os.getpid():
            client.close()

    def __enter__(self) -> EtcdStore:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()
