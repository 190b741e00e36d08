"""The job token on every read and write of a job's keys in etcd.

etcd knows a job's token only by its hash, under ``/resilient/<job>/token``
(:func:`membership.keys.token_hash`). :class:`JobGuard` is that hash and key.
:class:`GuardedClient` is a view of an :class:`~membership.etcd_client.EtcdClient`
whose every KV call (get, prefix range, count, put, delete, transaction) is *one*
etcd transaction that first compares ``value(token key) == hash``:

* an unconditional call is the transaction's success branch;
* a caller's own transaction (a compare-and-swap) is nested in the success branch,
  so the caller still learns whether *its* compare held, and the token check adds
  no round trip.

The failure branch is empty: a client with the wrong token learns nothing of the
job, not even the stored hash. When the token key is missing (a new job: the
links' store may rendezvous before any rank joined) the guard records its own
hash there, as :meth:`membership.members.Membership.join` does (first comes,
creates), and tries once more; a key holding another hash raises
:class:`~resilient.errors.JobTokenMismatch` naming the job and the call, at once.

Watches check the token once, when their stream starts (events then flow without
a check per event). Leases go through unguarded: they name no key of the job.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

from pyetcd.client import KVMetadata
from pyetcd.utils import prefix_range_end

from membership.etcd_client import EtcdClient, KeyValue
from membership.keys import JobKeys, token_hash
from resilient.errors import ConfigError, JobTokenMismatch

__all__ = ["GuardedClient", "JobGuard", "first_row", "job_client"]

T = TypeVar("T")

Ops = Callable[[Any], Sequence[Any]]


def _none(t: Any) -> list[Any]:
    return []


@dataclass(frozen=True, slots=True)
class JobGuard:
    """Job ``job``'s token hash (``digest``), and the key etcd keeps it under.

    Raises:
        ConfigError: the job name is not a valid one.
    """

    job: str
    digest: str = field(repr=False)
    key: str = field(init=False, repr=False)

    def __post_init__(self) -> None:
        object.__setattr__(self, "key", JobKeys(self.job).token)

    def __reduce__(self) -> tuple[type[JobGuard], tuple[str, str]]:
        return (JobGuard, (self.job, self.digest))

    @classmethod
    def for_token(cls, job: str, token: str) -> JobGuard:
        """The guard of ``job`` for ``token`` (hashed here; the token is not kept).

        Raises:
            ConfigError: empty token or invalid job name.
        """
        if not token:
            raise ConfigError(f"job {job!r}: a non-empty token is required (RESILIENT_TOKEN)")
        return cls(job, token_hash(job, token))

    def compare(self, t: Any) -> Any:
        """The compare every guarded transaction starts with (``t``: pyetcd's ops)."""
        return t.value(self.key) == self.digest


def _key_value(value: bytes, meta: Any) -> KeyValue:
    return KeyValue(
        meta.key.decode(), bytes(value), meta.mod_revision, meta.create_revision, meta.lease_id
    )


def first_row(responses: Sequence[Any]) -> KeyValue | None:
    """The key read by a transaction's first ``get`` (None when it is missing)."""
    rows = responses[0] if responses else []
    return _key_value(*rows[0]) if rows else None


def _unnest(resp: Any) -> tuple[bool, list[Any]]:
    """A nested ``TxnResponse`` in the shape pyetcd gives a top-level one: range
    reads as lists of (value, metadata), every other response as it came."""
    out: list[Any] = []
    for r in resp.responses:
        if r.WhichOneof("response") == "response_range":
            out.append([(kv.value, KVMetadata(kv, resp.header)) for kv in r.response_range.kvs])
        else:
            out.append(r)
    return bool(resp.succeeded), out


class GuardedClient(EtcdClient):
    """An :class:`EtcdClient` whose KV calls are refused unless the job token matches.

    A view: it shares ``base``'s connection; :meth:`close` closes ``base`` only if
    ``owns_base`` (else its owner closes it). Everything that is not KV (leases,
    watch streams) goes to ``base`` unchanged, under ``base``'s retries.

    Raises (every KV call, besides EtcdClient's errors):
        JobTokenMismatch: the job's token key holds another token's hash; nothing
            was read or written.
    """

    def __init__(self, base: EtcdClient, guard: JobGuard, *, owns_base: bool = False) -> None:
        super().__init__(base.config)
        self.base = base
        self.guard = guard
        self._owns_base = owns_base

    def __repr__(self) -> str:
        return f"GuardedClient({self.guard.job!r}, etcd={self.url})"

    def raw(self) -> Any:
        return self.base.raw()

    def call(
        self,
        what: str,
        fn: Callable[[Any], T],
        *,
        budget_s: float | None = None,
        passthrough: tuple[type[BaseException], ...] = (),
    ) -> T:
        return self.base.call(what, fn, budget_s=budget_s, passthrough=passthrough)

    def close(self) -> None:
        """Close ``base`` if this view owns it; otherwise nothing to close."""
        if self._owns_base:
            self.base.close()

    def cancel_watch(self, watch_id: int) -> None:
        self.base.cancel_watch(watch_id)

    # -- the guarded transaction ---------------------------------------------------
    def txn(
        self,
        what: str,
        compare: Ops,
        success: Ops,
        failure: Ops | None = None,
        *,
        budget_s: float | None = None,
    ) -> tuple[bool, list[Any]]:
        """Run the transaction (compare, success, failure) if the token matches, in
        one etcd request; returns whether *its* compare held and its responses.

        Raises:
            JobTokenMismatch: the job belongs to another token; nothing ran.
        """

        def run(c: Any) -> tuple[bool, list[Any]] | None:
            t = c.transactions
            inner = list(compare(t))
            ops = list(success(t))
            if inner:
                ops = [t.txn(inner, ops, list(failure(t)) if failure else [])]
            ok, responses = c.transaction(compare=[self.guard.compare(t)], success=ops, failure=[])
            if not ok:
                return None
            return _unnest(responses[0].response_txn) if inner else (True, list(responses))

        result = self.base.call(what, run, budget_s=budget_s)
        if result is None:
            # The job may have no token yet (then this records it), or another
            # client of the same job may just have recorded it: look once more.
            self._claim(what, budget_s)
            result = self.base.call(what, run, budget_s=budget_s)
        if result is None:
            raise JobTokenMismatch(self.guard.job, what)
        return result

    def _claim(self, what: str, budget_s: float | None) -> None:
        """Record the hash if the job has no token key yet (else change nothing)."""
        key, digest = self.guard.key, self.guard.digest
        self.base.txn(
            f"job {self.guard.job} create token ({what})",
            compare=lambda t: [t.version(key) == 0],
            success=lambda t: [t.put(key, digest)],
            budget_s=budget_s,
        )

    def verify(self, what: str = "check token") -> None:
        """Check the token (one transaction that reads and writes nothing).

        Raises:
            JobTokenMismatch: the job belongs to another token.
        """
        self.txn(what, _none, _none)

    # -- KV ----------------------------------------------------------------------
    def get(self, key: str) -> KeyValue | None:
        return first_row(self.txn(f"get {key}", _none, lambda t: [t.get(key)])[1])

    def get_prefix(self, prefix: str) -> tuple[list[KeyValue], int]:
        """All keys under ``prefix`` (sorted by key) and the revision they were read at."""
        end = prefix_range_end(prefix.encode())
        _, (rows, token) = self.txn(
            f"get prefix {prefix}", _none, lambda t: [t.get(prefix, end), t.get(self.guard.key)]
        )
        # The token key exists (the compare held): its row carries the read's header.
        revision = int(token[0][1].response_header.revision)
        return [_key_value(v, m) for v, m in rows], revision

    def count_prefix(self, prefix: str) -> int:
        return len(self.get_prefix(prefix)[0])

    def put(self, key: str, value: bytes | str, *, lease: int | None = None) -> None:
        self.txn(f"put {key}", _none, lambda t: [t.put(key, value, lease=lease)])

    def delete(self, key: str) -> bool:
        _, responses = self.txn(f"delete {key}", _none, lambda t: [t.delete(key)])
        return int(responses[0].response_delete_range.deleted) > 0

    def delete_prefix(self, prefix: str) -> int:
        end = prefix_range_end(prefix.encode())
        _, responses = self.txn(f"delete prefix {prefix}", _none, lambda t: [t.delete(prefix, end)])
        return int(responses[0].response_delete_range.deleted)

    def add_watch_prefix(
        self, prefix: str, callback: Callable[[Any], None], *, start_revision: int | None
    ) -> int:
        """Check the token, then start the watch on ``base`` (see the module docstring)."""
        self.verify(f"watch {prefix}")
        return self.base.add_watch_prefix(prefix, callback, start_revision=start_revision)


def job_client(client: EtcdClient, job: str, token: str | None) -> EtcdClient:
    """The client to use for ``job``'s keys: a :class:`GuardedClient` over ``client``
    when the token is known, else ``client`` itself, which checks nothing (callers
    that never had a token: torchrun without ``RESILIENT_TOKEN``, tools). Closing
    the result closes ``client``.

    Raises:
        ConfigError: invalid job name.
    """
    if not token:
        return client
    return GuardedClient(client, JobGuard.for_token(job, token), owns_base=True)
