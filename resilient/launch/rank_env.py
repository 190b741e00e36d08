"""The environment variables the local launcher sets for each rank, and their help."""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum
from types import MappingProxyType
from typing import Final

from resilient.config import ENV_PREFIX

__all__ = ["RANK_VAR_HELP", "RankVar"]


class RankVar(StrEnum):
    """Every environment variable the launcher sets for a rank.

    The names are the ones :meth:`resilient.config.RankEnv.from_env` reads, plus two
    for the Python and torch runtimes. :data:`RANK_VAR_HELP` describes each one.
    """

    RANK = "RANK"
    WORLD_SIZE = "WORLD_SIZE"
    LOCAL_RANK = "LOCAL_RANK"
    LOCAL_WORLD_SIZE = "LOCAL_WORLD_SIZE"
    MASTER_ADDR = "MASTER_ADDR"
    MASTER_PORT = "MASTER_PORT"
    ETCD = ENV_PREFIX + "ETCD"
    JOB = ENV_PREFIX + "JOB"
    TOKEN = ENV_PREFIX + "TOKEN"
    RAILS = ENV_PREFIX + "RAILS"
    INCARNATION = ENV_PREFIX + "INCARNATION"
    LEASE_TTL_S = ENV_PREFIX + "LEASE_TTL_S"
    RUN_DIR = ENV_PREFIX + "RUN_DIR"
    RUN_ID = ENV_PREFIX + "RUN_ID"
    FAULT_CONTROL = ENV_PREFIX + "FAULT_CONTROL"
    MIN_RANKS = ENV_PREFIX + "MIN_RANKS"
    SHRINK_AFTER_S = ENV_PREFIX + "SHRINK_AFTER_S"
    EVICT_STRAGGLERS = ENV_PREFIX + "EVICT_STRAGGLERS"
    PYTHONUNBUFFERED = "PYTHONUNBUFFERED"
    TORCH_DISABLE_SHARE_RDZV_TCP_STORE = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
    TORCHELASTIC_USE_AGENT_STORE = "TORCHELASTIC_USE_AGENT_STORE"


RANK_VAR_HELP: Final[Mapping[RankVar, str]] = MappingProxyType(
    {
        RankVar.RANK: "global rank id, 0..WORLD_SIZE-1; a restarted rank keeps its id",
        RankVar.WORLD_SIZE: "number of ranks in the job: --nnodes x --nproc-per-node",
        RankVar.LOCAL_RANK: "rank id on this machine "
        "(RANK = node rank x LOCAL_WORLD_SIZE + LOCAL_RANK)",
        RankVar.LOCAL_WORLD_SIZE: "ranks on this machine (--nproc-per-node)",
        RankVar.MASTER_ADDR: "where torch's init store is: 127.0.0.1, or node 0's "
        "--master-addr with --nnodes > 1 (not fault tolerant: README, many machines)",
        RankVar.MASTER_PORT: "a free TCP port, the same for every rank and restart",
        RankVar.ETCD: "etcd client URL(s), comma-separated (--etcd or the embedded one)",
        RankVar.JOB: "job name (--job), the key prefix of the job in etcd",
        RankVar.TOKEN: "secret shared by the ranks of this job (random per launch unless "
        "RESILIENT_TOKEN is set in the launcher's environment, to re-join an existing job)",
        RankVar.RAILS: "this rank's rail addresses, comma-separated: 127.0.<rail+1>.<rank+1>, "
        "or the interface names given to --rails",
        RankVar.INCARNATION: "0 at first start, +1 each time this rank is restarted",
        RankVar.LEASE_TTL_S: "seconds a silent rank stays listed in etcd (--lease-ttl)",
        RankVar.RUN_DIR: "directory for event logs and run state (only with --run-dir)",
        RankVar.RUN_ID: "this start of the job (random, the same on every node and restart): "
        "ranks meet in etcd under it, so no rank needs MASTER_ADDR's store to start "
        "when it calls resilient.init()",
        RankVar.FAULT_CONTROL: "1 when 'resilient chaos' injects link faults in-process "
        "through etcd (loopback runs without root); unset otherwise",
        RankVar.MIN_RANKS: "fewest ranks the job may shrink to (only with --min-ranks)",
        RankVar.SHRINK_AFTER_S: "seconds survivors wait for a replacement before they go "
        "on without it (--shrink-after; only with --min-ranks)",
        RankVar.EVICT_STRAGGLERS: "1: a confirmed straggler may leave the job to be "
        "replaced when the policy finds that cheaper (--evict-stragglers)",
        RankVar.PYTHONUNBUFFERED: "1, so that output reaches the launcher line by line",
        RankVar.TORCH_DISABLE_SHARE_RDZV_TCP_STORE: (
            "1, so that torch's own rendezvous survives a restart (pytorch issue 135712)"
        ),
        RankVar.TORCHELASTIC_USE_AGENT_STORE: "True: the launcher (node 0's) hosts the TCPStore at "
        "MASTER_ADDR:MASTER_PORT, so it outlives every rank, rank 0 included (as torchrun)",
    }
)

_RANK_VAR_NAMES: Final = frozenset(var.value for var in RankVar)
