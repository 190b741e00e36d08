"""In-process fault hook: link faults injected through etcd, for chaos runs without root.

Without root the chaos testbed has no namespaces, veths or iptables, so network
faults are emulated inside each rank instead: the chaos CLI writes a record per
active fault under ``/resilient/<job>/chaos-faults/`` and every rank started with
``RESILIENT_FAULT_CONTROL=1`` polls that prefix (every 20 ms, in a thread) and
applies the records to its own links:

* ``fail``: ops on matching links raise :class:`~resilient.errors.LinkError` at
  once (a NIC down, a flap's down phase, a partition);
* ``throttle``: a matching op lasts at least ``bytes * 8 / rate`` seconds;
* ``drop``: with probability ``drop_p`` an op is delayed by 200 ms (TCP's minimum
  retransmission timeout: dropped packets make a TCP link slow, not broken).

A record names ``rank`` and ``rail``, and optionally ``peer``: without a peer it
applies to every link of that rank on that rail (both ends see it), with one only
to the link between the two. Without the env var nothing here runs; the data plane
checks one module global per op.
"""

from __future__ import annotations

import json
import logging
import random
import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final

from resilient.errors import MembershipError

if TYPE_CHECKING:
    from resilient.config import EtcdConfig

__all__ = ["FaultHook", "LinkFault", "hook", "install"]

logger = logging.getLogger(__name__)

_POLL_S: Final = 0.02
_RTO_S: Final = 0.2
_KINDS: Final = frozenset({"fail", "throttle", "drop"})


@dataclass(frozen=True, kw_only=True, slots=True)
class LinkFault:
    """One active fault on the links of ``rank`` on ``rail`` (to ``peer`` only, if set)."""

    kind: str
    rank: int
    rail: int
    peer: int | None = None
    rate_bps: float = 0.0
    drop_p: float = 0.0

    def affects(self, me: int, other: int, rail: int) -> bool:
        if rail != self.rail:
            return False
        if self.peer is None:
            return self.rank in (me, other)
        return {me, other} == {self.rank, self.peer}

    @classmethod
    def from_json(cls, raw: bytes | str) -> LinkFault:
        """Raises ValueError for a malformed record."""
        rec: Any = json.loads(raw)
        if not isinstance(rec, dict) or rec.get("kind") not in _KINDS:
            raise ValueError(f"not a link fault record: {rec!r}")
        peer = rec.get("peer")
        return cls(
            kind=str(rec["kind"]),
            rank=int(rec["rank"]),
            rail=int(rec["rail"]),
            peer=int(peer) if peer is not None else None,
            rate_bps=float(rec.get("rate_mbit", 0.0)) * 1e6,
            drop_p=float(rec.get("percent", 0.0)) / 100.0,
        )


class FaultHook:
    """The faults currently active for this process, refreshed from etcd."""

    def __init__(self) -> None:
        self.faults: tuple[LinkFault, ...] = ()
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None

    def failed(self, me: int, other: int, rail: int) -> bool:
        return any(f.kind == "fail" and f.affects(me, other, rail) for f in self.faults)

    def delay_s(self, me: int, other: int, rail: int, nbytes: int, elapsed_s: float) -> float:
        """How much longer an op of ``nbytes`` that took ``elapsed_s`` must last."""
        delay = 0.0
        for f in self.faults:
            if not f.affects(me, other, rail):
                continue
            if f.kind == "throttle" and f.rate_bps > 0:
                delay = max(delay, nbytes * 8 / f.rate_bps - elapsed_s)
            elif f.kind == "drop" and random.random() < f.drop_p:
                delay = max(delay, _RTO_S)
        return delay

    def start(self, etcd: EtcdConfig, job: str, token: str | None = None) -> None:
        """Poll the job's fault records in the background; with ``token`` each read
        checks the job token (membership.guarded), without one it checks nothing."""
        from membership.etcd_client import EtcdClient
        from membership.guarded import job_client
        from membership.keys import JobKeys

        client = job_client(EtcdClient(etcd), job, token)
        prefix = JobKeys(job).chaos_faults
        self._thread = threading.Thread(
            target=self._poll, args=(client, prefix), name="fault-hook", daemon=True
        )
        self._thread.start()

    def stop(self) -> None:
        self._halt.set()

    def _poll(self, client: Any, prefix: str) -> None:
        while not self._halt.wait(_POLL_S):
            try:
                kvs, _ = client.get_prefix(prefix)
            except MembershipError as exc:
                logger.debug("fault control poll failed: %s", exc)
                continue
            faults = []
            for kv in kvs:
                try:
                    faults.append(LinkFault.from_json(kv.value))
                except (ValueError, KeyError, TypeError) as exc:
                    logger.warning("ignoring fault record %s: %s", kv.key, exc)
            if tuple(faults) != self.faults:
                logger.warning("injected link faults now: %s", faults or "none")
            self.faults = tuple(faults)


_HOOK: FaultHook | None = None
_LOCK = threading.Lock()


def hook() -> FaultHook | None:
    """The process's fault hook, or None (the normal case: no chaos control)."""
    return _HOOK


def install(etcd: EtcdConfig, job: str, token: str | None = None) -> FaultHook:
    """Start polling the job's fault records (once per process; ``token``: see
    :meth:`FaultHook.start`)."""
    global _HOOK
    with _LOCK:
        if _HOOK is None:
            h = FaultHook()
            h.start(etcd, job, token)
            _HOOK = h
        return _HOOK
