"""Configuration dataclasses and the one place where ``RESILIENT_*`` env vars are read.

All configs are frozen, keyword-only and validated in ``__post_init__``; an invalid
value raises :class:`~resilient.errors.ConfigError` naming the field (and the env
var, when it came from one).
"""

from __future__ import annotations

import math
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from urllib.parse import urlsplit

from resilient.errors import ConfigError

__all__ = [
    "ENV_PREFIX",
    "EXIT_EVICTED",
    "EXIT_FENCED",
    "DataPlaneConfig",
    "EtcdConfig",
    "MembershipConfig",
    "RankEnv",
    "RecoveryConfig",
    "env_token",
    "etcd_config",
    "local_rank_env",
    "parse_endpoints",
    "validate_job_name",
]

ENV_PREFIX = "RESILIENT_"
# A rank that left as a straggler (EX_TEMPFAIL: may come back); replaced like any failed rank.
EXIT_EVICTED = 75
EXIT_FENCED = 69  # a lease not refreshed in time; the holder stops (EX_UNAVAILABLE)

_JOB_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,127}$")


def validate_job_name(job: str) -> str:
    """Return ``job`` if it is a safe etcd path segment, else raise ConfigError."""
    if not _JOB_RE.match(job):
        raise ConfigError(
            f"job name {job!r} is invalid: use 1-128 letters, digits, '_', '.' or '-', "
            "starting with a letter or digit"
        )
    return job


def etcd_config(spec: str, env: Mapping[str, str] | None = None, **bounds: float) -> EtcdConfig:
    """An :class:`EtcdConfig` for the endpoints in ``spec``, TLS and auth from ``env``
    (``RESILIENT_ETCD_CA``, ``_CERT``, ``_KEY``, ``_USER``, ``_PASSWORD``), time bounds
    ``bounds``. Raises ConfigError: an endpoint is malformed."""
    env = os.environ if env is None else env
    p = ENV_PREFIX
    return EtcdConfig(
        endpoints=parse_endpoints(spec),
        ca_cert=env.get(p + "ETCD_CA") or None,
        cert=env.get(p + "ETCD_CERT") or None,
        key=env.get(p + "ETCD_KEY") or None,
        user=env.get(p + "ETCD_USER") or None,
        password=env.get(p + "ETCD_PASSWORD") or None,
        **bounds,  # type: ignore[arg-type]
    )


def parse_endpoints(spec: str) -> tuple[str, ...]:
    """Parse ``"http://h1:2379,https://h2:2379"`` (scheme optional) into normalised URLs.

    Raises:
        ConfigError: an endpoint has no port, a bad scheme or is empty.
    """
    out: list[str] = []
    for raw in spec.split(","):
        item = raw.strip()
        if not item:
            continue
        url = item if "://" in item else f"http://{item}"
        parts = urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise ConfigError(f"etcd endpoint {item!r}: scheme must be http or https")
        try:
            port = parts.port
        except ValueError as exc:
            raise ConfigError(f"etcd endpoint {item!r}: invalid port") from exc
        if not parts.hostname or port is None:
            raise ConfigError(f"etcd endpoint {item!r}: expected host:port")
        out.append(f"{parts.scheme}://{parts.hostname}:{port}")
    if not out:
        raise ConfigError(f"no etcd endpoint in {spec!r}")
    return tuple(out)


@dataclass(frozen=True, kw_only=True, slots=True)
class EtcdConfig:
    """How to reach etcd.

    ``request_timeout_s`` bounds one RPC; ``retry_budget_s`` bounds all retries of
    one logical call (transient errors are retried with backoff until then).
    TLS is used when ``ca_cert`` is set; ``cert``/``key`` add a client certificate.
    """

    endpoints: tuple[str, ...]
    ca_cert: str | None = None
    cert: str | None = None
    key: str | None = None
    user: str | None = None
    password: str | None = None
    request_timeout_s: float = 2.0
    retry_budget_s: float = 10.0

    def __post_init__(self) -> None:
        if not self.endpoints:
            raise ConfigError("EtcdConfig.endpoints: at least one endpoint is required")
        object.__setattr__(self, "endpoints", parse_endpoints(",".join(self.endpoints)))
        if (self.cert is None) != (self.key is None):
            raise ConfigError("EtcdConfig: cert and key must be given together")
        if self.cert is not None and self.ca_cert is None:
            raise ConfigError("EtcdConfig: a client cert needs ca_cert as well")
        if (self.user is None) != (self.password is None):
            raise ConfigError("EtcdConfig: user and password must be given together")
        if self.request_timeout_s <= 0:
            raise ConfigError("EtcdConfig.request_timeout_s must be > 0")
        if self.retry_budget_s < self.request_timeout_s:
            raise ConfigError("EtcdConfig.retry_budget_s must be >= request_timeout_s")
        for name in ("ca_cert", "cert", "key"):
            path = getattr(self, name)
            if path is not None and not os.path.isfile(path):
                raise ConfigError(f"EtcdConfig.{name}: file {path!r} does not exist")

    @property
    def secure(self) -> bool:
        return self.ca_cert is not None


@dataclass(frozen=True, kw_only=True, slots=True)
class MembershipConfig:
    """Per-job membership settings.

    ``lease_ttl_s`` is how long a silent member stays listed (>= 2 s, whole seconds
    in etcd); the keep-alive refreshes it every ``lease_ttl_s / 3``.
    ``health_min_interval_s`` caps how often one health record is written (<= 1/s).
    """

    job: str
    lease_ttl_s: float = 5.0
    health_min_interval_s: float = 1.0

    def __post_init__(self) -> None:
        validate_job_name(self.job)
        if self.lease_ttl_s < 2.0:
            raise ConfigError(f"MembershipConfig.lease_ttl_s={self.lease_ttl_s}: must be >= 2 s")
        if self.health_min_interval_s < 1.0:
            raise ConfigError("MembershipConfig.health_min_interval_s must be >= 1 s")


@dataclass(frozen=True, kw_only=True, slots=True)
class DataPlaneConfig:
    """Data-plane settings of a :class:`~resilient.process_group.ResilientProcessGroup`.

    ``rail_weights``: share of each collective per rail (None: equal). A link op on
    ``n`` bytes must finish within ``op_timeout_floor_s + n / expected_link_bytes_per_s``;
    a new link's rendezvous within ``connect_timeout_s``. ``sub_chunk_bytes`` is the
    pipelining grain. ``check_mismatch`` exchanges a small signature before each
    collective so that ranks calling different collectives all raise instead of hanging.
    ``topology``: "ring" (2(P-1) hops, links to neighbours only), "mesh" (2 hops, links
    to every peer) or "auto" (mesh up to ``mesh_max_world`` ranks for tensors under
    ``mesh_below_bytes`` that take one rail, ring otherwise).
    Collectives under ``single_rail_below_bytes`` use only the heaviest rail: below
    that, splitting costs more in per-op latency than it gains in bandwidth.
    ``learn_rail_weights``: with several rails, no explicit ``rail_weights`` and
    ``check_mismatch`` on, weights follow the measured rail rates (agreed by all
    ranks in the signature exchange; see :mod:`resilient.detect.rail_weights`).
    ``straggler_schedule``: when the ranks agree that every link of one rank is slow,
    all_reduce gives that rank no share of the reduction (see
    :mod:`resilient.detect.slow_rank`; needs ``check_mismatch`` and a mesh topology).
    ``relay_via_store``: when a pair has no working rail left (every rail's link
    between them cut for a partition or a dead NIC), move its messages through the
    store so the collective still completes (slow; see :mod:`resilient.collectives.relay`;
    with two rails or more, where failovers are acknowledged).
    ``repair_links``: rebuild a broken link in the background once the NICs at both
    ends are up, each attempt (rendezvous, probe) bounded by ``repair_timeout_s``
    (see :mod:`resilient.links.repair`).
    ``control_transport``: what the signature exchange's control links are made of:
    "socket" (plain TCP connections, one per pair and rail; see
    :mod:`resilient.links.socket_link`) or "gloo" (two-rank gloo groups).
    ``data_transport``: the same choice for the CPU data links; "socket", the default,
    is faster on a loaded host and around a slow rank (docs/BENCHMARKS.md).
    ``cuda_transport``: CUDA tensors over NCCL pair links ("nccl", one GPU per rank) or
    staged through pinned host memory over the CPU links ("socket": ranks may share a
    GPU; :mod:`resilient.group.cuda_staging`).
    ``elide_every``: with ``check_mismatch``, K > 0 (default 8) keeps the signature
    exchange for every K-th call (and the first) while the group is quiet; the
    others check a digest carried in their data messages and fall back to the
    exchange only when a peer's call differs (see :mod:`resilient.collectives.digest_check`). Rail
    rates, slow-link evidence and straggler clocks are then read every K calls; a
    rank with news (a NIC, a link) makes the next call an exchange for everyone,
    and a group that is not quiet exchanges on every call. 0 exchanges on every
    call. Only with socket control and data links and a meshing data plane.
    ``native_io``: on one rail with socket data links, a mesh call's or ring pass's
    bytes move in C without the GIL while its links are quiet
    (:mod:`resilient.links.native_steps`; needs the compiled ``resilient.links._stepio``,
    built at install when a C compiler is there); anything unusual hands the streams
    back to the Python path. Env ``RESILIENT_NATIVE_IO=0`` turns it off.
    """

    rail_weights: tuple[float, ...] | None = None
    learn_rail_weights: bool = True
    sub_chunk_bytes: int = 1 << 20
    connect_timeout_s: float = 60.0
    op_timeout_floor_s: float = 10.0
    expected_link_bytes_per_s: float = 50e6
    check_mismatch: bool = True
    topology: str = "auto"
    mesh_max_world: int = 8
    mesh_below_bytes: int = 8 << 20
    single_rail_below_bytes: int = 256 << 10
    straggler_schedule: bool = True
    relay_via_store: bool = True
    repair_links: bool = True
    repair_timeout_s: float = 5.0
    control_transport: str = "socket"
    data_transport: str = "socket"
    cuda_transport: str = "nccl"
    elide_every: int = 8
    native_io: bool = True

    def __post_init__(self) -> None:
        if self.topology not in ("auto", "ring", "mesh"):
            raise ConfigError(f"topology={self.topology!r}: use auto, ring or mesh")
        if self.control_transport not in ("socket", "gloo"):
            raise ConfigError(f"control_transport={self.control_transport!r}: use socket or gloo")
        if self.data_transport not in ("socket", "gloo"):
            raise ConfigError(f"data_transport={self.data_transport!r}: use socket or gloo")
        if self.cuda_transport not in ("nccl", "socket"):
            raise ConfigError(f"cuda_transport={self.cuda_transport!r}: use nccl or socket")
        if self.mesh_max_world < 1 or self.single_rail_below_bytes < 0:
            raise ConfigError("mesh_max_world must be >= 1, single_rail_below_bytes >= 0")
        if self.rail_weights is not None:
            if not self.rail_weights or any(w < 0 for w in self.rail_weights):
                raise ConfigError(f"rail_weights={self.rail_weights}: need >= 1 weight, all >= 0")
            if sum(self.rail_weights) <= 0:
                raise ConfigError(f"rail_weights={self.rail_weights}: one must be > 0")
        if self.sub_chunk_bytes < 4096:
            raise ConfigError(f"sub_chunk_bytes={self.sub_chunk_bytes}: must be >= 4096")
        if self.repair_timeout_s <= 0:
            raise ConfigError(f"repair_timeout_s={self.repair_timeout_s}: must be > 0")
        if self.connect_timeout_s <= 0 or self.op_timeout_floor_s <= 0:
            raise ConfigError("DataPlaneConfig timeouts must be > 0")
        if self.expected_link_bytes_per_s <= 0:
            raise ConfigError("DataPlaneConfig.expected_link_bytes_per_s must be > 0")
        if self.elide_every < 0:
            raise ConfigError(f"elide_every={self.elide_every}: must be >= 0 (0: never)")

    def meshes(self, world: int) -> bool:
        """Whether the topology lets a group of ``world`` ranks use mesh schedules
        (every rank decides alike from the config)."""
        topo = self.topology
        return topo == "mesh" or (topo == "auto" and world <= self.mesh_max_world)

    def deadline_s(self, nbytes: int) -> float:
        """Deadline of one link op moving ``nbytes``."""
        return self.op_timeout_floor_s + nbytes / self.expected_link_bytes_per_s

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> DataPlaneConfig:
        """Read ``RESILIENT_SUB_CHUNK_BYTES``, ``RESILIENT_OP_TIMEOUT_S``,
        ``RESILIENT_CONNECT_TIMEOUT_S``, ``RESILIENT_RAIL_WEIGHTS`` (e.g. ``3,1``),
        ``RESILIENT_TOPOLOGY`` (auto/ring/mesh), ``RESILIENT_CHECK_MISMATCH`` (0/1),
        ``RESILIENT_LEARN_RAIL_WEIGHTS`` (0/1), ``RESILIENT_STRAGGLER_SCHEDULE`` (0/1),
        ``RESILIENT_RELAY_VIA_STORE`` (0/1), ``RESILIENT_REPAIR_LINKS`` (0/1),
        ``RESILIENT_REPAIR_TIMEOUT_S`` and ``RESILIENT_CONTROL_TRANSPORT`` and
        ``RESILIENT_DATA_TRANSPORT`` (socket/gloo), ``RESILIENT_CUDA_TRANSPORT`` (nccl/socket),
        ``RESILIENT_ELIDE_EVERY`` (an integer, default 8; 0: never).

        Raises:
            ConfigError: a variable is malformed; the message names it.
        """
        env = os.environ if env is None else env
        p = ENV_PREFIX
        weights_raw = env.get(p + "RAIL_WEIGHTS", "").strip()
        weights: tuple[float, ...] | None = None
        if weights_raw:
            try:
                weights = tuple(float(w) for w in weights_raw.split(","))
            except ValueError as exc:
                raise ConfigError(f"{p}RAIL_WEIGHTS={weights_raw!r}: not numbers") from exc
        check = _env_flag(env, p + "CHECK_MISMATCH", True)
        learn = _env_flag(env, p + "LEARN_RAIL_WEIGHTS", True)
        return cls(
            rail_weights=weights,
            sub_chunk_bytes=_env_int(env, p + "SUB_CHUNK_BYTES", 1 << 20),
            connect_timeout_s=_env_float(env, p + "CONNECT_TIMEOUT_S", 60.0),
            op_timeout_floor_s=_env_float(env, p + "OP_TIMEOUT_S", 10.0),
            check_mismatch=check,
            learn_rail_weights=learn,
            topology=env.get(p + "TOPOLOGY", "auto").strip().lower() or "auto",
            straggler_schedule=_env_flag(env, p + "STRAGGLER_SCHEDULE", True),
            relay_via_store=_env_flag(env, p + "RELAY_VIA_STORE", True),
            repair_links=_env_flag(env, p + "REPAIR_LINKS", True),
            repair_timeout_s=_env_float(env, p + "REPAIR_TIMEOUT_S", 5.0),
            control_transport=env.get(p + "CONTROL_TRANSPORT", "socket").strip().lower()
            or "socket",
            data_transport=env.get(p + "DATA_TRANSPORT", "socket").strip().lower() or "socket",
            cuda_transport=env.get(p + "CUDA_TRANSPORT", "nccl").strip().lower() or "nccl",
            elide_every=_env_int(env, p + "ELIDE_EVERY", 8),
            native_io=_env_flag(env, p + "NATIVE_IO", True),
        )


@dataclass(frozen=True, kw_only=True, slots=True)
class RecoveryConfig:
    """Rank-level recovery settings of a :class:`recovery.Session`.

    ``replace_timeout_s``: how long survivors wait for every rank (the replacement
    included) to report for the next epoch before giving up with RecoveryError.
    ``quiesce_timeout_s``: how long the group may take to finish the calls still
    queued when a peer was lost (each fails at once; a wait on a live peer can
    last up to its op deadline).
    ``shrink_after_s``: when set, survivors wait that long for a replacement and
    then go on without the missing ranks (the group shrinks), as long as at least
    ``min_ranks`` ranks are left; None never shrinks.
    ``policy``: ``replace-first`` waits for an announced replacement (up to
    ``shrink_after_s``) so a replaced run stays bitwise reproducible; ``cost``
    shrinks at once when that is estimated cheaper (see :mod:`recovery.policy`,
    which also uses ``warm_eta_s``/``cold_eta_s``, when a warm spare / a cold
    restart reports after a loss).
    ``evict_stragglers``: a confirmed straggler may leave the job when the policy
    estimates that replacing it costs less than waiting for it (it exits with
    :data:`EXIT_EVICTED`; the launcher replaces it like a crashed rank). Off by
    default: only worth it where the replacement runs elsewhere (a spare node).
    """

    replace_timeout_s: float = 60.0
    quiesce_timeout_s: float = 15.0
    shrink_after_s: float | None = None
    min_ranks: int = 1
    policy: str = "replace-first"
    warm_eta_s: float = 0.5
    cold_eta_s: float = 5.0
    evict_stragglers: bool = False

    def __post_init__(self) -> None:
        for name in ("replace_timeout_s", "quiesce_timeout_s"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"{name}={getattr(self, name)}: must be > 0")
        if self.shrink_after_s is not None and not 0 < self.shrink_after_s < math.inf:
            raise ConfigError(f"shrink_after_s={self.shrink_after_s}: must be > 0 seconds")
        if self.min_ranks < 1:
            raise ConfigError(f"min_ranks={self.min_ranks}: must be >= 1")
        if self.policy not in ("replace-first", "cost"):
            raise ConfigError(f"policy={self.policy!r}: use replace-first or cost")
        for name in ("warm_eta_s", "cold_eta_s"):
            if not 0 <= getattr(self, name) < math.inf:
                raise ConfigError(f"{name}={getattr(self, name)}: must be >= 0 seconds")

    @classmethod
    def from_env(cls, env: Mapping[str, str] | None = None) -> RecoveryConfig:
        """Read ``RESILIENT_REPLACE_TIMEOUT_S``, ``RESILIENT_QUIESCE_TIMEOUT_S``,
        ``RESILIENT_SHRINK_AFTER_S`` (unset or empty: never shrink) and
        ``RESILIENT_MIN_RANKS``, ``RESILIENT_POLICY``, ``RESILIENT_WARM_ETA_S``,
        ``RESILIENT_COLD_ETA_S`` and ``RESILIENT_EVICT_STRAGGLERS`` (0 or 1).

        Raises:
            ConfigError: a variable is malformed; the message names it.
        """
        env = os.environ if env is None else env
        p = ENV_PREFIX
        shrink = env.get(p + "SHRINK_AFTER_S", "").strip()
        return cls(
            replace_timeout_s=_env_float(env, p + "REPLACE_TIMEOUT_S", 60.0),
            quiesce_timeout_s=_env_float(env, p + "QUIESCE_TIMEOUT_S", 15.0),
            shrink_after_s=_env_float(env, p + "SHRINK_AFTER_S", 0.0) if shrink else None,
            min_ranks=_env_int(env, p + "MIN_RANKS", 1),
            policy=env.get(p + "POLICY", "").strip().lower() or "replace-first",
            warm_eta_s=_env_float(env, p + "WARM_ETA_S", 0.5),
            cold_eta_s=_env_float(env, p + "COLD_ETA_S", 5.0),
            evict_stragglers=_env_flag(env, p + "EVICT_STRAGGLERS", False),
        )


def _env_flag(env: Mapping[str, str], name: str, default: bool) -> bool:
    raw = env.get(name, "").strip().lower()
    if not raw:
        return default
    if raw not in ("0", "1", "true", "false", "yes", "no"):
        raise ConfigError(f"{name}={raw!r}: use 0 or 1")
    return raw in ("1", "true", "yes")


def env_token(env: Mapping[str, str] | None = None) -> str | None:
    """``RESILIENT_TOKEN`` (passed on by the launcher, never a flag: not in ``ps``), or None."""
    env = os.environ if env is None else env
    return env.get(ENV_PREFIX + "TOKEN") or None


def _env_int(env: Mapping[str, str], name: str, default: int | None = None) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        if default is None:
            raise ConfigError(f"environment variable {name} is required")
        return default
    try:
        return int(raw)
    except ValueError as exc:
        raise ConfigError(f"environment variable {name}={raw!r} is not an integer") from exc


def local_rank_env(env: Mapping[str, str] | None = None) -> tuple[int, str | None]:
    """LOCAL_RANK (0 when unset) and CUDA_VISIBLE_DEVICES (None when unset).

    Raises:
        ConfigError: LOCAL_RANK is not an integer.
    """
    env = os.environ if env is None else env
    return _env_int(env, "LOCAL_RANK", 0), env.get("CUDA_VISIBLE_DEVICES")


def _env_float(env: Mapping[str, str], name: str, default: float) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return float(raw)
    except ValueError as exc:
        raise ConfigError(f"environment variable {name}={raw!r} is not a number") from exc


@dataclass(frozen=True, kw_only=True, slots=True)
class RankEnv:
    """Everything a rank learns from its environment (launcher, torchrun, Slurm, k8s)."""

    rank: int
    world_size: int
    local_rank: int = 0
    local_world_size: int = 1
    master_addr: str = "127.0.0.1"
    master_port: int = 29500
    incarnation: int = 0
    job: str = "default"
    token: str | None = None
    rails: tuple[str, ...] = ()
    etcd: EtcdConfig | None = None
    lease_ttl_s: float = 5.0
    run_dir: str | None = None
    run_id: str | None = None  # one start of the job: its ranks meet in etcd under it
    fault_control: bool = False  # `resilient chaos` on loopback: apply link faults from etcd
    # How often a StepReporter writes the latest step to etcd, at most (one write per
    # rank per interval; `resilient chaos` asks for 0.02 s: it fires faults at a step).
    progress_interval_s: float = 0.25
    fence: bool = False  # RESILIENT_FENCE=1: exit (EXIT_FENCED) as the member lease may lapse

    def __post_init__(self) -> None:
        if not 0 < self.progress_interval_s < math.inf:
            raise ConfigError(
                f"{ENV_PREFIX}PROGRESS_INTERVAL_S={self.progress_interval_s}: must be > 0 seconds"
            )
        if self.world_size < 1:
            raise ConfigError(f"WORLD_SIZE={self.world_size}: must be >= 1")
        if not 0 <= self.rank < self.world_size:
            raise ConfigError(f"RANK={self.rank}: must be in [0, WORLD_SIZE={self.world_size})")
        if self.incarnation < 0:
            raise ConfigError(f"{ENV_PREFIX}INCARNATION={self.incarnation}: must be >= 0")
        validate_job_name(self.job)
        if self.run_id is not None and not _JOB_RE.match(self.run_id):
            raise ConfigError(f"{ENV_PREFIX}RUN_ID={self.run_id!r}: use letters, digits, _ . -")

    def membership(self) -> MembershipConfig:
        return MembershipConfig(job=self.job, lease_ttl_s=self.lease_ttl_s)

    @classmethod
    def from_env(
        cls,
        env: Mapping[str, str] | None = None,
        *,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> RankEnv:
        """Read RANK, WORLD_SIZE, LOCAL_*, MASTER_* and every ``RESILIENT_*`` variable.

        ``rank``/``world_size`` override the env (``init_process_group`` passes them).

        Raises:
            ConfigError: a variable is missing or malformed; the message names it.
        """
        env = os.environ if env is None else env
        p = ENV_PREFIX
        etcd = etcd_config(env[p + "ETCD"], env) if env.get(p + "ETCD") else None
        rails_raw = env.get(p + "RAILS", "")
        return cls(
            rank=rank if rank is not None else _env_int(env, "RANK"),
            world_size=world_size if world_size is not None else _env_int(env, "WORLD_SIZE"),
            local_rank=_env_int(env, "LOCAL_RANK", 0),
            local_world_size=_env_int(env, "LOCAL_WORLD_SIZE", 1),
            master_addr=env.get("MASTER_ADDR", "127.0.0.1"),
            master_port=_env_int(env, "MASTER_PORT", 29500),
            incarnation=_env_int(env, p + "INCARNATION", 0),
            job=env.get(p + "JOB", "default"),
            token=env.get(p + "TOKEN") or None,
            rails=tuple(r.strip() for r in rails_raw.split(",") if r.strip()),
            etcd=etcd,
            lease_ttl_s=_env_float(env, p + "LEASE_TTL_S", 5.0),
            run_dir=env.get(p + "RUN_DIR") or None,
            run_id=env.get(p + "RUN_ID") or None,
            fault_control=_env_flag(env, p + "FAULT_CONTROL", False),
            progress_interval_s=_env_float(env, p + "PROGRESS_INTERVAL_S", 0.25),
            fence=_env_flag(env, p + "FENCE", False),
        )


def scheduler_env(env: Mapping[str, str] | None = None) -> tuple[int | None, int | None, str]:
    """(node rank, nodes, job) under Slurm or a Kubernetes Indexed Job; None/"" where unset:
    SLURM_NODEID or JOB_COMPLETION_INDEX, SLURM_NNODES, SLURM_JOB_ID. Raises ConfigError."""
    env = os.environ if env is None else env
    node = next((n for n in ("SLURM_NODEID", "JOB_COMPLETION_INDEX") if env.get(n)), None)
    nodes = _env_int(env, "SLURM_NNODES") if env.get("SLURM_NNODES") else None
    return (_env_int(env, node) if node else None), nodes, env.get("SLURM_JOB_ID", "")
