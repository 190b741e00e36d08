"""Node agents in etcd: one ``resilient run`` per machine finds the others.

Each agent of a job with ``--nnodes N`` registers a :class:`NodeInfo` under
``/resilient/<job>/nodes/<node rank>`` (:meth:`membership.keys.JobKeys.node`), held
by a lease of its own that a keep-alive thread refreshes, and waits until N agents
that agree with it are there. Every read and write checks the job token in the
same etcd transaction (:mod:`membership.guarded`).

Bad input is refused with the node and the mismatch named, and leaves the others
untouched:

* a node rank already held by another agent: :class:`ConfigError`, and the
  newcomer's key is never written;
* an agent whose ``nnodes``, ``nproc_per_node`` or rail count differs from an agent
  registered before it (the earlier ``create_revision`` wins): :class:`ConfigError`
  for the later one, which removes its key; agents already waiting skip it;
* another token: :class:`JobTokenMismatch`, nothing read or written.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from typing import Final

from membership.etcd_client import EtcdClient, KeyValue
from membership.guarded import first_row, job_client
from membership.keys import JobKeys
from resilient.config import EtcdConfig
from resilient.errors import ConfigError, MembershipError

__all__ = ["NodeInfo", "NodeRendezvous", "this_host"]

logger = logging.getLogger(__name__)

_POLL_S: Final = 0.2
# What must agree between the agents of one job, with the flag that sets it.
_MUST_AGREE: Final = (
    ("nnodes", "--nnodes"),
    ("nproc_per_node", "--nproc-per-node"),
    ("rails", "rail count (--rails)"),
)


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeInfo:
    """What a node agent registers: its place in the job and where torch's init
    store is (``store``, ``host:port``, set by node 0 only)."""

    node_rank: int
    nnodes: int
    nproc_per_node: int
    rails: int
    host: str = ""
    pid: int = 0
    store: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: bytes | str) -> NodeInfo:
        """Raises: ValueError, KeyError, TypeError: not a node record."""
        d = json.loads(raw)
        return cls(
            node_rank=int(d["node_rank"]),
            nnodes=int(d["nnodes"]),
            nproc_per_node=int(d["nproc_per_node"]),
            rails=int(d["rails"]),
            host=str(d.get("host", "")),
            pid=int(d.get("pid", 0)),
            store=str(d.get("store", "")),
        )

    def where(self) -> str:
        return f"node {self.node_rank} (agent pid {self.pid} on {self.host or '?'})"

    def mismatch(self, other: NodeInfo) -> str | None:
        """How ``other`` disagrees with this node, or None when they agree."""
        diffs = [
            f"{flag} {getattr(other, name)} there, {getattr(self, name)} here"
            for name, flag in _MUST_AGREE
            if getattr(other, name) != getattr(self, name)
        ]
        return "; ".join(diffs) or None


class NodeRendezvous:
    """One agent's registration in its job; see the module docstring.

    Raises (from every method, besides what each names):
        EtcdUnavailable: etcd did not answer within the client's bound.
        JobTokenMismatch: the job was created with another token.
    """

    def __init__(
        self, etcd: EtcdConfig, job: str, token: str, me: NodeInfo, *, lease_ttl_s: float
    ) -> None:
        if not token:
            raise ConfigError(f"job {job!r}: node agents need a shared token (RESILIENT_TOKEN)")
        if not 0 <= me.node_rank < me.nnodes:
            raise ConfigError(f"node rank {me.node_rank}: must be in [0, nnodes={me.nnodes})")
        if not lease_ttl_s >= 2.0:
            raise ConfigError(f"lease_ttl_s={lease_ttl_s}: must be >= 2 s")
        self.job = job
        self.me = me
        self._keys = JobKeys(job)
        self._ttl_s = lease_ttl_s
        self._client: EtcdClient = job_client(EtcdClient(etcd), job, token)
        self._lease: int | None = None
        self._revision = 0
        self._stop = threading.Event()
        self._keepalive: threading.Thread | None = None

    def join(
        self, timeout_s: float, stopping: Callable[[], bool] | None = None
    ) -> dict[int, NodeInfo]:
        """Register, then wait until all ``nnodes`` agents are there; returns them
        by node rank. On any error this agent's key is removed again.

        Raises:
            ConfigError: the node rank is held by another agent, or this agent
                disagrees with an earlier one (the message names both).
            MembershipError: not all agents came within ``timeout_s`` (the message
                names the missing node ranks), or ``stopping()`` said so first.
        """
        try:
            self.register()
            return self.wait(timeout_s, stopping)
        except BaseException:
            self.close()
            raise

    def register(self) -> None:
        """Write this agent's key under a new lease and start its keep-alive.

        Raises:
            ConfigError: the node rank is held, or an earlier agent disagrees.
        """
        me, key = self.me, self._keys.node(self.me.node_rank)
        lease = self._client.grant_lease(math.ceil(self._ttl_s))
        self._lease = lease
        ok, responses = self._client.txn(
            f"register node {me.node_rank}",
            compare=lambda t: [t.version(key) == 0],
            success=lambda t: [t.put(key, me.to_json(), lease=lease), t.get(key)],
            failure=lambda t: [t.get(key)],
        )
        row = first_row(responses[1:] if ok else responses)
        if not ok:
            held = _parse(row)
            holder = f"agent pid {held.pid} on {held.host}" if held else "another agent"
            raise ConfigError(
                f"job {self.job!r}: node rank {me.node_rank} is already held by {holder}; "
                f"two agents claim node {me.node_rank} (if that agent is gone, its claim "
                f"lapses within its lease TTL)"
            )
        self._revision = row.create_revision if row is not None else 0
        self._start_keepalive()
        for other in self._earlier():
            if (why := self.me.mismatch(other)) is not None:
                raise ConfigError(
                    f"job {self.job!r}: node {me.node_rank} disagrees with {other.where()}: {why}"
                )
        logger.info("job %s: node %d registered (lease %x)", self.job, me.node_rank, lease)

    def wait(
        self, timeout_s: float, stopping: Callable[[], bool] | None = None
    ) -> dict[int, NodeInfo]:
        """Poll until every node rank is held by an agent that agrees with this one.

        Raises:
            MembershipError: ``timeout_s`` passed first (naming the missing nodes),
                or ``stopping()`` returned True (checked at every poll).
        """
        deadline = time.monotonic() + timeout_s
        while True:
            nodes = self.agreeing()
            if len(nodes) == self.me.nnodes:
                return nodes
            if time.monotonic() >= deadline:
                missing = sorted(set(range(self.me.nnodes)) - set(nodes))
                raise MembershipError(
                    f"job {self.job!r}: node {self.me.node_rank} waited {timeout_s:g} s for "
                    f"{self.me.nnodes} node agents; node(s) {missing} never registered"
                )
            if self._stop.wait(_POLL_S) or (stopping is not None and stopping()):
                raise MembershipError(
                    f"job {self.job!r}: node {self.me.node_rank} stopped waiting for the others"
                )

    def agreeing(self) -> dict[int, NodeInfo]:
        """The registered agents that agree with this one, by node rank."""
        out: dict[int, NodeInfo] = {}
        for _, info in self._read():
            if info.mismatch(self.me) is None and 0 <= info.node_rank < self.me.nnodes:
                out[info.node_rank] = info
        return out

    def _earlier(self) -> list[NodeInfo]:
        return [info for rev, info in self._read() if rev < self._revision]

    def _read(self) -> list[tuple[int, NodeInfo]]:
        rows, _ = self._client.get_prefix(self._keys.nodes)
        return [(kv.create_revision, info) for kv in rows if (info := _parse(kv)) is not None]

    def _start_keepalive(self) -> None:
        self._keepalive = threading.Thread(
            target=self._keepalive_loop, name="node-lease-keepalive", daemon=True
        )
        self._keepalive.start()

    def _keepalive_loop(self) -> None:
        period = self._ttl_s / 3.0
        while not self._stop.wait(period):
            lease = self._lease
            if lease is None:
                return
            try:
                if self._client.refresh_lease(lease, budget_s=period) <= 0:
                    logger.error(
                        "job %s: node %d's lease %x expired", self.job, self.me.node_rank, lease
                    )
                    return
            except MembershipError as exc:
                logger.warning("job %s: node lease keep-alive failed: %s", self.job, exc)

    def close(self) -> None:
        """Stop the keep-alive and revoke the lease (the node key goes with it).
        Safe to call twice; etcd errors are logged, not raised."""
        self._stop.set()
        if self._keepalive is not None and self._keepalive is not threading.current_thread():
            self._keepalive.join(5.0)
        lease, self._lease = self._lease, None
        if lease is not None:
            try:
                self._client.revoke_lease(lease, budget_s=3.0)
            except MembershipError as exc:
                logger.warning("job %s: revoking node lease %x failed: %s", self.job, lease, exc)
        self._client.close()

    def __enter__(self) -> NodeRendezvous:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _parse(row: KeyValue | None) -> NodeInfo | None:
    if row is None:
        return None
    try:
        return NodeInfo.from_json(row.value)
    except (ValueError, KeyError, TypeError):
        logger.warning("ignoring a malformed node record at %s", row.key)
        return None


def this_host() -> tuple[str, int]:
    """This machine's name and this process's pid, for a :class:`NodeInfo`."""
    return socket.gethostname(), os.getpid()
