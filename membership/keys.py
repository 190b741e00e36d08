"""Key layout of one job in etcd. Every key of job J lives under ``/resilient/J/``."""

from __future__ import annotations

import hashlib

from resilient.config import validate_job_name

ROOT = "/resilient"


class JobKeys:
    """Builds the keys of one job; two jobs never share a prefix."""

    __slots__ = ("job", "prefix")

    def __init__(self, job: str) -> None:
        self.job = validate_job_name(job)
        self.prefix = f"{ROOT}/{job}/"

    @property
    def token(self) -> str:
        return self.prefix + "token"

    @property
    def members(self) -> str:
        return self.prefix + "members/"

    def member(self, rank: int) -> str:
        return f"{self.members}{rank:06d}"

    @property
    def nodes(self) -> str:
        """Node agents (``resilient run --nnodes``), one key per node rank under the
        agent's lease (:mod:`membership.nodes`)."""
        return self.prefix + "nodes/"

    def node(self, node_rank: int) -> str:
        return f"{self.nodes}{node_rank:06d}"

    @property
    def node_states(self) -> str:
        """What became of each node rank, without a lease: ``running`` once the
        agents met (or a spare node took it over), ``done`` once its agent finished
        with every rank done. A node key gone while its state says ``running`` is a
        lost node (:mod:`membership.nodes`)."""
        return self.prefix + "node-state/"

    def node_state(self, node_rank: int) -> str:
        return f"{self.node_states}{node_rank:06d}"

    @property
    def spare_nodes(self) -> str:
        """Spare node agents (``resilient run --spare``), one key each under the
        agent's lease, named by that lease's id."""
        return self.prefix + "spare-nodes/"

    def spare_node(self, lease: int) -> str:
        return f"{self.spare_nodes}{lease:016x}"

    @property
    def departures(self) -> str:
        return self.prefix + "left/"

    def departed(self, rank: int) -> str:
        """Written (without a lease) by a member that leaves on purpose, so a
        supervisor can tell a departure from a lease that expired."""
        return f"{self.departures}{rank:06d}"

    @property
    def replacements(self) -> str:
        return self.prefix + "replacement/"

    @property
    def supervisor(self) -> str:
        """Written by the supervisor (the launcher) at start and after each restart:
        restarts left and whether warm spares stand by, so a rank can weigh leaving
        the job (straggler eviction) before anything is lost."""
        return self.prefix + "supervisor"

    def replacement(self, rank: int) -> str:
        """Written by the supervisor when ``rank`` was lost: whether a replacement
        comes (warm, cold) or not (none), so survivors need not wait to find out."""
        return f"{self.replacements}{rank:06d}"

    @property
    def rank_health(self) -> str:
        return self.prefix + "health/rank/"

    @property
    def link_health(self) -> str:
        return self.prefix + "health/link/"

    def link(self, reporter: int, peer: int, rail: int) -> str:
        # Each end reports its own view of the link, so both records coexist.
        return f"{self.link_health}{reporter:06d}-{peer:06d}-{rail:03d}"

    @property
    def store(self) -> str:
        """Where the job's etcd-backed stores live; the links' store of one run (and
        in it the job's epoch, :mod:`membership.epoch`) is ``store/links-<nonce>/``."""
        return self.prefix + "store/"

    @property
    def chaos_faults(self) -> str:
        """In-process link faults of a chaos run without root: the chaos runner
        writes them, every rank's fault hook applies its own."""
        return self.prefix + "chaos-faults/"

    def sub(self, name: str) -> str:
        """A free-form sub-prefix for later subsystems (progress, control, events)."""
        return f"{self.prefix}{name.strip('/')}/"


def token_hash(job: str, token: str) -> str:
    """What etcd stores instead of the token: a job-salted SHA-256 (never the token)."""
    return hashlib.sha256(f"resilient-job-token\0{job}\0{token}".encode()).hexdigest()
