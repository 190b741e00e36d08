"""The step API: commit a training step only when all its collectives succeeded,
and recover from a lost rank by restoring state from a live peer and replaying.

::

    pg = resilient.init()
    ddp = DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    session = Session(pg, TrainState(model, opt), warmup=lambda: train_step(0))
    for step in session.steps(1000):
        with session.step(step):
            loss = train_step(step)        # forward, backward, any collectives
        # leaving the block without an error ran opt.step(): step committed

A collective that meets a lost peer fails on every survivor; the ``with`` block
then does not commit (no optimizer step), runs the recovery and swallows the
error; :meth:`Session.steps` goes on from the step after the last one the job
committed, so the interrupted step is replayed. Recovery (see
:mod:`recovery.agree`): finish the failed step's calls, agree on the next epoch
with every rank (the replacement included) through the store, keep every link
that is intact at both ends, and send the state of the rank furthest ahead to
every rank behind it over a data-plane link (chunked, SHA-256 checked).

A replacement process (``RESILIENT_INCARNATION`` > 0) joins in :meth:`steps`: it
runs ``warmup`` twice on its own (DDP builds its buckets then, with collectives the
running ranks no longer issue), reports for the next epoch, receives the state and
trains from the replayed step. The ranks of the job run the same two passes,
together, before their first step: DDP's first iteration lays its buckets out by
parameter order and the second re-lays them by the order gradients came, so
without them a rank lost in the first step would leave the survivors on the first
layout and the replacement on the second (the same bytes, summed as different
parameters). A rank lost during those passes fails the job (RecoveryError): no
step was taken, nothing is lost but the start.

Per-rank data must be a function of (rank, step) (or be restored through
``extra``): the donor's state replaces the replacement's, RNG included.

**Shrink.** With ``RecoveryConfig.shrink_after_s`` (``RESILIENT_SHRINK_AFTER_S``),
survivors that waited that long for a replacement go on without it: the group
numbers its members anew (only links to the lost rank go), all_reduce reduces over
the members, and :attr:`Session.shard` tells each rank which part of the data is
its now (deterministic: the same on every rank). Pass the DDP module as ``ddp=``
so gradients are averaged over the members, not over the original world size.
Shrinking, growing back and evicting a straggler live in :mod:`recovery._resize`;
a replacement's joining (and its exit 0 when the job finished without it: a rank
whose :meth:`Session.steps` ran to the end says so) in :mod:`recovery.joining`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from recovery import subgroups
from recovery._resize import Resizing, link_rate
from recovery._wire import Packed, pack, size_of
from recovery.agree import Plan, Record, agree
from recovery.joining import WARMUP_PASSES, Joining, mark_finished
from recovery.policy import Policy
from recovery.replicas import check_replicas, may_hold_dtensors, replica_key
from recovery.restore import Rollback, roll_back, transfer_state
from recovery.shards import Piece, pieces
from recovery.state import (
    FsdpModules,
    StateHook,
    TrainState,
    average_over_members,
    cut_forward,
    fsdp_roots,
    reset_fsdp,
    reset_reducer,
)
from resilient import events
from resilient.config import RecoveryConfig
from resilient.errors import PeerLost, RecoveryError

__all__ = ["Rollback", "Session", "StateHook", "TrainState"]

logger = logging.getLogger(__name__)

_RECENT_STEPS = 64


class Session(Resizing, Joining):
    """Steps with commit and replay over a resilient process group (see the module doc).

    ``pg`` may be any process group: without the resilient one (e.g. gloo) steps
    just commit, and errors propagate. ``commit`` defaults to ``state.commit`` when
    the state has one. ``rollback``: where a state no peer can restore (plain
    FSDP: no replica of a rank's shards) goes back to, every rank together
    (:class:`~recovery.restore.Rollback`; without it such a state is refused).
    ``fsdp``: the FSDP2 module(s) to reset before a replayed step, where the state is
    not a TrainState of a ``fully_shard``-ed model (:func:`~recovery.state.fsdp_roots`).
    """

    def __init__(
        self,
        pg: Any,
        state: StateHook,
        *,
        commit: Callable[[], None] | None = None,
        warmup: Callable[[], Any] | None = None,
        config: RecoveryConfig | None = None,
        ddp: Any = None,
        rollback: Rollback | None = None,
        fsdp: FsdpModules | None = None,
    ) -> None:
        from resilient.process_group import ResilientProcessGroup

        self.pg = pg if isinstance(pg, ResilientProcessGroup) else None
        self.state = state
        self._commit = commit or getattr(state, "commit", None)
        self._warmup = warmup
        self.config = config or RecoveryConfig.from_env()
        self._replica = ""  # which shards this rank holds (recovery.replicas)
        self._rollback = rollback
        self._rolls_back = False  # no peer can restore the state: go back to a checkpoint
        self._fsdp = fsdp_roots(state, fsdp)
        if self.pg is not None:
            self._replica = self._sharding(state, int(pg.rank()), int(pg.size()))
            self.pg.subgroups_follow = True  # recovery.subgroups
        self.committed = -1  # the last step committed here; -1: the starting state
        self._next = 0
        self._primed = False  # the warm-up passes before the first step ran
        self.recoveries = 0
        self.replayed = 0
        self._payload: Packed | None = None
        self._rank = int(pg.rank()) if pg is not None else 0
        self._world = int(pg.size()) if pg is not None else 1
        self.policy = Policy(self.config)
        self._total = 0  # steps() target: the policy weighs the steps left
        self._step_s = 0.0  # smoothed time between commits
        # The last steps' times: a straggler's verdict comes some steps after it
        # began to slow every step, so the smoothed time already carries it; the
        # policy prices waiting for it against the step time without it.
        self._recent: deque[float] = deque(maxlen=_RECENT_STEPS)
        self._last_commit: float | None = None
        # A lost peer ends DDP's forward or backward early, and every member resets DDP's reducer
        # on entering the next epoch; the reset rebuilds DDP's buckets with a broadcast from
        # rank 0, so not in a job that may shrink (rank 0 may be the one gone).
        self._cut_backward = ddp is not None and self.config.shrink_after_s is None
        if ddp is not None and self.pg is not None:
            average_over_members(ddp, self.pg, cut_backward=self._cut_backward)
            if self._cut_backward:
                cut_forward(ddp, self.pg)  # the forward pass too
        self._ddp = ddp

    def _sharding(self, state: StateHook, rank: int, world: int) -> str:
        """This rank's replica key; sharded state (FSDP2/HSDP) is restored from a
        replica of the same shards, so every rank must have one, or the job goes
        back to its last checkpoint (``rollback``). ``state_dict()`` is asked only
        where a DTensor may be in it (:func:`~recovery.replicas.may_hold_dtensors`,
        which errs towards yes): a custom hook's may copy or gather.

        Raises:
            RecoveryError: a rank's shards have no replica (plain FSDP) and no
                ``rollback`` was given, or the job may shrink (a shrink would need
                the shards laid out anew).
        """
        if not may_hold_dtensors(state):
            return ""  # whole on every rank: no key, no replica to check
        current = state.state_dict()
        key = replica_key(current, rank)
        if key and self.config.shrink_after_s is not None:
            raise RecoveryError(
                "recovery.Session: the state is sharded (DTensors), and a shrink would need "
                "its shards laid out anew over fewer ranks: unset shrink_after_s "
                "(RESILIENT_SHRINK_AFTER_S) so a lost rank is replaced"
            )
        try:
            check_replicas(current, world)
        except RecoveryError:
            if self._rollback is None:
                raise
            self._rolls_back = True  # every rank goes back to the last checkpoint
            return ""
        return key

    @property
    def joining(self) -> bool:
        """Whether this process replaces a lost rank: its state comes from the job
        when it is admitted (in :meth:`steps`), so it loads no checkpoint itself."""
        return self.pg is not None and bool(self.pg.joining)

    @property
    def members(self) -> tuple[int, ...]:
        """The ranks training now: all of them, or fewer after a shrink."""
        return self.pg.members if self.pg is not None else tuple(range(self._world))

    @property
    def shard(self) -> tuple[int, int]:
        """``(index, count)``: this rank's share of the data is part ``index`` of
        ``count``. The same on every rank; ``(rank, world)`` until a shrink."""
        members = self.members
        return members.index(self._rank), len(members)

    def shards(self) -> list[Piece]:
        """The data this rank trains on now: its own shard whole, plus an equal part
        of each shard of a rank that left (see :mod:`recovery.shards`), so every
        row is still trained on exactly once and the members' loads stay even.
        ``[Piece(rank)]`` while every rank takes part."""
        return pieces(self._rank, self._world, self.members)

    def steps(self, total: int, *, start: int = 0) -> Iterator[int]:
        """Step numbers from ``start`` to ``total - 1``; after a recovery it goes on
        from the step after the last committed one (so a step may come twice).

        Raises:
            RecoveryError: a step was not run under :meth:`step` (it would repeat
                forever), or joining the job failed (a replacement).
            MembershipError: a replacement could not take its member key in etcd.
            SystemExit: code 0, a warm spare the launcher no longer needs, or a
                replacement that found the job finished without it.
        """
        self._total = total
        if start > self._next:
            # Resumed from a checkpoint of step ``start - 1``: that is committed.
            self._next, self.committed = start, max(self.committed, start - 1)
        if self.pg is not None and self.pg.joining:
            self._join()
        elif not self._primed:
            self._prime()
        while self._next < total:
            self._maybe_grow()
            self._judge_stragglers(self._next)
            before = (self._next, self.recoveries)
            yield self._next
            if (self._next, self.recoveries) == before:
                raise RecoveryError(
                    f"step {self._next} was not run under `with session.step({self._next}):`; "
                    "Session.steps() moves on only when a step commits or recovers"
                )
        # Every step committed: a replacement that comes now finds the job done
        # (recovery.joining), instead of waiting for this rank to report.
        if self.pg is not None:
            mark_finished(self.pg.store, epoch=self.pg.epoch, rank=self._rank, step=self.committed)

    @contextmanager
    def step(self, n: int) -> Iterator[None]:
        """Run step ``n``: commit on success; on a lost peer, recover instead.

        Raises:
            RecoveryError: the recovery itself failed (no replacement in time, a
                transfer failed); any error that is not a lost peer, unchanged.
        """
        try:
            yield
        except Exception as exc:
            lost = self.pg.lost if self.pg is not None else None
            if self.pg is None or (lost is None and not isinstance(exc, PeerLost)):
                raise
            self._recover(n, lost or exc)
            return
        if self._commit is not None:
            self._commit()
        self.committed = n
        self._next = n + 1
        now = time.monotonic()
        if self._last_commit is not None:
            took = now - self._last_commit
            self._step_s = took if self._step_s == 0 else 0.8 * self._step_s + 0.2 * took
            self._recent.append(took)
        self._last_commit = now

    def _prime(self) -> None:
        """The job's ranks run ``warmup`` twice, together, before their first step
        (see the module docstring): every rank's DDP then holds the layout a
        replacement's warm-up gives it.

        Raises:
            RecoveryError: a peer was lost during those passes.
        """
        self._primed = True
        if self.pg is None or self._warmup is None:
            return
        try:
            for _ in range(WARMUP_PASSES):
                self._warmup()
        except Exception as exc:
            lost = self.pg.lost
            if lost is None and not isinstance(exc, PeerLost):
                raise
            raise RecoveryError(
                f"rank {self._rank}: a peer was lost in the warm-up passes before step "
                f"{self._next}; the job has no step to recover"
            ) from exc

    # -- recovery --------------------------------------------------------------------
    def _recover(self, n: int, cause: BaseException) -> None:
        assert self.pg is not None
        pg, began = self.pg, time.monotonic()
        epoch = pg.epoch
        logger.warning("rank %d (epoch %d, step %d): %s; recovering", self._rank, epoch, n, cause)
        events.emit(
            "recovery.started", epoch=epoch, step=n, reason=str(cause),
            action="finish the step's calls, agree on the next epoch, restore, replay",
        )  # fmt: skip
        record, quiesced = self._stop_and_report()
        lost = cause.peer if isinstance(cause, PeerLost) else None
        plan = self._enter(record, epoch, give_up=self._shrink_check(lost, n))
        agreed = time.monotonic()
        at = self._restore(plan)  # the plan's step, or the checkpoint's (a rollback)
        self.recoveries += 1
        if n > at:
            self.replayed += n - at
            events.emit(
                "step.replayed", epoch=plan.epoch, step=at + 1,
                reason=f"step {n} was interrupted", action=f"replay from step {at + 1}",
                replayed=n - at,
            )  # fmt: skip
        done = time.monotonic()
        events.emit(
            "recovery.finished", epoch=plan.epoch, step=at + 1,
            duration_ms=(done - began) * 1e3, action=f"resume at step {at + 1}",
            # Where the time went: finishing the failed calls, waiting for every
            # rank's record (the replacement's start, or the shrink delay) and
            # entering the epoch, sending or receiving the state.
            quiesce_ms=round((quiesced - began) * 1e3, 1),
            agree_ms=round((agreed - quiesced) * 1e3, 1),
            restore_ms=round((done - agreed) * 1e3, 1),
        )  # fmt: skip

    def _stop_and_report(self) -> tuple[Record, float]:
        """Finish the epoch's calls, pack the state (a rollback sends none) and
        build this rank's record; also returns when the calls had finished.

        Raises:
            RecoveryError: the calls did not finish within ``quiesce_timeout_s``.
        """
        assert self.pg is not None
        pg = self.pg
        counters = pg.quiesce(self.config.quiesce_timeout_s)
        quiesced = time.monotonic()
        # Packed now (kilobytes: the tensors are sent from where they are), while a
        # replacement may still be starting: a donor sends once the epoch is agreed.
        self._payload = None if self._rolls_back else self._pack()
        record = Record(
            rank=self._rank, incarnation=pg.incarnation, step=self.committed,
            data=counters["data"] or [], ctl=counters["ctl"], rails_up=_rails_up(pg),
            rate=link_rate(pg, default=0.0), replica=self._replica,
        )  # fmt: skip
        return record, quiesced

    def _enter(
        self,
        record: Record,
        epoch: int,
        *,
        decide: bool = True,
        timeout_s: float | None = None,
        give_up: Callable[[], set[int]] | None = None,
        finished: Callable[[], bool] | None = None,
    ) -> Plan:
        """Agree on the epoch after ``epoch`` (recovery.agree) and enter it.

        Raises:
            JobFinished: ``finished`` (a replacement's) said the job is done.
            RecoveryError: no agreement within the timeout, or left out.
        """
        assert self.pg is not None
        plan = agree(
            self.pg.store,
            epoch=epoch,
            world=self._world,
            record=record,
            timeout_s=self.config.replace_timeout_s if timeout_s is None else timeout_s,
            expect=self.pg.members,
            decide=decide,
            shrink_after_s=self.config.shrink_after_s,
            min_ranks=self.config.min_ranks,
            give_up=give_up,
            finished=finished,
            rollback=self._rolls_back,  # the same on every rank: the layout decides it
        )
        joining = self.pg.joining
        before = plan.members if joining else self.pg.members
        kept = plan.keep_data[self._rank]
        dropped = self.pg.enter_epoch(
            plan.epoch, keep_data=kept, keep_ctl=plan.keep_ctl[self._rank], members=plan.members
        )
        subgroups.follow(plan, before, self._rank, self.config.quiesce_timeout_s)
        if self._cut_backward:
            reset_reducer(self._ddp)
        for root in self._fsdp if not joining else ():  # a replacement has no step to undo
            reset_fsdp(root)
        events.emit(
            "epoch.changed", epoch=plan.epoch, reason=_why(before, plan),
            action=f"kept {len(kept)} data link(s), dropped {dropped}",
            members=list(plan.members), kept=len(kept), dropped=dropped,
        )  # fmt: skip
        logger.info(
            "rank %d (epoch %d, step %d): receiver <- donor %s, %d link(s) dropped",
            self._rank, plan.epoch, plan.step + 1, dict(plan.donors), dropped,
        )  # fmt: skip
        return plan

    def _restore(self, plan: Plan) -> int:
        """Send, receive or await the plan's state (recovery.restore), or go back to
        the last checkpoint (a rollback); the step restored, whose next is next."""
        assert self.pg is not None
        if self._rolls_back:
            assert self._rollback is not None
            step = roll_back(self.pg, self._rollback, plan)
        else:
            transfer_state(
                self.pg, self.state, plan, payload=lambda: self._payload or self._pack(),
                wait_s=self.config.replace_timeout_s,
            )  # fmt: skip
            step = plan.step
        self._payload = None
        self.committed = step
        self._next = step + 1
        return step

    def _state_bytes(self) -> int:
        """What a rank behind would receive (for the policy's cost estimates)."""
        if self._payload is not None:
            return self._payload.nbytes
        return size_of(self.state.state_dict())

    def _pack(self) -> Packed:
        """This rank's committed step and state, as a donor sends them: a small
        header and the state's own tensors (not copied; see recovery._wire)."""
        return pack({"step": self.committed, "state": self.state.state_dict()})


def _why(before: tuple[int, ...], plan: Plan) -> str:
    """What changed between two epochs' members, for the event log."""
    gone = sorted(set(before) - set(plan.members))
    back = sorted(set(plan.members) - set(before))
    parts = []
    if plan.joined:
        parts.append(f"ranks {list(plan.joined)} replaced")
    if gone:
        parts.append(f"ranks {gone} left without a replacement; {len(plan.members)} ranks go on")
    if back:
        parts.append(f"ranks {back} back")
    return "; ".join(parts) or "peer lost"


def _rails_up(pg: Any) -> int:
    """This rank's rails whose NIC is up (links broken toward the lost rank say
    nothing about how well this rank can send)."""
    nics = getattr(pg, "nics", None)
    up = list(getattr(nics, "up", ())) or [True] * len(pg.rails)
    return sum(1 for ok in up if ok)
