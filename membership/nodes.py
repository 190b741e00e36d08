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

**Fencing.** Once the agent runs ranks it asks :meth:`NodeRendezvous.watch_lease`
to fence it: a watchdog thread calls back when the node lease may be about to
expire in etcd, i.e. ``fence_margin_s`` before the lease TTL has passed since the
last keep-alive that etcd acknowledged (measured from when that keep-alive was
*sent*: etcd restarted the TTL no earlier), or at once when etcd says the lease is
gone. The callback stops the node's ranks, so they are dead before etcd deletes
the node key and before anything can replace them (no split brain).

**Spare nodes.** A spare agent (:meth:`NodeRendezvous.register_spare`) holds a
key under ``spare-nodes/`` and waits (:meth:`NodeRendezvous.wait_for_loss`). A
node is lost when its key is gone while its state record (``node-state/<K>``,
kept without a lease) still says ``running``: :meth:`NodeRendezvous.claim` then
moves the spare to ``nodes/<K>`` in one transaction that compares the key's
version with 0, so of two spares only one wins. A node is not taken over while
one of its ranks still holds its member key (its agent stopped, its ranks train
on): that waits until those leases lapse too.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import asdict, replace
from typing import Final

from membership.etcd_client import EtcdClient, KeyValue
from membership.guarded import first_row, job_client
from membership.keys import JobKeys
from membership.node_info import NodeInfo
from membership.node_probe import evict, open_beacon, refused
from resilient.config import EtcdConfig
from resilient.errors import ConfigError, MembershipError

__all__ = ["NodeInfo", "NodeRendezvous", "this_host"]

logger = logging.getLogger(__name__)

_POLL_S: Final = 0.2
# A keep-alive that failed is tried again this soon (not a whole period later): the
# lease must be refreshed before the fence deadline, not merely within its TTL.
_RETRY_S: Final = 0.2
# How often a spare or the lowest live agent knocks on the others' beacons.
_PROBE_S: Final = 0.5
RUNNING: Final = "running"
# What a lost node's events give as the reason (see why_lost).
LEASE_LAPSED: Final = (
    "its node lease lapsed while it was running and none of its ranks holds a member key"
)
BEACON_REFUSED: Final = "its machine refused its agent's beacon: the agent died"
DONE: Final = "done"


def fence_margin(ttl_s: float) -> float:
    """How long before the node lease could expire in etcd its agent stops its ranks:
    a fifth of the TTL, 0.5 to 2 s (killing a process group and reaping it takes
    milliseconds; the rest covers a busy machine's scheduling delays)."""
    return min(max(0.2 * ttl_s, 0.5), 2.0)


class NodeRendezvous:
    """One agent's registration in its job; see the module docstring.

    ``spare``: a spare node agent (``me.node_rank`` is ignored until it claims one).

    Raises (from every method, besides what each names):
        EtcdUnavailable: etcd did not answer within the client's bound.
        JobTokenMismatch: the job was created with another token.
    """

    def __init__(
        self,
        etcd: EtcdConfig,
        job: str,
        token: str,
        me: NodeInfo,
        *,
        lease_ttl_s: float,
        spare: bool = False,
    ) -> None:
        if not token:
            raise ConfigError(f"job {job!r}: node agents need a shared token (RESILIENT_TOKEN)")
        if not spare and not 0 <= me.node_rank < me.nnodes:
            raise ConfigError(f"node rank {me.node_rank}: must be in [0, nnodes={me.nnodes})")
        if not lease_ttl_s >= 2.0:
            raise ConfigError(f"lease_ttl_s={lease_ttl_s}: must be >= 2 s")
        self.job = job
        self.spare = spare
        self._beacon = open_beacon(etcd.endpoints[0], job) if not me.probe else None
        self.me = replace(me, probe=self._beacon.address) if self._beacon is not None else me
        self._keys = JobKeys(job)
        self._ttl_s = lease_ttl_s
        self.fence_margin_s = fence_margin(lease_ttl_s)
        self._client: EtcdClient = job_client(EtcdClient(etcd), job, token)
        self._lease: int | None = None
        self._revision = 0
        self._stop = threading.Event()
        self._keepalive: threading.Thread | None = None
        # When the last keep-alive etcd acknowledged was sent (monotonic): etcd
        # restarted the lease's TTL no earlier than that.
        self._acked_at = 0.0
        self._lease_gone = threading.Event()
        self._fence: threading.Thread | None = None
        self.fenced: str | None = None  # why this agent fenced itself, once it did
        self._incarnations: dict[int, int] = {}  # rank -> highest seen (spares)
        # The last record read of each node: who ran a node once its key is gone;
        # a spare's ``took_from``: the record of the node it claimed, before that.
        self.seen: dict[int, NodeInfo] = {}
        self.took_from: NodeInfo | None = None
        # Why a lost node was found lost, where a beacon proved it (node_probe);
        # the others: their leases lapsed.
        self.lost_why: dict[int, str] = {}
        self._probe_due = 0.0

    def join(
        self, timeout_s: float, stopping: Callable[[], bool] | None = None
    ) -> dict[int, NodeInfo]:
        """Register, then wait until all ``nnodes`` agents are there; returns them
        by node rank, and records this node as ``running``. On any error this
        agent's key is removed again.

        Raises:
            ConfigError: the node rank is held by another agent, or this agent
                disagrees with an earlier one (the message names both).
            MembershipError: not all agents came within ``timeout_s`` (the message
                names the missing node ranks), or ``stopping()`` said so first.
        """
        try:
            self.register()
            nodes = self.wait(timeout_s, stopping)
            self.set_state(RUNNING)
            return nodes
        except BaseException:
            self.close()
            raise

    def register(self) -> None:
        """Write this agent's key under a new lease and start its keep-alive.

        Raises:
            ConfigError: the node rank is held, or an earlier agent disagrees.
        """
        me, key = self.me, self._keys.node(self.me.node_rank)
        lease = self._grant()
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
        self._check_agreement()
        logger.info("job %s: node %d registered (lease %x)", self.job, me.node_rank, lease)

    def _grant(self) -> int:
        sent = time.monotonic()
        lease = self._client.grant_lease(math.ceil(self._ttl_s))
        self._lease, self._acked_at = lease, sent
        return lease

    def _check_agreement(self) -> None:
        where = "a spare node" if self.spare else f"node {self.me.node_rank}"
        for other in self._earlier():
            if (why := self.me.mismatch(other)) is not None:
                raise ConfigError(
                    f"job {self.job!r}: {where} disagrees with {other.where()}: {why}"
                )

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
            self._pause(stopping)

    def _pause(self, stopping: Callable[[], bool] | None) -> None:
        """Raises: MembershipError: ``close()`` or ``stopping()`` said to stop."""
        if self._stop.wait(_POLL_S) or (stopping is not None and stopping()):
            who = "a spare node" if self.spare else f"node {self.me.node_rank}"
            raise MembershipError(f"job {self.job!r}: {who} stopped waiting for the others")

    def agreeing(self) -> dict[int, NodeInfo]:
        """The registered agents that agree with this one, by node rank."""
        out: dict[int, NodeInfo] = {}
        for _, info in self._read():
            if info.mismatch(self.me) is None and 0 <= info.node_rank < self.me.nnodes:
                out[info.node_rank] = info
        self.seen.update(out)
        return out

    def set_state(self, state: str) -> None:
        """Record what became of this node (``running``, ``done``), without a lease:
        spare nodes take over a node whose key is gone while it is ``running``."""
        self._client.put(self._keys.node_state(self.me.node_rank), state)

    def states(self) -> dict[int, str]:
        """Every node's state record, by node rank."""
        rows, _ = self._client.get_prefix(self._keys.node_states)
        return {int(kv.key.rsplit("/", 1)[1]): kv.value.decode() for kv in rows}

    # -- spare nodes --------------------------------------------------------------------
    def register_spare(self) -> None:
        """Hold a key under ``spare-nodes/`` (this agent's lease) and keep it alive.

        Raises:
            ConfigError: this spare disagrees with a node agent already there.
        """
        lease = self._grant()
        self._client.put(self._keys.spare_node(lease), self.me.to_json(), lease=lease)
        self._revision = 2**62  # every node agent counts as earlier
        self._start_keepalive()
        self._check_agreement()
        logger.info("job %s: spare node registered (lease %x)", self.job, lease)

    def wait_for_loss(
        self, stopping: Callable[[], bool] | None = None, store: Callable[[], str] | None = None
    ) -> int | None:
        """Wait (a spare) until a node is lost and this spare claims it: returns its
        node rank. None once node 0 finished (``done``): the job ended without
        needing this spare. Node 0 is taken over only when the job has a run id
        (ranks under ``resilient.init()`` then never use torch's init store) and
        ``store`` hosts a new init store here (returns ``host:port``, published
        with the run id in this spare's node-0 record).

        Raises:
            MembershipError: ``stopping()`` said to stop, or node 0 was lost in a
                job without a run id (not survivable, see docs/DEPLOY.md).
        """
        while True:
            states = self.states()
            if states.get(0) == DONE:  # the job ended, even if a node lost before never is
                return None
            lost = self.lost_nodes(states, probe=None)
            run = self.seen[0].run if 0 in self.seen else ""
            if 0 in lost and not (run and store):
                raise MembershipError(
                    f"job {self.job!r}: node 0 was lost; it hosts torch's init store and the "
                    "job has no run id, so no spare node can take it over"
                )
            for node in lost:
                before, new = self.seen.get(node), {"run": run} if node == 0 else {}
                if self.claim(node, **new, **({"store": store()} if new and store else {})):
                    self.took_from = before
                    return node
            self._pause(stopping)

    def lost_nodes(
        self, states: dict[int, str] | None = None, *, probe: Collection[int] | None = ()
    ) -> list[int]:
        """The nodes lost now: key gone while the state record says ``running``, and
        none of its ranks holding a member key (see :meth:`_note_incarnations`).
        ``probe``: the nodes whose beacons to knock on as well (None: every
        other node), at most every ``_PROBE_S``; one proven dead is evicted now
        (membership.node_probe)."""
        states = self.states() if states is None else states
        held = self.agreeing()
        if probe != () and time.monotonic() >= self._probe_due:
            self._probe_due = time.monotonic() + _PROBE_S
            if self._evict_dead(held, states, probe):
                held = self.agreeing()
        members = self._note_incarnations()
        return sorted(
            k for k, v in states.items()
            if v == RUNNING and k not in held and not self._ranks_of(k) & members
        )  # fmt: skip

    def _evict_dead(
        self, held: dict[int, NodeInfo], states: dict[int, str], probe: Collection[int] | None
    ) -> bool:
        """Knock on the beacons of the running nodes in ``probe`` (None: all others)
        and evict each one proven dead (membership.node_probe); whether any was."""
        evicted = False
        for k, info in held.items():
            if (probe is not None and k not in probe) or k == self.me.node_rank:
                continue
            if states.get(k) != RUNNING or not refused(info.probe):
                continue
            try:
                if not evict(self._client, self._keys, k, self._ranks_of(k), info.probe):
                    continue  # claimed or evicted meanwhile by another
            except MembershipError as exc:  # its leases lapse in time anyway
                logger.warning("job %s: evicting dead node %d failed: %s", self.job, k, exc)
                continue
            self.lost_why[k] = BEACON_REFUSED
            evicted = True
        return evicted

    def why_lost(self, node: int) -> str:
        """Why ``node`` was found lost: its beacon refused, else its leases lapsed."""
        return self.lost_why.get(node, LEASE_LAPSED)

    def spares(self) -> int:
        """How many spare node agents are registered (waiting to take a node over)."""
        rows, _ = self._client.get_prefix(self._keys.spare_nodes)
        return len(rows)

    def incarnation_of(self, rank: int) -> int:
        """The highest incarnation of ``rank`` seen in a member key (0 if none)."""
        return self._incarnations.get(rank, 0)

    def claim(self, node_rank: int, **record: str) -> bool:
        """Take lost ``node_rank`` over (its key gone, its state ``running``) in one
        transaction, ``record`` (node 0's ``store``, ``run``) in its new record;
        False when another spare won it or it is not lost."""
        lease = self._lease
        assert lease is not None, "register_spare() first"
        me = NodeInfo(**{**asdict(self.me), "node_rank": node_rank, **record})
        key, state = self._keys.node(node_rank), self._keys.node_state(node_rank)
        ok, responses = self._client.txn(
            f"claim node {node_rank}",
            compare=lambda t: [t.version(key) == 0, t.value(state) == RUNNING],
            success=lambda t: [
                t.put(key, me.to_json(), lease=lease),
                t.delete(self._keys.spare_node(lease)),
                t.get(key),
            ],
        )
        if not ok:
            return False
        row = first_row(responses[2:])
        self.me, self.spare = me, False
        self._revision = row.create_revision if row is not None else 0
        logger.warning("job %s: spare node took lost node %d over", self.job, node_rank)
        return True

    def incarnations(self, ranks: range) -> dict[int, int]:
        """The next incarnation for each of ``ranks``: one above the highest this
        spare saw (member keys) or the supervisors announced (replacement records)."""
        self._note_incarnations()
        out = {}
        for rank in ranks:
            record = self._client.get(self._keys.replacement(rank))
            announced = int(json.loads(record.value)["incarnation"]) if record else 0
            out[rank] = max(announced, self._incarnations.get(rank, 0)) + 1
        return out

    def _ranks_of(self, node_rank: int) -> set[int]:
        first = node_rank * self.me.nproc_per_node
        return set(range(first, first + self.me.nproc_per_node))

    def _note_incarnations(self) -> set[int]:
        """Note each member's incarnation; returns the ranks holding a member key.

        A node whose key lapsed while one of its ranks still holds its member key
        is not lost: its agent stopped (SIGSTOP) or starved while the ranks train
        on, and replacements beside them would split the job."""
        rows, _ = self._client.get_prefix(self._keys.members)
        live = set()
        for kv in rows:
            try:
                d = json.loads(kv.value)
                rank, inc = int(d["rank"]), int(d["incarnation"])
            except (ValueError, KeyError, TypeError):
                continue
            live.add(rank)
            self._incarnations[rank] = max(inc, self._incarnations.get(rank, 0))
        return live

    def _earlier(self) -> list[NodeInfo]:
        return [info for rev, info in self._read() if rev < self._revision]

    def _read(self) -> list[tuple[int, NodeInfo]]:
        rows, _ = self._client.get_prefix(self._keys.nodes)
        return [(kv.create_revision, info) for kv in rows if (info := _parse(kv)) is not None]

    # -- the lease and the fence --------------------------------------------------------
    def fence_at(self) -> float:
        """When (monotonic) this agent must have stopped its ranks: ``fence_margin_s``
        before the node lease could expire in etcd."""
        return self._acked_at + math.ceil(self._ttl_s) - self.fence_margin_s

    def watch_lease(self, fence: Callable[[str], None]) -> None:
        """Call ``fence(why)`` once, from a watchdog thread, at :meth:`fence_at` (or
        at once when etcd says the lease is gone); :attr:`fenced` says why after."""

        def watchdog() -> None:
            while not self._stop.is_set():
                left = self.fence_at() - time.monotonic()
                if self._lease_gone.is_set() or left <= 0:
                    break
                self._lease_gone.wait(min(left, _POLL_S))
            else:
                return
            why = (
                "etcd says its node lease expired"
                if self._lease_gone.is_set()
                else f"its node lease was not refreshed for "
                f"{time.monotonic() - self._acked_at:.1f} s (TTL {math.ceil(self._ttl_s)} s)"
            )
            self.fenced = why
            logger.error("job %s: node %d fenced: %s", self.job, self.me.node_rank, why)
            fence(why)

        self._fence = threading.Thread(target=watchdog, name="node-fence", daemon=True)
        self._fence.start()

    def _start_keepalive(self) -> None:
        self._keepalive = threading.Thread(
            target=self._keepalive_loop, name="node-lease-keepalive", daemon=True
        )
        self._keepalive.start()

    def _keepalive_loop(self) -> None:
        period = self._ttl_s / 3.0
        pause = period
        while not self._stop.wait(pause):
            lease = self._lease
            if lease is None:
                return
            sent = time.monotonic()
            # Bounded by the fence: an answer after it would come too late anyway.
            budget = max(min(period, self.fence_at() - sent), 0.1)
            try:
                ttl = self._client.refresh_lease(lease, budget_s=budget)
            except MembershipError as exc:
                logger.warning(
                    "job %s: node %d's lease keep-alive failed: %s",
                    self.job, self.me.node_rank, exc,
                )  # fmt: skip
                pause = _RETRY_S
                continue
            if ttl <= 0:
                logger.error(
                    "job %s: node %d's lease %x expired", self.job, self.me.node_rank, lease
                )
                self._lease_gone.set()
                return
            self._acked_at, pause = sent, period

    def close(self) -> None:
        """Stop the keep-alive and revoke the lease (the node key goes with it).
        Safe to call twice; etcd errors are logged, not raised."""
        self._stop.set()
        for thread in (self._keepalive, self._fence):
            if thread is not None and thread is not threading.current_thread():
                thread.join(5.0)
        if self._beacon is not None:
            self._beacon.close()
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
