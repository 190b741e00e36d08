"""The ``"resilient"`` torch.distributed backend and the one-line ``resilient.init()``.

``dist.init_process_group("resilient")`` works wherever the usual env is set (by
``resilient run``, torchrun, Slurm or Kubernetes): RANK, WORLD_SIZE, MASTER_ADDR/PORT,
plus RESILIENT_ETCD (link rendezvous through etcd instead of the init store) and
RESILIENT_RAILS (addresses or interface names, one per rail). With RESILIENT_RUN_ID
too (``resilient run`` sets it), the backend's own rendezvous (links, subgroup
rosters) never reads the init store, and ``resilient.init()`` uses the run's etcd
store as torch's init store: no rank then depends on the machine that hosts
MASTER_ADDR's TCPStore, which ``env://`` alone still needs.
"""

from __future__ import annotations

import functools
import logging
import os
import secrets
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch.distributed as dist
from torch._C._distributed_c10d import Store

from resilient.config import ENV_PREFIX, EXIT_FENCED, DataPlaneConfig, RankEnv
from resilient.errors import ConfigError
from resilient.group.roster import agree_roster
from resilient.links.rails import resolve_rails
from resilient.process_group import ResilientProcessGroup

__all__ = [
    "BACKEND_NAME",
    "create_backend",
    "create_group",
    "init",
    "register",
    "warn_if_no_fast_path",
]

logger = logging.getLogger(__name__)

BACKEND_NAME = "resilient"
_NONCE_KEY = "resilient/link-store-nonce"


def _link_store(env: RankEnv, init_store: Store, group: str) -> Store:
    """Where the links of group ``group`` (torch's group name) rendezvous: etcd when
    configured, else the store torch gave us.

    Under a run id (RESILIENT_RUN_ID, one per start of the job: the launcher's) the
    keys live under that run in etcd and the init store is never read, so no rank
    needs the machine that hosts it. Without one the etcd prefix carries a nonce
    agreed through the init store, so keys of an earlier run of the same job name
    can never meet this run's links. With a job token (RESILIENT_TOKEN) every call
    of the etcd store checks it (a wrong token raises JobTokenMismatch).
    """
    if env.etcd is None:
        return init_store
    if env.run_id is not None:
        return run_store(env, f"g{group}")
    proposal = secrets.token_hex(8)
    nonce = init_store.compare_set(_NONCE_KEY, "", proposal).decode()
    return _etcd_store(env, f"/resilient/{env.job}/store/links-{nonce}/")


def run_store(env: RankEnv, part: str) -> Store:
    """The etcd store of ``part`` of this run (``env.run_id`` and ``env.etcd`` set)."""
    assert env.run_id is not None
    return _etcd_store(env, f"/resilient/{env.job}/store/run-{env.run_id}/{part}/")


def _etcd_store(env: RankEnv, prefix: str) -> Store:
    from membership.guarded import JobGuard
    from membership.store import EtcdStore

    assert env.etcd is not None
    guard = JobGuard.for_token(env.job, env.token) if env.token else None
    return EtcdStore(env.etcd, prefix, guard=guard)


def create_group(options: Any, backend_options: Any = None) -> ResilientProcessGroup:
    """Backend factory torch calls from ``init_process_group``, ``new_group`` and
    ``init_device_mesh`` (its extended API: ``options`` is torch's
    ``_DistributedBackendOptions``, whose ``global_ranks_in_group`` is empty for the
    world group and lists the job ranks of a subgroup).

    Raises:
        ConfigError: the RESILIENT_* environment is malformed.
        MembershipError: the world group could not join the job's membership.
    """
    return create_backend(
        options.store,
        options.group_rank,
        options.group_size,
        options.timeout,
        job_ranks=tuple(options.global_ranks_in_group) or None,
        group=str(options.group_id),
    )


def create_backend(
    store: Store,
    rank: int,
    world_size: int,
    timeout: timedelta,
    *,
    job_ranks: Sequence[int] | None = None,
    group: str = "0",
) -> ResilientProcessGroup:
    """Make the world group (``job_ranks`` None) or a subgroup of the job ranks
    ``job_ranks`` (``rank`` and ``world_size`` are then the group's); ``group`` is
    torch's name for it.

    Only the world group joins the job's membership and runs recovery; a subgroup
    (``new_group``, a DeviceMesh dimension) has links and call checks of its own
    over its members, and a lost member fails its calls with ``PeerLost``.

    Raises:
        ConfigError: the RESILIENT_* environment is malformed.
        CollectiveMismatch: ranks made their subgroups in different orders.
        StoreTimeout: a member of a subgroup did not make it in time.
        MembershipError: the world group could not join the job's membership.
    """
    env = RankEnv.from_env(rank=rank, world_size=world_size)
    config = DataPlaneConfig.from_env()
    if job_ranks is None:
        warn_if_no_fast_path(rank, config)
    if job_ranks is not None:
        return _subgroup(env, _link_store(env, store, group), config, tuple(job_ranks), timeout)
    if env.fault_control:
        if env.etcd is None:
            raise ConfigError("RESILIENT_FAULT_CONTROL=1 needs RESILIENT_ETCD (faults are in etcd)")
        from resilient.links import fault_hook

        fault_hook.install(env.etcd, env.job, env.token)
    rails = resolve_rails(env.rails, env.master_addr)
    pg = ResilientProcessGroup(
        rank=rank,
        world_size=world_size,
        rails=rails,
        store=_link_store(env, store, group),
        config=config,
        incarnation=env.incarnation,
        # A restarted rank joins a running job: recovery.Session admits it.
        joining=env.incarnation > 0,
        timeout=timeout,
    )
    if env.etcd is not None and env.token:
        join = functools.partial(_join, env, rails)
        if pg.joining:
            # A replacement becomes a member when recovery.Session admits it: a warm
            # spare built before its rank was lost must not take the member key
            # (and with it the lease watch) from the incarnation still running.
            pg.join_members_later(join)
        else:
            pg.attach_membership(join())
    logger.info(
        "rank %d/%d: resilient process group over %d rail(s) %s (job %s, epoch 0, step 0)",
        rank,
        world_size,
        len(rails),
        ",".join(rails),
        env.job,
    )
    return pg


def warn_if_no_fast_path(rank: int, config: DataPlaneConfig) -> bool:
    """Say so, loudly, when the C steps are on but not built (the install found no
    C compiler): every schedule then moves its bytes in Python, slower by several
    tens of percent on two rails (docs/BENCHMARKS.md). True if it warned."""
    from resilient.links import native_steps

    if not config.native_io or native_steps.available():
        return False
    logger.warning(
        "rank %d (epoch 0, step 0): the C fast path is OFF: resilient.links._stepio was not "
        "built (no C compiler at install?); every collective moves its bytes in Python, "
        "slower. Reinstall with a C compiler, or set RESILIENT_NATIVE_IO=0 to silence this",
        rank,
    )
    return True


def _subgroup(
    env: RankEnv,
    store: Store,
    config: DataPlaneConfig,
    job_ranks: tuple[int, ...],
    timeout: timedelta | None,
) -> ResilientProcessGroup:
    """A subgroup of ``job_ranks`` whose members meet in ``store`` (its link store):
    no membership join, no fault hook of its own (the world group's serves the
    process). A replacement's (incarnation > 0) meets the survivors' subgroup of the
    same name (it makes its groups in the same order), and is admitted with the
    world group (recovery.subgroups)."""
    agree_roster(store, env.rank, job_ranks, config.connect_timeout_s)
    rails = resolve_rails(env.rails, env.master_addr)
    pg = ResilientProcessGroup(
        rank=env.rank,
        world_size=env.world_size,
        rails=rails,
        store=store,
        config=config,
        job_ranks=job_ranks,
        timeout=timeout,
        # A replacement's subgroups run their calls alone until recovery.Session
        # admits it into the world group's next epoch; they follow it there.
        incarnation=env.incarnation,
        joining=env.incarnation > 0,
    )
    logger.info(
        "rank %d (group rank %d/%d): resilient subgroup of ranks %s over %d rail(s) "
        "(job %s, epoch 0, step 0)",
        job_ranks[env.rank], env.rank, env.world_size, list(job_ranks), len(rails), env.job,
    )  # fmt: skip
    return pg


def _join(env: RankEnv, rails: Sequence[str]) -> Any:
    """Hold this rank's member key under a lease: a supervisor that sees it expire
    while the process still runs knows the rank hung (SIGSTOP, a frozen host). With
    ``env.fence`` (``RESILIENT_FENCE=1``) the rank ends itself once that lease may
    have lapsed (:func:`_fenced`).

    Raises:
        MembershipError: etcd refused or the token does not match the job's.
    """
    from membership.members import Membership

    assert env.etcd is not None and env.token is not None
    member = Membership(env.etcd, env.membership())
    try:
        member.join(env.rank, env.incarnation, rails, env.token)
        if env.fence:
            member.watch_lease(functools.partial(_fenced, env))
    except BaseException:
        member.close()
        raise
    return member


def _fenced(env: RankEnv, why: str) -> None:
    """This rank's member lease may have lapsed in etcd (called from its watchdog
    thread): end the process now, so that no rank a spare node or the node's own
    agent starts in its place is admitted beside it. Its agent fences it too, but
    may be stopped or cut off itself."""
    from resilient import events

    logger.critical(
        "rank %d (incarnation %d) of job %s fenced: %s; exiting with %d",
        env.rank, env.incarnation, env.job, why, EXIT_FENCED,
    )  # fmt: skip
    events.emit(
        "rank.fenced", rank=env.rank, incarnation=env.incarnation, reason=why,
        action=f"exit with {EXIT_FENCED}: no replacement may run beside this rank",
    )  # fmt: skip
    events.exit_now(EXIT_FENCED)


def _init_store(kwargs: dict[str, Any]) -> dict[str, Any]:
    """``kwargs`` for ``init_process_group``: under a run id in etcd (``resilient run``
    sets RESILIENT_RUN_ID and RESILIENT_ETCD) and with no store or init_method given,
    torch's init store is the run's etcd store, so a rank starts (or restarts) with no
    TCPStore on any machine; otherwise as given (``env://``: MASTER_ADDR's store)."""
    if "store" in kwargs or "init_method" in kwargs or not os.environ.get(ENV_PREFIX + "RUN_ID"):
        return kwargs  # RANK may be unset here: torch's env:// or the caller names it
    env = RankEnv.from_env(rank=kwargs.get("rank"), world_size=kwargs.get("world_size"))
    if env.etcd is None:
        return kwargs
    return {**kwargs, "store": run_store(env, "init"), "rank": env.rank,
            "world_size": env.world_size}  # fmt: skip


def register() -> None:
    """Register the ``"resilient"`` backend with torch.distributed (idempotent)."""
    if BACKEND_NAME in dist.Backend.backend_list:
        return
    dist.Backend.register_backend(
        BACKEND_NAME, create_group, devices=["cpu", "cuda"], extended_api=True
    )


def init(**kwargs: Any) -> ResilientProcessGroup:
    """Register the backend and ``init_process_group("resilient", **kwargs)``.

    Returns the world group. Extra ``kwargs`` go to ``init_process_group``. With CUDA
    available, the rank's device is made current first (``torch.cuda.set_device``):
    ``device_id`` if given, else ``cuda:LOCAL_RANK``; with
    ``RESILIENT_CUDA_TRANSPORT=socket`` ranks may share GPUs (LOCAL_RANK mod the
    count). See :mod:`resilient.group.cuda_device`.

    Raises:
        ConfigError: the RESILIENT_* environment (or RANK, WORLD_SIZE under a run
            id) is malformed, or LOCAL_RANK names no visible GPU while CUDA tensors
            take NCCL links.
        RuntimeError: the default group was made with another backend.
    """
    register()
    if not dist.is_initialized():
        from resilient.group.cuda_device import select_device

        select_device(kwargs.get("device_id"), DataPlaneConfig.from_env())
        dist.init_process_group(BACKEND_NAME, **_init_store(kwargs))
    group = dist.group.WORLD
    if not isinstance(group, ResilientProcessGroup):
        raise RuntimeError(
            f"the default process group is {type(group).__name__}, not the resilient one; "
            "was init_process_group called with another backend first?"
        )
    return group
