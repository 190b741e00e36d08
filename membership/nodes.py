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

**Fencing** (:mod:`membership.kept_lease`). Once the agent runs ranks it asks
:meth:`NodeRendezvous.watch_lease`
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

**A returning node.** An agent started again for a node the job lost (its state
still ``running``, its key gone, ranks of other nodes still members:
:meth:`NodeRendezvous.was_lost`) does not meet the others as at a start: it
claims its node back as a spare would (:meth:`NodeRendezvous.take_back`) and
starts its ranks as replacements.
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import asdict, replace
from typing import Final

from membership.etcd_client import EtcdClient
from membership.guarded import first_row, job_client
from membership.kept_lease import KeptLease, fence_margin
from membership.keys import JobKeys
from membership.node_info import NodeInfo, parse_row, this_host
from membership.node_probe import evict, open_beacon, refused
from resilient.config import EtcdConfig
from resilient.errors import ConfigError, MembershipError

__all__ = ["NodeInfo", "NodeRendezvous", "fence_margin", "this_host"]

logger = logging.getLogger(__name__)

_POLL_S: Final = 0.2
# How often a spare or the lowest live agent knocks on the others' beacons.
_PROBE_S: Final = 0.5
RUNNING: Final = "running"
# What a lost node's events give as the reason (see why_lost).
LEASE_LAPSED: Final = (
    "its node lease lapsed while it was running and none of its ranks holds a member key"
)
BEACON_REFUSED: Final = "its machine refused its agent's beacon: the agent died"
DONE: Final = "done"


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
        self._client: EtcdClient = job_client(EtcdClient(etcd), job, token)
        self._lease = KeptLease(self._client, lease_ttl_s, lambda: f"job {job}: {self._who()}")
        self._revision = 0
        self._stop = threading.Event()  # close(): stop waiting
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
        lease = self._lease.grant()
        ok, responses = self._client.txn(
            f"register node {me.node_rank}",
            compare=lambda t: [t.version(key) == 0],
            success=lambda t: [t.put(key, me.to_json(), lease=lease), t.get(key)],
            failure=lambda t: [t.get(key)],
        )
        row = first_row(responses[1:] if ok else responses)
        if not ok:
            held = parse_row(row)
            holder = f"agent pid {held.pid} on {held.host}" if held else "another agent"
            raise ConfigError(
                f"job {self.job!r}: node rank {me.node_rank} is already held by {holder}; "
                f"two agents claim node {me.node_rank} (if that agent is gone, its claim "
                f"lapses within its lease TTL)"
            )
        self._revision = row.create_revision if row is not None else 0
        self._check_agreement()
        logger.info("job %s: node %d registered (lease %x)", self.job, me.node_rank, lease)

    def _check_agreement(self) -> None:
        for other in self._earlier():
            if (why := self.me.mismatch(other)) is not None:
                raise ConfigError(
                    f"job {self.job!r}: {self._who()} disagrees with {other.where()}: {why}"
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
            raise MembershipError(f"job {self.job!r}: {self._who()} stopped waiting for the others")

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
    def register_spare(self, *, listed: bool = True) -> None:
        """Hold a key under ``spare-nodes/`` (this agent's lease) and keep it alive;
        ``listed`` False: the lease only (:meth:`take_back`: no agent counts it as
        a spare, which would change what they do with a lost node).

        Raises:
            ConfigError: this agent disagrees with a node agent already there.
        """
        lease = self._lease.grant()
        if listed:
            self._client.put(self._keys.spare_node(lease), self.me.to_json(), lease=lease)
        self._revision = 2**62  # every node agent counts as earlier
        self._check_agreement()
        logger.info("job %s: %s registered (lease %x)", self.job, self._who(), lease)

    def _who(self) -> str:
        return "a spare node" if self.spare else f"node {self.me.node_rank}"

    def was_lost(self) -> bool:
        """Whether this agent's node was lost from a job that runs on: its state
        record says ``running``, no agent holds its key, and a rank of another node
        holds its member key. A job's earlier start that ended or crashed leaves
        state records but no live member, so its next start joins afresh."""
        node = self.me.node_rank
        if self.states().get(node) != RUNNING or node in self.agreeing():
            return False
        return bool(self._note_incarnations() - self._ranks_of(node))

    def take_back(self, timeout_s: float, stopping: Callable[[], bool] | None = None) -> None:
        """Claim this agent's node back (it :meth:`was_lost`), as a spare would take
        it over: once it is lost (its ranks' member keys lapsed too), under this
        agent's own lease, in the same transaction as a spare's claim, so of a spare
        and the returning agent only one wins.

        Raises:
            ConfigError: this agent disagrees with the node agents there.
            MembershipError: the node was not lost within ``timeout_s`` (its ranks
                still hold member keys) or was taken by a spare meanwhile, or
                ``stopping()`` said to stop.
        """
        node = self.me.node_rank
        if self._lease.id is None:
            self.register_spare(listed=False)
        deadline = time.monotonic() + timeout_s
        while not (node in self.lost_nodes(probe=()) and self.claim(node)):
            if node in self.agreeing():
                raise MembershipError(
                    f"job {self.job!r}: node {node} was taken over by a spare node while "
                    "its agent came back"
                )
            if time.monotonic() >= deadline:
                held = sorted(self._ranks_of(node) & self._note_incarnations())
                raise MembershipError(
                    f"job {self.job!r}: node {node} came back, but its ranks {held} still "
                    f"held their member keys after {timeout_s:g} s"
                )
            self._pause(stopping)

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
        lease = self._lease.id
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
        how = "a spare node took it over" if self.spare else "its agent came back"
        self.me, self.spare = me, False
        self._revision = row.create_revision if row is not None else 0
        logger.warning("job %s: lost node %d claimed: %s", self.job, node_rank, how)
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
        return [(kv.create_revision, info) for kv in rows if (info := parse_row(kv)) is not None]

    # -- the lease and the fence --------------------------------------------------------
    @property
    def fence_margin_s(self) -> float:
        return self._lease.fence_margin_s

    @property
    def fenced(self) -> str | None:
        """Why this agent fenced itself, once it did."""
        return self._lease.fenced

    def fence_at(self) -> float:
        """When (monotonic) this agent must have stopped its ranks (KeptLease.fence_at)."""
        return self._lease.fence_at()

    def watch_lease(self, fence: Callable[[str], None]) -> None:
        """Call ``fence(why)`` once, from a watchdog thread, when the node lease may
        lapse (:meth:`membership.kept_lease.KeptLease.watch`)."""
        self._lease.watch(fence)

    def close(self) -> None:
        """Stop the keep-alive and revoke the lease (the node key goes with it).
        Safe to call twice; etcd errors are logged, not raised."""
        self._stop.set()
        self._lease.close()
        if self._beacon is not None:
            self._beacon.close()
        self._client.close()

    def __enter__(self) -> NodeRendezvous:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
