"""Job membership in etcd: leases, watches and health records.

One :class:`Membership` per rank process. ``join`` checks the job token, registers
the rank under a lease and keeps the lease alive from a background thread; a rank
whose process dies (or hangs past the TTL) disappears from the member list and
every watcher sees the delete. The job's epoch is not kept here: it is the one
counter recovery moves in the job's store (:mod:`membership.epoch`).

Every call is bounded in time (see :class:`membership.etcd_client.EtcdClient`).
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from membership.etcd_client import EtcdClient
from membership.guarded import GuardedClient, JobGuard
from membership.health import HealthPublisher
from membership.kept_lease import KeptLease
from membership.keys import JobKeys, token_hash
from membership.watch import PrefixWatch, WatchEvent
from resilient.config import EtcdConfig, MembershipConfig
from resilient.errors import (
    ConfigError,
    JobTokenMismatch,
    LeaseLost,
    MembershipError,
)

__all__ = ["MemberInfo", "Membership"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class MemberInfo:
    """What a rank registers about itself."""

    rank: int
    incarnation: int
    rails: tuple[str, ...]
    host: str
    pid: int
    joined_at: float

    def to_json(self) -> str:
        return json.dumps(
            {
                "rank": self.rank,
                "incarnation": self.incarnation,
                "rails": list(self.rails),
                "host": self.host,
                "pid": self.pid,
                "joined_at": self.joined_at,
            },
            sort_keys=True,
        )

    @classmethod
    def from_json(cls, raw: bytes | str) -> MemberInfo:
        d = json.loads(raw)
        return cls(
            rank=int(d["rank"]),
            incarnation=int(d["incarnation"]),
            rails=tuple(d.get("rails", ())),
            host=str(d.get("host", "")),
            pid=int(d.get("pid", 0)),
            joined_at=float(d.get("joined_at", 0.0)),
        )


class Membership:
    """A rank's handle on its job in etcd.

    Raises (from every method):
        EtcdUnavailable: etcd did not answer within the client's bound.
        MembershipError: not joined, wrong token, or etcd refused the request.
        JobTokenMismatch: the job's token is not the one this member joined with
            (checked by every read and write of the job's keys, in the same etcd
            transaction; see :mod:`membership.guarded`).
    """

    def __init__(
        self,
        etcd: EtcdConfig | EtcdClient,
        config: MembershipConfig,
    ) -> None:
        self.config = config
        self.keys = JobKeys(config.job)
        self._owns_client = isinstance(etcd, EtcdConfig)
        self.client = EtcdClient(etcd) if isinstance(etcd, EtcdConfig) else etcd
        self._lock = threading.Lock()
        self._hash: str | None = None
        # After join, every read and write of the job's keys checks the token (in
        # the same etcd transaction): membership.guarded.
        self._kv: EtcdClient = self.client
        self._lease: KeptLease | None = None
        self._info: MemberInfo | None = None
        self._lease_lost_cbs: list[Callable[[], None]] = []
        self.lease_lost = threading.Event()
        self._health: HealthPublisher | None = None
        self._watches: list[PrefixWatch] = []

    # -- lifecycle -----------------------------------------------------------------
    @property
    def job(self) -> str:
        return self.config.job

    @property
    def joined(self) -> bool:
        return self._info is not None and not self.lease_lost.is_set()

    @property
    def info(self) -> MemberInfo | None:
        return self._info

    @property
    def lease_id(self) -> int | None:
        return self._lease.id if self._lease is not None else None

    def join(
        self,
        rank: int,
        incarnation: int,
        rail_addresses: Sequence[str],
        token: str,
    ) -> MemberInfo:
        """Register ``rank`` in the job under a lease and start the keep-alive.

        Raises:
            ConfigError: empty token or negative rank/incarnation.
            JobTokenMismatch: the job was created with another token; nothing of the
                job was read or written, and this object stays unjoined.
            MembershipError: the rank is held by a newer or equal incarnation.
        """
        if not token:
            raise ConfigError(f"job {self.job!r}: a non-empty token is required (RESILIENT_TOKEN)")
        if rank < 0 or incarnation < 0:
            raise ConfigError(f"rank={rank}, incarnation={incarnation}: must be >= 0")
        if self._info is not None:
            raise MembershipError(f"job {self.job!r}: rank {self._info.rank} already joined")
        self._hash = self._check_token(token)
        self._kv = GuardedClient(self.client, JobGuard(self.job, self._hash))
        self._check_incarnation(rank, incarnation)
        info = MemberInfo(
            rank=rank,
            incarnation=incarnation,
            rails=tuple(rail_addresses),
            host=socket.gethostname(),
            pid=os.getpid(),
            joined_at=time.time(),
        )
        self.lease_lost.clear()
        kept = KeptLease(
            self.client, self.config.lease_ttl_s, lambda: f"job {self.job}: rank {rank}",
            what="member lease", on_gone=self._lease_expired, margin_s=0.0,
        )  # fmt: skip
        lease = kept.grant()
        try:
            self._guarded("join", [lambda t: t.put(self.keys.member(rank), info.to_json(), lease)])
        except BaseException:
            kept.close()
            raise
        self._lease, self._info = kept, info
        logger.info(
            "job %s: rank %d incarnation %d joined (lease %x, ttl %.0f s)",
            self.job,
            rank,
            incarnation,
            lease,
            self.config.lease_ttl_s,
        )
        return info

    def leave(self) -> None:
        """Deregister (revoke the lease, which deletes this member's keys) and stop threads.

        Safe to call twice and after a lost lease; etcd errors are logged, not raised.
        """
        for w in self._watches:
            w.stop()
        self._watches.clear()
        if self._health is not None:
            self._health.stop()
            self._health = None
        kept, self._lease = self._lease, None
        if kept is not None:
            kept.stop()
        if kept is not None and not self.lease_lost.is_set():
            try:
                if self._info is not None:
                    self._kv.put(self.keys.departed(self._info.rank), str(self._info.incarnation))
            except MembershipError as exc:
                logger.warning("job %s: recording the departure failed: %s", self.job, exc)
            kept.close()  # revokes it
        if self._info is not None:
            logger.info("job %s: rank %d left", self.job, self._info.rank)
        self._info = None

    def close(self) -> None:
        self.leave()
        if self._owns_client:
            self.client.close()

    def __enter__(self) -> Membership:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def on_lease_lost(self, callback: Callable[[], None]) -> None:
        """Call ``callback`` (from the keep-alive thread) if this member's lease is lost."""
        self._lease_lost_cbs.append(callback)

    # -- token and guarded writes ----------------------------------------------------
    def _check_token(self, token: str) -> str:
        digest = token_hash(self.job, token)
        created, _ = self.client.txn(
            f"job {self.job} create token",
            compare=lambda t: [t.version(self.keys.token) == 0],
            success=lambda t: [t.put(self.keys.token, digest)],
        )
        if created:
            logger.info("job %s: created (token hash recorded)", self.job)
            return digest
        # Compare inside etcd so that a wrong-token caller never reads the stored hash.
        matches, _ = self.client.txn(
            f"job {self.job} check token",
            compare=lambda t: [t.value(self.keys.token) == digest],
            success=lambda t: [],
        )
        if not matches:
            raise JobTokenMismatch(self.job)
        return digest

    def _guarded(
        self,
        what: str,
        ops: Sequence[Callable[[Any], Any]],
        *,
        extra: Sequence[Callable[[Any], Any]] = (),
        allow_fail: bool = False,
    ) -> bool:
        """Run ``ops`` only if the job's token hash is still ours (atomically, in one txn)."""
        digest = self._hash
        if digest is None:
            raise MembershipError(f"job {self.job!r}: not joined")
        ok, _ = self.client.txn(
            f"job {self.job} {what}",
            compare=lambda t: [t.value(self.keys.token) == digest, *(c(t) for c in extra)],
            success=lambda t: [op(t) for op in ops],
        )
        if not ok and not allow_fail:
            raise MembershipError(
                f"job {self.job!r}: {what} refused (token changed or job deleted)"
            )
        return ok

    def _require_joined(self) -> MemberInfo:
        if self._info is None:
            raise MembershipError(f"job {self.job!r}: not a member; call join() first")
        if self.lease_lost.is_set():
            raise LeaseLost(f"job {self.job!r}: rank {self._info.rank} lost its lease")
        return self._info

    def _check_incarnation(self, rank: int, incarnation: int) -> None:
        current = self._kv.get(self.keys.member(rank))
        if current is None:
            return
        held = MemberInfo.from_json(current.value)
        if held.incarnation >= incarnation:
            raise MembershipError(
                f"job {self.job!r}: rank {rank} is held by incarnation {held.incarnation} "
                f"(pid {held.pid} on {held.host}); this process is incarnation {incarnation}"
            )
        logger.info(
            "job %s: rank %d incarnation %d replaces incarnation %d",
            self.job,
            rank,
            incarnation,
            held.incarnation,
        )

    # -- the lease's fence ------------------------------------------------------------
    def watch_lease(self, fence: Callable[[str], None]) -> None:
        """Call ``fence(why)`` once, from a watchdog thread, when this member's lease
        may have lapsed in etcd (:meth:`membership.kept_lease.KeptLease.watch`): the TTL
        after the last keep-alive etcd acknowledged was sent, with no margin (a
        rank's exit takes no time, and its replacement needs seconds to start and
        be admitted after the key is gone; a margin would fence busy ranks whose
        lease never lapsed), or at once when etcd says it is gone.

        Raises:
            MembershipError: not joined.
        """
        if self._lease is None:
            raise MembershipError(f"job {self.job!r}: not a member; call join() first")
        self._lease.watch(fence)

    def _lease_expired(self) -> None:
        rank = self._info.rank if self._info else -1
        logger.error("job %s: rank %d's lease expired; the job lists it as gone", self.job, rank)
        self.lease_lost.set()
        for cb in list(self._lease_lost_cbs):
            try:
                cb()
            except Exception:
                logger.exception("job %s: lease-lost callback failed", self.job)

    # -- members -------------------------------------------------------------------------
    def members(self) -> dict[int, MemberInfo]:
        """The live members, by rank."""
        self._require_joined()
        kvs, _ = self._kv.get_prefix(self.keys.members)
        out: dict[int, MemberInfo] = {}
        for kv in kvs:
            info = MemberInfo.from_json(kv.value)
            out[info.rank] = info
        return out

    def watch_members(
        self, callback: Callable[[str, int, MemberInfo | None], None], *, initial: bool = True
    ) -> PrefixWatch:
        """Call ``callback(kind, rank, info)`` on every join ("put") and departure ("delete")."""
        self._require_joined()

        def on_event(ev: WatchEvent) -> None:
            rank = int(ev.key.rsplit("/", 1)[1])
            info = MemberInfo.from_json(ev.value) if ev.value is not None else None
            callback(ev.kind, rank, info)

        return self._add_watch(self.keys.members, on_event, initial=initial, name="members")

    def watch(
        self, sub_prefix: str, callback: Callable[[WatchEvent], None], *, initial: bool = False
    ) -> PrefixWatch:
        """Watch any key prefix of this job (e.g. ``"health/rank/"``)."""
        self._require_joined()
        return self._add_watch(
            self.keys.prefix + sub_prefix, callback, initial=initial, name=sub_prefix
        )

    def _add_watch(
        self, prefix: str, cb: Callable[[WatchEvent], None], *, initial: bool, name: str
    ) -> PrefixWatch:
        w = PrefixWatch(self._kv, prefix, cb, initial=initial, name=f"{self.job}:{name}")
        w.start()
        self._watches.append(w)
        return w

    # -- launcher records ------------------------------------------------------------------
    def replacement(self, rank: int) -> dict[str, Any] | None:
        """What the supervisor announced for lost ``rank`` (``how``: warm, cold or
        none; ``incarnation``; ``eta_s``), or None before it said anything."""
        kv = self._kv.get(self.keys.replacement(rank))
        return json.loads(kv.value) if kv is not None else None

    def replacements(self) -> dict[int, dict[str, Any]]:
        """Every announcement the supervisors made (see :meth:`replacement`), by rank,
        in one read; malformed records are skipped."""
        kvs, _ = self._kv.get_prefix(self.keys.replacements)
        out: dict[int, dict[str, Any]] = {}
        for kv in kvs:
            try:
                out[int(kv.key.rsplit("/", 1)[1])] = json.loads(kv.value)
            except (ValueError, TypeError):
                continue
        return out

    def supervisor(self) -> dict[str, Any] | None:
        """What the supervisor publishes about replacing ranks (``restarts_left``,
        ``warm_spares``), or None without one (torchrun, Slurm)."""
        kv = self._kv.get(self.keys.supervisor)
        return json.loads(kv.value) if kv is not None else None

    # -- health ---------------------------------------------------------------------------
    def _publisher(self) -> HealthPublisher:
        info = self._require_joined()
        with self._lock:
            if self._health is None:
                self._health = HealthPublisher(
                    self._kv,
                    lease=lambda: self.lease_id,
                    stamp=lambda: {"rank": info.rank, "incarnation": info.incarnation},
                    min_interval_s=self.config.health_min_interval_s,
                )
                self._health.start()
            return self._health

    def publish_rank_health(self, record: Mapping[str, Any]) -> None:
        """Queue this rank's health record (written <= 1/s in the background)."""
        info = self._require_joined()
        self._publisher().publish(self.keys.rank_health + f"{info.rank:06d}", record)

    def publish_link_health(self, peer: int, rail: int, record: Mapping[str, Any]) -> None:
        """Queue the health record of the link (this rank, ``peer``, ``rail``)."""
        info = self._require_joined()
        self._publisher().publish(self.keys.link(info.rank, peer, rail), record)

    def rank_health(self) -> dict[int, dict[str, Any]]:
        """The latest health record of every live rank that published one."""
        self._require_joined()
        kvs, _ = self._kv.get_prefix(self.keys.rank_health)
        return {int(kv.key.rsplit("/", 1)[1]): json.loads(kv.value) for kv in kvs}

    def link_health(self) -> dict[tuple[int, int, int], dict[str, Any]]:
        """The latest record of every link, keyed by (reporting rank, peer rank, rail)."""
        self._require_joined()
        kvs, _ = self._kv.get_prefix(self.keys.link_health)
        out: dict[tuple[int, int, int], dict[str, Any]] = {}
        for kv in kvs:
            a, b, rail = (int(x) for x in kv.key.rsplit("/", 1)[1].split("-"))
            out[(a, b, rail)] = json.loads(kv.value)
        return out
