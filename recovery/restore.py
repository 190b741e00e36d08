"""Moving the state after an epoch is agreed: each donor sends its state to the
ranks behind it the plan gives it (two donors serve two receivers at once), each
receiver loads it, and the ranks with no part in it wait until every receiver did.
Where no peer can restore it (plain FSDP), every rank goes back to the job's last
checkpoint instead (:class:`Rollback`)."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist

from recovery._wire import Packed, unpack
from recovery.agree import Plan
from recovery.state import StateHook
from resilient import events
from resilient.errors import RecoveryError

__all__ = ["Rollback", "await_restored", "restored_key", "roll_back", "transfer_state"]

logger = logging.getLogger(__name__)

_RESTORED_POLL_S = 0.005


def transfer_state(
    pg: Any, state: StateHook, plan: Plan, *, payload: Callable[[], Packed], wait_s: float
) -> None:
    """This rank's part in moving ``plan``'s state: send it (``payload``: this
    rank's packed state), receive and load it, or wait up to ``wait_s`` for the
    receivers (then the replayed step's calls see what went wrong).

    Raises:
        RecoveryError: the transfer failed, or the donor sent another step than
            the plan's.
    """
    rank = int(pg.rank())
    mine = [peer for peer in plan.receivers if plan.donors.get(peer) == rank]
    receiving = rank in plan.receivers
    # The links the replayed step needs are built in the background, during
    # the transfer: its own link first (ResilientProcessGroup.prebuild_links).
    pg.prebuild_links(transfers=mine or ([plan.donors[rank]] if receiving else []))
    if mine:
        sent = payload()
        for peer in mine:
            pg.send_state(peer, sent.header, sent.tensors)
    elif receiving:
        _receive(pg, state, plan, rank)
    else:
        await_restored(pg, plan, rank, wait_s)


def _receive(pg: Any, state: StateHook, plan: Plan, rank: int) -> None:
    donor = plan.donors[rank]
    began = time.monotonic()
    got: dict[str, Any] = {}

    def allocate(header: bytearray) -> list[torch.Tensor]:
        # Into this rank's own tensors where they fit: its state is given
        # up either way (it loads the donor's, or a failed transfer raises).
        received, into = unpack(header, like={"state": state.state_dict()})
        got.update(received)
        return into

    nbytes = pg.recv_state(donor, allocate)
    if int(got["step"]) != plan.step:
        raise RecoveryError(
            f"rank {rank}: donor {donor} sent step {got['step']}, planned {plan.step}"
        )
    state.load_state_dict(got["state"])
    pg.store.set(restored_key(plan.epoch, rank), "1")
    events.emit(
        "state.restored", epoch=plan.epoch, step=plan.step,
        duration_ms=(time.monotonic() - began) * 1e3,
        reason=f"{nbytes} B from rank {donor}", donor=donor, action=f"loaded step {plan.step}",
    )  # fmt: skip


def await_restored(pg: Any, plan: Plan, rank: int, wait_s: float) -> None:
    """Wait until every receiver of ``plan`` loaded its state, a peer is lost, or
    ``wait_s`` passed.

    The replayed step cannot end before the receivers' does, so a rank with no
    part in the transfer gains nothing by starting it earlier; where ranks
    share cores, its forward pass only slowed the transfer (the 100 MB
    warm-spare benchmark, 4 ranks on 2 cores: the receiver's restore took
    360-466 ms with the other two survivors computing, 234-324 ms with them
    waiting here).
    """
    keys = [restored_key(plan.epoch, r) for r in plan.receivers]
    end = time.monotonic() + wait_s
    while keys and pg.lost is None and time.monotonic() < end:
        keys = [k for k in keys if not pg.store.check([k])]
        if keys:
            time.sleep(_RESTORED_POLL_S)
    if keys:
        logger.warning(
            "rank %d (epoch %d, step %d): %s not restored (%s); replaying anyway",
            rank, plan.epoch, plan.step + 1, keys,
            "a peer was lost" if pg.lost is not None else "timed out",
        )  # fmt: skip


def restored_key(epoch: int, rank: int) -> str:
    return f"recovery/e{epoch}/restored/r{rank}"


@dataclass(frozen=True)
class Rollback:
    """Where a job whose state no peer can restore (plain FSDP: no rank holds a
    lost rank's shards) goes back to: its last checkpoint, on every rank.

    ``latest()`` names the step of the newest checkpoint this rank can load (-1:
    none); ``load(step)`` loads that checkpoint into the state on every rank (a
    collective: DCP's load is one). :class:`~recovery.session.Session` calls both
    after the next epoch is agreed, on every member, the replacement included.
    """

    latest: Callable[[], int]
    load: Callable[[int], None]


def roll_back(pg: Any, rollback: Rollback, plan: Plan) -> int:
    """Every member loads the newest checkpoint all of them have; its step.

    Raises:
        RecoveryError: no checkpoint, and some rank had committed a step since
            the start (the start cannot be restored).
    """
    began = time.monotonic()
    mine = torch.tensor([rollback.latest()], dtype=torch.int64)
    opts = dist.AllreduceOptions()
    opts.reduceOp = dist.ReduceOp(dist.ReduceOp.MIN)
    pg.allreduce([mine], opts).wait()  # a rank whose save did not end has an older one
    step = int(mine)
    if step < 0 and plan.step >= 0:
        raise RecoveryError(
            f"rank {pg.rank()} (epoch {plan.epoch}): the job's state cannot be restored from "
            f"a peer and there is no checkpoint to go back to (step {plan.step} was committed)"
        )
    if step >= 0:
        rollback.load(step)
    events.emit(
        "state.restored", epoch=plan.epoch, step=step,
        duration_ms=(time.monotonic() - began) * 1e3,
        reason=f"no peer holds every shard: checkpoint of step {step}",
        action=f"every rank loaded step {step}",
    )  # fmt: skip
    return step
