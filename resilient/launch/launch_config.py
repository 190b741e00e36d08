"""What the local launcher starts and how it supervises it: :class:`LaunchConfig`."""

from __future__ import annotations

import math
import os
import secrets
from dataclasses import dataclass, field
from typing import Final

from resilient.config import ENV_PREFIX, EXIT_FENCED, parse_endpoints, validate_job_name
from resilient.errors import ConfigError
from resilient.launch.rank_env import _RANK_VAR_NAMES, RankVar

__all__ = [
    "EXIT_FENCED",
    "MAX_LOCAL_RANKS",
    "MAX_RAILS",
    "LaunchConfig",
    "loopback_rails",
    "new_job_name",
]

# Rail addresses are 127.0.<rail+1>.<rank+1>: one octet each, and .255 is avoided.
MAX_LOCAL_RANKS: Final = 254
MAX_RAILS: Final = 254


def loopback_rails(rank: int, rails: int) -> tuple[str, ...]:
    """The loopback address of each rail of ``rank``: ``127.0.<rail+1>.<rank+1>``."""
    return tuple(f"127.0.{rail + 1}.{rank + 1}" for rail in range(rails))


def new_job_name() -> str:
    """A fresh job name, ``job-<8 random hex digits>``."""
    return f"job-{secrets.token_hex(4)}"


def _new_token() -> str:
    return secrets.token_hex(16)


def _check_int(name: str, value: int, low: int, high: int | None) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ConfigError(f"{name}={value!r}: must be an integer")
    if value < low or (high is not None and value > high):
        bounds = f"between {low} and {high}" if high is not None else f">= {low}"
        raise ConfigError(f"{name}={value}: must be {bounds}")


def _check_seconds(name: str, value: float, *, minimum: float, inclusive: bool) -> None:
    ok = isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)
    if ok:
        ok = value >= minimum if inclusive else value > minimum
    if not ok:
        bound = f">= {minimum:g}" if inclusive else f"> {minimum:g}"
        raise ConfigError(f"{name}={value!r}: must be a finite number of seconds {bound}")


@dataclass(frozen=True, kw_only=True, slots=True)
class LaunchConfig:
    """What the local launcher starts and how it supervises it.

    ``etcd`` is a comma-separated list of client URLs, or None for an embedded etcd
    that lives as long as the launch. ``nproc`` ranks run here; with ``nnodes`` > 1
    this is the agent of node ``node_rank`` (torchrun's ``--node-rank``): its local
    rank L is global rank ``node_rank * nproc + L`` of ``nnodes * nproc``, the agents
    meet in etcd (which must then be given) within ``join_timeout_s``, and node 0's
    agent hosts torch's init store at ``master_addr``. A ``spare`` agent waits
    until a node is lost and takes its node rank and ranks over. ``rail_names`` (interface
    names or addresses, the same on every rank of this node) replace the loopback
    rail addresses; ``rails`` is then their count. ``max_restarts`` is one budget for the whole
    job (rank restarts of all ranks together). ``log_dir`` adds a ``rank<N>.log``
    copy of each rank's output; ``run_dir`` is handed to the ranks. Both are made
    absolute here. ``grace_s`` is the SIGTERM-to-SIGKILL delay when stopping ranks.

    Raises:
        ConfigError: a value is out of range, the script is not a file, the job
            name or an etcd URL is malformed, or a directory path is a file.
    """

    nproc: int
    script: str
    script_args: tuple[str, ...] = ()
    rails: int = 1
    etcd: str | None = None
    job: str = field(default_factory=new_job_name)
    max_restarts: int = 0
    nnodes: int = 1
    node_rank: int = 0
    join_timeout_s: float = 300.0
    rail_names: tuple[str, ...] = ()
    # A spare node agent: waits until a node of the job is lost and takes its
    # ranks over (``node_rank`` is then that node's).
    spare: bool = False
    log_dir: str | None = None
    run_dir: str | None = None
    lease_ttl_s: float = 5.0
    grace_s: float = 5.0
    token: str = field(default_factory=_new_token, repr=False)
    # Per-rank overrides used by the chaos testbed (ranks on hosts in network
    # namespaces): rail addresses, an argv prefix, the MASTER_ADDR to hand out.
    rank_rails: tuple[tuple[str, ...], ...] = ()
    rank_wrap: tuple[tuple[str, ...], ...] = ()
    master_addr: str = "127.0.0.1"
    echo: bool = True
    fault_control: bool = False
    # One standby process per rank that already imported torch (resilient.launch.standby):
    # a failed rank's standby takes over at once instead of a cold start.
    warm_spares: bool = False
    # Without warm spares, one process per rank past `import torch`
    # (resilient.launch.primed) that a cold restart of the rank starts from, while
    # restarts are left: ~300 MB of host memory per rank for seconds of recovery.
    primed_restarts: bool = True
    # Serve Prometheus metrics on this port (all interfaces; 0: any free port).
    metrics_port: int | None = None
    # Elastic shrink: once the restart budget is spent, a lost rank is left out and
    # the job goes on while at least this many ranks run (None: the job stops).
    min_ranks: int | None = None
    # The same floor in whole nodes (nnodes > 1): min_ranks becomes min_nodes * nproc,
    # so a node lost with no spare to take it over is left out, all its ranks at once.
    min_nodes: int | None = None
    # How long survivors wait for a replacement before shrinking (with min_ranks).
    shrink_after_s: float = 10.0
    # A confirmed straggler may leave the job, to be replaced (recovery.policy).
    evict_stragglers: bool = False
    # More RESILIENT_* variables for every rank, over the launcher's own
    # environment (the chaos runner asks for frequent progress records).
    rank_env: tuple[tuple[str, str], ...] = ()

    def __post_init__(self) -> None:
        _check_int("nproc", self.nproc, 1, MAX_LOCAL_RANKS)
        self._check_nodes()
        _check_int("rails", self.rails, 1, MAX_RAILS)
        _check_int("max_restarts", self.max_restarts, 0, None)
        if self.metrics_port is not None:
            _check_int("metrics_port", self.metrics_port, 0, 65535)
        self._check_min_nodes()
        if self.min_ranks is not None:
            _check_int("min_ranks", self.min_ranks, 1, self.world_size)
        _check_seconds("shrink_after_s", self.shrink_after_s, minimum=0.0, inclusive=False)
        for name, _ in self.rank_env:
            if not name.startswith(ENV_PREFIX) or name in _RANK_VAR_NAMES:
                raise ConfigError(
                    f"rank_env: {name!r}: only {ENV_PREFIX}* variables the launcher does not set"
                )
        if self.evict_stragglers and self.max_restarts < 1 and self.min_ranks is None:
            raise ConfigError(
                "evict_stragglers: an evicted rank must be replaced or left out; "
                "set max_restarts >= 1 or min_ranks"
            )
        # etcd leases are whole seconds and the keep-alive runs every ttl/3.
        _check_seconds("lease_ttl_s", self.lease_ttl_s, minimum=2.0, inclusive=True)
        _check_seconds("grace_s", self.grace_s, minimum=0.0, inclusive=False)
        validate_job_name(self.job)
        if not self.token or not self.token.isprintable() or any(c.isspace() for c in self.token):
            raise ConfigError("token: must be a non-empty string without whitespace")
        if self.etcd is not None:
            object.__setattr__(self, "etcd", ",".join(parse_endpoints(self.etcd)))
        if not self.script or not os.path.isfile(self.script):
            raise ConfigError(f"script {self.script!r}: no such file")
        object.__setattr__(self, "script_args", tuple(self.script_args))
        self._check_per_rank()
        for name in ("log_dir", "run_dir"):
            value = getattr(self, name)
            if value is None:
                continue
            path = os.path.abspath(os.fspath(value))
            if os.path.exists(path) and not os.path.isdir(path):
                raise ConfigError(f"{name}={value!r}: exists and is not a directory")
            object.__setattr__(self, name, path)

    def _check_nodes(self) -> None:
        _check_int("nnodes", self.nnodes, 1, None)
        _check_int("node_rank", self.node_rank, 0, self.nnodes - 1)
        _check_seconds("join_timeout_s", self.join_timeout_s, minimum=0.0, inclusive=False)
        names = tuple(str(n).strip() for n in self.rail_names)
        if names:
            if not all(names) or any(c.isspace() or c == "," for n in names for c in n):
                raise ConfigError(f"rail_names={self.rail_names!r}: empty or malformed name")
            object.__setattr__(self, "rail_names", names)
            object.__setattr__(self, "rails", len(names))
        if not names and not self.rank_rails and self.world_size > MAX_LOCAL_RANKS:
            raise ConfigError(
                f"{self.world_size} ranks on loopback rails: at most {MAX_LOCAL_RANKS}; "
                "name the rails (rail_names, --rails eth0,eth1)"
            )
        if self.spare and self.nnodes < 2:
            raise ConfigError("spare: a spare node stands by for a job of several (nnodes >= 2)")
        if self.nnodes > 1:
            if self.etcd is None:
                raise ConfigError(
                    f"nnodes={self.nnodes}: every node agent must reach the same etcd; "
                    "give its URLs (--etcd), the embedded one serves one machine only"
                )
            if self.rank_rails or self.rank_wrap:
                raise ConfigError("rank_rails and rank_wrap are for one node (nnodes=1)")
            if self.evict_stragglers:
                raise ConfigError(
                    "evict_stragglers: not built for several nodes yet (the restart budget "
                    "is per node agent)"
                )

    def _check_min_nodes(self) -> None:
        if self.min_nodes is None:
            return
        _check_int("min_nodes", self.min_nodes, 1, self.nnodes)
        if self.nnodes < 2:
            raise ConfigError("min_nodes: for a job of several nodes (nnodes >= 2); see min_ranks")
        floor = self.min_nodes * self.nproc
        if self.min_ranks is not None and self.min_ranks != floor:
            raise ConfigError(
                f"min_nodes={self.min_nodes} (min_ranks {floor}) and min_ranks={self.min_ranks}: "
                "give one of them"
            )
        object.__setattr__(self, "min_ranks", floor)

    @property
    def world_size(self) -> int:
        """Ranks of the whole job: ``nnodes * nproc``."""
        return self.nnodes * self.nproc

    @property
    def first_rank(self) -> int:
        """The global rank of this node's local rank 0."""
        return self.node_rank * self.nproc

    def global_rank(self, local_rank: int) -> int:
        """Node ``node_rank``'s local rank L is global rank ``node_rank * nproc + L``."""
        return self.first_rank + local_rank

    def wrap_of(self, rank: int) -> tuple[str, ...]:
        """The command prefix global ``rank``'s processes start in (``rank_wrap``;
        empty without one): the rank, its warm spare and its primed process."""
        return self.rank_wrap[rank - self.first_rank] if self.rank_wrap else ()

    def _check_per_rank(self) -> None:
        for name in ("rank_rails", "rank_wrap"):
            value = tuple(tuple(str(x) for x in item) for item in getattr(self, name))
            if value and len(value) != self.nproc:
                raise ConfigError(f"{name}: one entry per rank expected, got {len(value)}")
            object.__setattr__(self, name, value)
        for rank, addrs in enumerate(self.rank_rails):
            if len(addrs) != self.rails:
                raise ConfigError(f"rank_rails[{rank}]: {self.rails} address(es) expected")

    def rails_of(self, rank: int) -> tuple[str, ...]:
        """The rail addresses (or interface names) handed to global ``rank``."""
        if self.rail_names:
            return self.rail_names
        if self.rank_rails:
            return self.rank_rails[rank - self.first_rank]
        return loopback_rails(rank, self.rails)

    def environ(
        self,
        rank: int,
        incarnation: int,
        *,
        master_addr: str,
        master_port: int,
        etcd_url: str,
        run_id: str = "",
    ) -> dict[str, str]:
        """The environment of global ``rank``'s process at ``incarnation``: ours,
        less what an enclosing launch set for its ranks, plus every :class:`RankVar`
        (``run_id``: this start of the job, RESILIENT_RUN_ID, when there is one)."""
        values: dict[RankVar, str] = {
            RankVar.RANK: str(rank),
            RankVar.WORLD_SIZE: str(self.world_size),
            RankVar.LOCAL_RANK: str(rank - self.first_rank),
            RankVar.LOCAL_WORLD_SIZE: str(self.nproc),
            RankVar.MASTER_ADDR: master_addr,
            RankVar.MASTER_PORT: str(master_port),
            RankVar.ETCD: etcd_url,
            RankVar.JOB: self.job,
            RankVar.TOKEN: self.token,
            RankVar.RAILS: ",".join(self.rails_of(rank)),
            RankVar.INCARNATION: str(incarnation),
            RankVar.LEASE_TTL_S: repr(float(self.lease_ttl_s)),
            RankVar.PYTHONUNBUFFERED: "1",
            RankVar.TORCH_DISABLE_SHARE_RDZV_TCP_STORE: "1",
            RankVar.TORCHELASTIC_USE_AGENT_STORE: "True",
        }
        if self.run_dir is not None:
            values[RankVar.RUN_DIR] = self.run_dir
        if run_id:
            values[RankVar.RUN_ID] = run_id
        if self.fault_control:
            values[RankVar.FAULT_CONTROL] = "1"
        if self.min_ranks is not None:
            values[RankVar.MIN_RANKS] = str(self.min_ranks)
            values[RankVar.SHRINK_AFTER_S] = repr(float(self.shrink_after_s))
        if self.evict_stragglers:
            values[RankVar.EVICT_STRAGGLERS] = "1"
        env = self.node_environ()
        env.update({var.value: value for var, value in values.items()})
        return env

    def node_environ(self) -> dict[str, str]:
        """What every rank's environment holds whatever its rank: ours, less what an
        enclosing launch set for its ranks (it would be wrong here; RESILIENT_ETCD_CA
        and friends are passed through), plus ``rank_env``."""
        env = {k: v for k, v in os.environ.items() if k not in _RANK_VAR_NAMES}
        env.update(self.rank_env)
        return env
