"""How a replacement joins the job, kept apart from the step API
(:mod:`recovery.session`): its warm-up alone, its admission at the members'
recovery (or, the group shrank, at a step boundary after it asked), and the job
that finished without it. Mixed into :class:`~recovery.session.Session`.

**A job that finished without it.** A rank killed or hung at the job's last step
(after its part of the last calls) is replaced once its peers finished every
step and left: nobody is left to admit the replacement, which would wait for
them until ``replace_timeout_s`` and fail the job. So a rank whose
:meth:`~recovery.session.Session.steps` ran to its end (every step committed)
writes ``recovery/e<epoch>/done/r<rank>`` (:func:`mark_finished`), and its group's
shutdown then records its departure in its health record (``left``:
:meth:`~resilient.detect.health_board.HealthBoard.leave`). A replacement waiting
at epoch E takes the job as finished (:func:`job_finished`) when every other
member of E has both. Neither alone will do: ``leave`` runs at every shutdown
(a rank that failed mid-job and shut its group down in a ``finally`` or at
exit has ``left``, and no marker), and a rank with the marker that has not left
may still train (a second ``steps()`` loop). Members that are replacements
waiting at E themselves (two ranks lost at the end) are not waited for, once at
least one member finished. The replacement then exits 0, as a warm spare the
launcher no longer needs does: the launcher counts the rank as done.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Final, NoReturn

from torch._C._distributed_c10d import Store

from membership.epoch import current_epoch, epoch_record
from recovery.agree import NO_STATE, Plan, Record, request_join
from resilient import events
from resilient.collectives.solo import SoloEngine
from resilient.config import RecoveryConfig
from resilient.detect.health_board import left_after
from resilient.errors import JobFinished, RecoveryError
from resilient.launch import standby as standby

__all__ = ["WARMUP_PASSES", "Joining", "finished_check", "job_finished", "mark_finished"]

logger = logging.getLogger(__name__)

WARMUP_PASSES: Final = 2  # DDP lays its buckets out twice (recovery.session's doc)
# How often a waiting replacement looks whether the job finished: a few store
# reads per member, so not on every 10 ms round of agree's loop.
_LOOK_S: Final = 0.25


def _done_key(epoch: int, rank: int) -> str:
    return f"recovery/e{epoch}/done/r{rank}"


def mark_finished(store: Store, *, epoch: int, rank: int, step: int) -> None:
    """Record that ``rank`` committed every step of the job (its last is ``step``)
    in ``epoch`` (never raises: a replacement then waits out its timeout, as before)."""
    try:
        store.set(_done_key(epoch, rank), json.dumps({"step": step}))
    except Exception:  # the job's steps are done whatever the store says
        logger.warning(
            "rank %d (epoch %d, step %d): recording the job's end failed", rank, epoch, step,
            exc_info=True,
        )  # fmt: skip


def job_finished(store: Store, *, epoch: int, world: int, me: int) -> bool:
    """Whether every member of ``epoch`` but ``me`` (and replacements waiting at
    ``epoch``) committed every step and shut its group down (module doc). False
    when the store does not answer: the caller's timeout still stands."""
    try:
        record = epoch_record(store, epoch) if epoch > 0 else {"members": range(world)}
        if record is None:  # not written yet (a store without transactions)
            return False
        members = [int(r) for r in record["members"]]
        finished = 0
        for pos, rank in enumerate(members):
            if rank == me:
                continue
            if store.check([_done_key(epoch, rank)]):
                if left_after(store, epoch, pos) is None:
                    return False  # finished its steps, but its group is still up
                finished += 1
            elif not _waiting_replacement(store, epoch, rank):
                return False  # training, recovering, or failed: not an orderly end
        return finished > 0
    except Exception as exc:  # an outage: look again at the next round
        logger.debug("rank %d (epoch %d): looking for the job's end failed: %s", me, epoch, exc)
        return False


def _waiting_replacement(store: Store, epoch: int, rank: int) -> bool:
    """Whether ``rank``'s record at ``epoch`` is a replacement's (it holds no state)."""
    key = f"recovery/e{epoch}/r{rank}"
    return bool(store.check([key])) and Record.from_json(bytes(store.get(key))).step == NO_STATE


def finished_check(
    store: Store, *, epoch: int, world: int, me: int, every_s: float = _LOOK_S
) -> Callable[[], bool]:
    """:func:`job_finished`, looked at no more often than every ``every_s``."""
    next_look = 0.0

    def check() -> bool:
        nonlocal next_look
        now = time.monotonic()
        if now < next_look:
            return False
        next_look = now + every_s
        return job_finished(store, epoch=epoch, world=world, me=me)

    return check


class Joining:
    """Mixed into :class:`~recovery.session.Session`."""

    if TYPE_CHECKING:  # the session's own state and methods (never shadowed at run time)
        pg: Any
        config: RecoveryConfig
        _rank: int
        _world: int
        _next: int
        _primed: bool
        _replica: str
        _warmup: Callable[[], Any] | None

        _enter: Callable[..., Plan]  # Session._enter

        def _restore(self, plan: Plan) -> int: ...

    def _join(self) -> None:
        """A replacement: warm DDP up alone (a warm spare then waits for its rank to
        be lost), take the member key, report, receive the state.

        Raises:
            SystemExit: code 0, the job finished without it (module doc).
        """
        assert self.pg is not None
        pg, began = self.pg, time.monotonic()
        self._primed = True  # its warm-up comes first, alone
        engine = pg.engine
        if isinstance(engine, SoloEngine):
            engine.warming = True
        try:
            for _ in range(WARMUP_PASSES if self._warmup is not None else 0):
                self._warmup()  # type: ignore[misc]
        finally:
            if isinstance(engine, SoloEngine):
                engine.warming = False
        ready_s = None
        if standby.standing_by():
            # A warm spare stops here, ready, until its rank is lost; what it does
            # from now on is what the job waits for.
            logger.info("rank %d (epoch -, step -): warm spare ready", self._rank)
            ready_s = round(standby.wait_for_go(), 3)
            began = time.monotonic()
        pg.join_members()
        try:
            plan = self._admission()
        except JobFinished as exc:
            self._finished_without_me(exc, began)
        at = self._restore(plan)
        events.emit(
            "rank.joined", epoch=plan.epoch, step=at + 1,
            duration_ms=(time.monotonic() - began) * 1e3,
            action=f"incarnation {pg.incarnation} admitted; trains from step {at + 1}",
            standby_s=ready_s,
        )  # fmt: skip

    def _finished_without_me(self, exc: JobFinished, began: float) -> NoReturn:
        """Log and record that the job finished without this replacement, then exit 0
        (its script's code after the loop, which expects a trained model, never runs).

        Raises:
            SystemExit: always, code 0.
        """
        epoch = current_epoch(self.pg.store)
        # A warning, as "not admitted yet" is: a rank that never trained, shown by default.
        logger.warning(
            "rank %d (epoch %d, step -): the job finished without this replacement (%s); "
            "exiting 0", self._rank, epoch, exc,
        )  # fmt: skip
        events.emit(
            "recovery.job_finished", epoch=epoch, reason=str(exc),
            duration_ms=(time.monotonic() - began) * 1e3,
            action=f"incarnation {self.pg.incarnation} exits 0 without training",
        )  # fmt: skip
        raise SystemExit(0) from exc

    def _admission(self) -> Plan:
        """Report at the job's epoch until the members take this replacement in: at
        their recovery, or (the group shrank without it) at a step boundary after
        it asked to join.

        Raises:
            JobFinished: every other member finished the job and left.
            RecoveryError: not admitted within ``replace_timeout_s``.
        """
        assert self.pg is not None
        pg = self.pg
        deadline = time.monotonic() + self.config.replace_timeout_s
        record = Record(
            rank=self._rank, incarnation=pg.incarnation, step=NO_STATE, data=[], ctl=[],
            replica=self._replica,
        )  # fmt: skip
        while True:
            epoch = current_epoch(pg.store)
            left = deadline - time.monotonic()
            try:
                store = pg.store
                store.set(f"recovery/e{epoch}/r{self._rank}", record.to_json())
                request_join(store, epoch, self._rank)
                finished = finished_check(store, epoch=epoch, world=self._world, me=self._rank)
                return self._enter(
                    record, epoch, decide=False, timeout_s=max(left, 0.1), finished=finished
                )
            except JobFinished:
                raise
            except RecoveryError:
                if time.monotonic() >= deadline or current_epoch(pg.store) == epoch:
                    raise
                logger.info(
                    "rank %d (epoch %d, step %d): not taken into epoch %d; asking again",
                    self._rank, epoch, self._next, epoch + 1,
                )  # fmt: skip
