"""Chaos scenario files (TOML): the job, the faults to inject, what must hold after.

::

    [job]
    script = "examples/train_ddp.py"
    args = ["--steps", "200"]
    nproc = 4                 # or nodes = 2, ranks_per_node = 2 (spare_nodes = 1): agents
    rails = 2
    steps = 200               # passed as --steps unless args hold it; scripts take --seed too
    topology = "netns"        # or "loopback"
    seed = 0
    max_restarts = 3          # the launcher's restart budget
    warm_spares = false       # a standby per rank that already imported torch
    min_ranks = 3             # elastic shrink: go on without a lost rank (default: off)
    shrink_after_s = 10.0     # how long survivors wait for a replacement first
    etcd_members = 1          # 3 for an etcd-kill of one member of three
    etcd_security = false     # etcd over TLS with client certs and user/password auth
    timeout_s = 600.0         # the run is stopped (and fails) after this

    [[fault]]
    kind = "nic-down"
    rank = 1
    rail = 0
    at_step = 50              # or at_s = 12.5 (exactly one of the two)
    duration_s = 5.0

    [expect]
    completes = true
    max_steps_replayed = 0
    params_equal_across_ranks = true

A malformed file raises :class:`ScenarioError`, whose ``key`` names the offending
key (``fault[2].rate_mbit``) and whose message says what is wrong with it.
"""

from __future__ import annotations

import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from resilient.errors import ConfigError

__all__ = [
    "FAULT_KINDS",
    "NODE_KINDS",
    "Expectations",
    "Fault",
    "JobSpec",
    "Scenario",
    "ScenarioError",
    "load",
    "parse",
]


class ScenarioError(ConfigError):
    """A scenario file is malformed; ``key`` names where (e.g. ``fault[1].rank``)."""

    def __init__(self, source: str, key: str, problem: str) -> None:
        super().__init__(f"{source}: {key}: {problem}")
        self.source, self.key, self.problem = source, key, problem


# kind -> (required parameters, optional parameters); every kind also takes the
# common keys below. A parameter's type is checked by _PARAM_TYPES.
FAULT_KINDS: dict[str, tuple[frozenset[str], frozenset[str]]] = {
    "kill": (frozenset({"rank"}), frozenset()),
    "hang": (frozenset({"rank"}), frozenset()),
    "slow": (frozenset({"rank", "factor"}), frozenset({"pin"})),
    "slow-cpu": (frozenset({"rank", "factor"}), frozenset({"pin", "cpus"})),
    "nic-down": (frozenset({"rank", "rail"}), frozenset()),
    "nic-up": (frozenset({"rank", "rail"}), frozenset()),
    "flap": (frozenset({"rank", "rail", "period_s"}), frozenset({"count"})),
    "throttle": (frozenset({"rank", "rail", "rate_mbit"}), frozenset()),
    "slow-link": (frozenset({"rank", "peer", "rail", "rate_mbit"}), frozenset()),
    "drop": (frozenset({"rank", "rail", "percent"}), frozenset()),
    "partition": (frozenset({"rank", "peer", "rail"}), frozenset()),
    "etcd-kill": (frozenset(), frozenset({"member"})),
    "node-kill": (frozenset({"node"}), frozenset()),
    "node-partition": (frozenset({"node"}), frozenset()),
    "etcd-leader-kill": (frozenset(), frozenset()),
}
# Faults on a whole node (a [job] with ``nodes``): the parser adds ``ranks``, the
# node's global ranks, for the report's attribution.
NODE_KINDS = frozenset({"node-kill", "node-partition"})
# Faults that reach ranks on the loopback testbed only through the launcher's
# in-process fault hook, which node agents started as ``resilient run`` lack.
_HOOK_KINDS = frozenset(
    {"nic-down", "nic-up", "flap", "throttle", "slow-link", "drop", "partition", "node-partition"}
)
_COMMON = frozenset({"kind", "at_step", "at_s", "duration_s", "max_detect_ms"})
_PARAM_TYPES: dict[str, type] = {
    "max_detect_ms": float,
    "rank": int,
    "peer": int,
    "rail": int,
    "member": int,
    "node": int,
    "count": int,
    "at_step": int,
    "at_s": float,
    "duration_s": float,
    "period_s": float,
    "factor": float,
    "cpus": float,
    "rate_mbit": float,
    "percent": float,
    "pin": bool,
}
_EXPECT_TYPES: dict[str, type] = {
    "completes": bool,
    "max_steps_replayed": int,
    "params_equal_across_ranks": bool,
    "params_equal_fault_free": bool,
    "params_close_fault_free": float,
    "max_recovery_s": float,
    "max_detect_ms": float,
    "max_detect_steps": int,
    "max_slowdown": float,
    "straggler_confirmed_within_steps": int,
    "min_fast_path_share": float,
}
_JOB_TYPES: dict[str, type] = {
    "script": str,
    "args": list,
    "nproc": int,
    "nodes": int,
    "ranks_per_node": int,
    "spare_nodes": int,
    "rails": int,
    "steps": int,
    "topology": str,
    "seed": int,
    "max_restarts": int,
    "warm_spares": bool,
    "evict_stragglers": bool,
    "min_ranks": int,
    "shrink_after_s": float,
    "etcd_members": int,
    "etcd_security": bool,
    "timeout_s": float,
}


@dataclass(frozen=True, kw_only=True, slots=True)
class JobSpec:
    """The job; ``nproc`` is always the world size. With ``nodes`` (2 or more) the
    job runs one ``resilient run`` agent per node with ``ranks_per_node`` ranks each,
    global rank ``K * ranks_per_node + L`` on node K, host K of the testbed, and
    ``spare_nodes`` more agents (``resilient run --spare``) on the hosts after them
    stand by to take a lost node over. Without
    (``nodes = 1``) one launcher runs every rank, one rank per testbed host."""

    script: str
    args: tuple[str, ...] = ()
    nproc: int = 4
    nodes: int = 1
    ranks_per_node: int = 1
    spare_nodes: int = 0
    rails: int = 1
    steps: int = 100
    topology: str = "loopback"
    seed: int = 0
    max_restarts: int = 3
    warm_spares: bool = False
    evict_stragglers: bool = False
    min_ranks: int | None = None
    shrink_after_s: float = 10.0
    etcd_members: int = 1
    etcd_security: bool = False
    timeout_s: float = 600.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Fault:
    """One fault: ``kind``, when (``at_step`` or ``at_s``), for how long, and its
    parameters (rank, rail, peer, rate_mbit, ...) in ``params``."""

    kind: str
    at_step: int | None = None
    at_s: float | None = None
    duration_s: float | None = None
    # This fault's own detection bound (a throttle takes a few calls to show),
    # instead of the scenario's ``expect.max_detect_ms``.
    max_detect_ms: float | None = None
    params: Mapping[str, Any] = field(default_factory=dict)

    def param(self, name: str, default: Any = None) -> Any:
        return self.params.get(name, default)


@dataclass(frozen=True, kw_only=True, slots=True)
class Expectations:
    """What must hold after the run; None means "not checked"."""

    completes: bool = True
    max_steps_replayed: int | None = None
    params_equal_across_ranks: bool | None = None
    params_equal_fault_free: bool | None = None
    # Relative tolerance on every rank's final per-tensor parameter norms against the
    # fault-free run's (for faults that change the schedule, hence the rounding).
    params_close_fault_free: float | None = None
    max_recovery_s: float | None = None
    max_detect_ms: float | None = None
    # The same in training steps: from the step the fault fired at to the furthest
    # step any rank had reached when its detection was logged (a slow link's
    # bound is in steps, as a straggler's is).
    max_detect_steps: int | None = None
    max_slowdown: float | None = None
    straggler_confirmed_within_steps: int | None = None
    # Rail passes moved whole in C / all, outside every fault's window, summed over
    # ranks: checked on 2+ rails where the C module is built; 0 only reports it.
    # 0: report only (the default while the straggler-aware schedule is Python's).
    min_fast_path_share: float = 0.0


@dataclass(frozen=True, kw_only=True, slots=True)
class Scenario:
    name: str
    job: JobSpec
    faults: tuple[Fault, ...]
    expect: Expectations


def _typed(source: str, key: str, value: Any, want: type) -> Any:
    """Check ``value`` against ``want``; ints are accepted where floats are wanted."""
    if want is float and isinstance(value, int) and not isinstance(value, bool):
        return float(value)
    if want is int and isinstance(value, bool):
        raise ScenarioError(source, key, f"expected an integer, got {value!r}")
    if not isinstance(value, want):
        raise ScenarioError(source, key, f"expected {want.__name__}, got {value!r}")
    return value


def _table(source: str, key: str, raw: Any) -> dict[str, Any]:
    if not isinstance(raw, dict):
        raise ScenarioError(source, key, "must be a table")
    return raw


def _no_unknown(source: str, prefix: str, raw: Mapping[str, Any], known: frozenset[str]) -> None:
    for key in sorted(set(raw) - known):
        raise ScenarioError(
            source, f"{prefix}{key}", f"unknown key (expected one of: {', '.join(sorted(known))})"
        )


def _parse_job(source: str, raw: Any) -> JobSpec:
    job = _table(source, "job", raw)
    _no_unknown(source, "job.", job, frozenset(_JOB_TYPES))
    if "script" not in job:
        raise ScenarioError(source, "job.script", "missing (the training script to run)")
    values = {k: _typed(source, f"job.{k}", v, _JOB_TYPES[k]) for k, v in job.items()}
    args = values.pop("args", [])
    for i, a in enumerate(args):
        _typed(source, f"job.args[{i}]", a, str)
    _node_counts(source, values)
    spec = JobSpec(args=tuple(args), **values)
    for key in ("nproc", "rails", "steps", "etcd_members", "timeout_s"):
        if getattr(spec, key) <= 0:
            raise ScenarioError(source, f"job.{key}", f"must be >= 1, got {getattr(spec, key)}")
    if spec.max_restarts < 0:
        raise ScenarioError(source, "job.max_restarts", f"must be >= 0, got {spec.max_restarts}")
    if spec.evict_stragglers and spec.max_restarts < 1 and spec.min_ranks is None:
        why = "an evicted rank must be replaced or left out: set max_restarts >= 1 or min_ranks"
        raise ScenarioError(source, "job.evict_stragglers", why)
    if spec.min_ranks is not None and not 1 <= spec.min_ranks <= spec.nproc:
        raise ScenarioError(
            source, "job.min_ranks", f"must be 1..nproc ({spec.nproc}), got {spec.min_ranks}"
        )
    if not spec.shrink_after_s > 0:
        raise ScenarioError(source, "job.shrink_after_s", f"must be > 0, got {spec.shrink_after_s}")
    if spec.topology not in ("netns", "loopback"):
        raise ScenarioError(
            source, "job.topology", f"must be netns or loopback, got {spec.topology!r}"
        )
    if spec.nodes > 1:
        _check_node_job(source, spec)
    return spec


def _node_counts(source: str, values: dict[str, Any]) -> None:
    """With ``nodes``: check it and ``ranks_per_node``, and set ``nproc`` to the
    world size (``nproc`` itself is refused there: it would be ambiguous)."""
    if "nodes" not in values:
        for key in ("ranks_per_node", "spare_nodes"):
            if key in values:
                raise ScenarioError(source, f"job.{key}", "only with nodes (node agents)")
        return
    if values.get("spare_nodes", 0) < 0:
        raise ScenarioError(source, "job.spare_nodes", f"must be >= 0, got {values['spare_nodes']}")
    nodes = values["nodes"]
    if nodes < 2:
        raise ScenarioError(
            source, "job.nodes", f"must be >= 2 (leave it out for one launcher), got {nodes}"
        )
    if "nproc" in values:
        raise ScenarioError(
            source, "job.nproc",
            "not with nodes: give ranks_per_node (the world size is nodes x ranks_per_node)",
        )  # fmt: skip
    per = values.get("ranks_per_node")
    if per is None:
        raise ScenarioError(source, "job.ranks_per_node", "missing (ranks on each node)")
    if per < 1:
        raise ScenarioError(source, "job.ranks_per_node", f"must be >= 1, got {per}")
    values["nproc"] = nodes * per
    # Machines with their own control plane: etcd as deployed, three members.
    values.setdefault("etcd_members", 3)


def _check_node_job(source: str, spec: JobSpec) -> None:
    """What the node agents (``resilient run --nnodes``) cannot do from a scenario."""
    if spec.warm_spares:
        why = "not with nodes: the runner cannot tell when another agent's spares stand ready"
        raise ScenarioError(source, "job.warm_spares", why)
    if spec.evict_stragglers:
        why = "not with nodes: resilient run refuses --evict-stragglers with --nnodes > 1"
        raise ScenarioError(source, "job.evict_stragglers", why)


def _parse_fault(source: str, index: int, raw: Any, job: JobSpec) -> Fault:
    where = f"fault[{index}]"
    fault = _table(source, where, raw)
    kind = fault.get("kind")
    if kind not in FAULT_KINDS:
        raise ScenarioError(
            source, f"{where}.kind", f"must be one of {', '.join(FAULT_KINDS)}, got {kind!r}"
        )
    required, optional = FAULT_KINDS[kind]
    _no_unknown(source, f"{where}.", fault, _COMMON | required | optional)
    for key in sorted(required - set(fault)):
        raise ScenarioError(source, f"{where}.{key}", f"missing (a {kind} fault needs it)")
    values = {
        k: _typed(source, f"{where}.{k}", v, _PARAM_TYPES[k])
        for k, v in fault.items()
        if k != "kind"
    }
    if ("at_step" in values) == ("at_s" in values):
        raise ScenarioError(source, f"{where}.at_step", "give exactly one of at_step or at_s")
    _check_ranges(source, where, values, job)
    _check_node_fault(source, where, kind, values, job)
    params = {k: v for k, v in values.items() if k not in _COMMON}
    if kind in NODE_KINDS:
        first = values["node"] * job.ranks_per_node
        params["ranks"] = tuple(range(first, first + job.ranks_per_node))
    return Fault(
        kind=kind,
        at_step=values.get("at_step"),
        at_s=values.get("at_s"),
        duration_s=values.get("duration_s"),
        max_detect_ms=values.get("max_detect_ms"),
        params=params,
    )


def _check_ranges(source: str, where: str, v: Mapping[str, Any], job: JobSpec) -> None:
    limits: dict[str, tuple[float, float, str]] = {
        "rank": (0, job.nproc - 1, f"a rank of the job (0..{job.nproc - 1})"),
        "peer": (0, job.nproc - 1, f"a rank of the job (0..{job.nproc - 1})"),
        "rail": (0, job.rails - 1, f"a rail of the job (0..{job.rails - 1})"),
        "at_step": (0, job.steps - 1, f"a step of the job (0..{job.steps - 1})"),
        "factor": (1e-9, 1.0 - 1e-9, "a fraction of normal speed, 0 < factor < 1"),
        "percent": (0.0, 100.0, "a percentage, 0..100"),
        "member": (0, job.etcd_members - 1, f"an etcd member (0..{job.etcd_members - 1})"),
        "node": (0, job.nodes - 1, f"a node of the job (0..{job.nodes - 1})"),
    }
    for key, (lo, hi, what) in limits.items():
        if key in v and not lo <= v[key] <= hi:
            raise ScenarioError(source, f"{where}.{key}", f"must be {what}, got {v[key]}")
    for key in ("at_s", "duration_s", "period_s", "rate_mbit", "count"):
        if key in v and v[key] < 0:
            raise ScenarioError(source, f"{where}.{key}", f"must be >= 0, got {v[key]}")
    if "peer" in v and v.get("peer") == v.get("rank"):
        raise ScenarioError(source, f"{where}.peer", "must differ from rank")


def _check_node_fault(
    source: str, where: str, kind: str, v: Mapping[str, Any], job: JobSpec
) -> None:
    """Node faults need nodes; on several nodes a rank's network fault hits its host
    (every rank there), so two ranks of one host cannot be cut apart."""
    if kind in NODE_KINDS and job.nodes < 2:
        raise ScenarioError(source, f"{where}.kind", f"{kind} needs [job] nodes >= 2")
    if kind == "etcd-leader-kill" and job.etcd_members < 3:
        why = f"needs [job] etcd_members >= 3 to elect another leader, got {job.etcd_members}"
        raise ScenarioError(source, f"{where}.kind", why)
    if job.nodes < 2:
        return
    if job.topology == "loopback" and kind in _HOOK_KINDS:
        why = f'{kind} with nodes needs topology = "netns" (node agents have no fault hook)'
        raise ScenarioError(source, f"{where}.kind", why)
    per = job.ranks_per_node
    if "peer" in v and v["peer"] // per == v.get("rank", -per) // per:
        node = v["peer"] // per
        why = f"rank {v.get('rank')} and peer {v['peer']} share node {node}: no link to cut"
        raise ScenarioError(source, f"{where}.peer", why)


def _parse_expect(source: str, raw: Any) -> Expectations:
    expect = _table(source, "expect", raw)
    _no_unknown(source, "expect.", expect, frozenset(_EXPECT_TYPES))
    values = {k: _typed(source, f"expect.{k}", v, _EXPECT_TYPES[k]) for k, v in expect.items()}
    tol = values.get("params_close_fault_free")
    if tol is not None and not 0 < tol < 1:
        raise ScenarioError(
            source, "expect.params_close_fault_free", f"a relative tolerance in (0, 1), got {tol}"
        )
    share = values.get("min_fast_path_share")
    if share is not None and not 0 <= share <= 1:
        raise ScenarioError(
            source,
            "expect.min_fast_path_share",
            f"a fraction in [0, 1] (0: report only), got {share}",
        )
    return Expectations(**values)


def parse(text: str, *, source: str = "<scenario>") -> Scenario:
    """Parse scenario TOML text.

    Raises:
        ScenarioError: invalid TOML, an unknown/missing key, a wrong type or range.
    """
    try:
        raw = tomllib.loads(text)
    except tomllib.TOMLDecodeError as exc:
        raise ScenarioError(source, "(syntax)", f"not valid TOML: {exc}") from exc
    _no_unknown(source, "", raw, frozenset({"name", "job", "fault", "expect"}))
    if "job" not in raw:
        raise ScenarioError(source, "job", "missing the [job] table")
    job = _parse_job(source, raw["job"])
    faults_raw = raw.get("fault", [])
    if not isinstance(faults_raw, list):
        raise ScenarioError(source, "fault", "must be an array of tables ([[fault]])")
    faults = tuple(_parse_fault(source, i, f, job) for i, f in enumerate(faults_raw))
    expect = _parse_expect(source, raw.get("expect", {}))
    name = _typed(source, "name", raw.get("name", Path(source).stem), str)
    return Scenario(name=name, job=job, faults=faults, expect=expect)


def load(path: str | Path) -> Scenario:
    """Read and parse a scenario file.

    Raises:
        ScenarioError: the file is unreadable or malformed (the key is named).
    """
    p = Path(path)
    try:
        text = p.read_text()
    except OSError as exc:
        raise ScenarioError(str(p), "(file)", f"cannot read: {exc.strerror}") from exc
    return parse(text, source=str(p))
