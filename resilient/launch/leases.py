"""Which ranks' member leases expired while the launcher still runs them.

Every rank of a job with etcd holds its member key under a lease that its
keep-alive thread refreshes (:mod:`membership.members`). A process that is
stopped (SIGSTOP, a frozen host, a swap storm) stops refreshing, and etcd deletes
the key once the lease's TTL passes. A rank that leaves on purpose writes a
departure record first. So a member key that vanished without a departure record,
while the launcher still sees the process alive, is a hung rank: the launcher
kills it, and the kill path (its peers' links close, a replacement starts) takes
over. A hang is thus seen within the lease TTL plus one poll.
"""

from __future__ import annotations

import json
import logging

from membership.etcd_client import EtcdClient
from membership.guarded import job_client
from membership.keys import JobKeys
from membership.members import MemberInfo
from resilient.config import etcd_config
from resilient.errors import MembershipError

__all__ = ["LeaseWatch"]

logger = logging.getLogger(__name__)


class LeaseWatch:
    """Polled by the launcher; :meth:`expired` lists (rank, incarnation) whose
    member key vanished without a departure since the previous call.

    With ``token`` every read and write checks the job token in the same etcd
    transaction (:mod:`membership.guarded`; a wrong one reads and writes nothing,
    logged like an outage); without one nothing is checked."""

    def __init__(self, etcd_url: str, job: str, token: str | None = None) -> None:
        config = etcd_config(etcd_url, request_timeout_s=1.0, retry_budget_s=1.0)
        self._client = job_client(EtcdClient(config), job, token)
        self._keys = JobKeys(job)
        self._held: dict[int, int] = {}

    def expired(self) -> list[tuple[int, int]]:
        """Members gone since the last call without leaving (never raises: an etcd
        outage only delays the answer)."""
        try:
            rows, _ = self._client.get_prefix(self._keys.members)
            now = {}
            for kv in rows:
                info = MemberInfo.from_json(kv.value)
                now[info.rank] = info.incarnation
            gone = [(r, inc) for r, inc in self._held.items() if r not in now]
            out = []
            for rank, inc in gone:
                left = self._client.get(self._keys.departed(rank))
                if left is None or left.value.decode() != str(inc):
                    out.append((rank, inc))
        except (MembershipError, ValueError, KeyError) as exc:
            logger.debug("lease poll failed: %s", exc)
            return []
        self._held = now
        return out

    def departed(self, rank: int, incarnation: int) -> bool:
        """Whether ``rank``'s ``incarnation`` left the job on purpose (its process
        group shut down and wrote a departure record). False when etcd does not
        answer: the caller then treats the rank like any other failed one."""
        try:
            record = self._client.get(self._keys.departed(rank))
        except MembershipError as exc:
            logger.debug("reading rank %d's departure failed: %s", rank, exc)
            return False
        return record is not None and record.value.decode() == str(incarnation)

    def announce(self, rank: int, incarnation: int, how: str, eta_s: float | None) -> None:
        """Tell the survivors what replaces lost ``rank`` (``how``: warm, cold or
        none) and when it may report (never raises: they then wait as configured)."""
        record = json.dumps({"incarnation": incarnation, "how": how, "eta_s": eta_s})
        try:
            self._client.put(self._keys.replacement(rank), record)
        except MembershipError as exc:
            logger.warning("announcing rank %d's replacement failed: %s", rank, exc)

    def publish_budget(
        self, restarts_left: int, warm_spares: bool, ready: list[int] | None = None
    ) -> None:
        """Tell the ranks what would replace one that leaves now (never raises):
        ``ready``, the ranks whose warm spare stands ready."""
        record = json.dumps(
            {"restarts_left": restarts_left, "warm_spares": warm_spares, "ready": ready or []}
        )
        try:
            self._client.put(self._keys.supervisor, record)
        except MembershipError as exc:
            logger.warning("publishing the restart budget failed: %s", exc)

    def close(self) -> None:
        self._client.close()
