"""How the members of a job change between steps, kept apart from the step API
(:mod:`recovery.session`): a confirmed straggler judged by the policy and, if it
is to go, evicted (it exits; the others recover from it as from a lost rank); the
shrink decision polled while survivors wait for a replacement; replacements taken
back into a group that shrank without them. Mixed into
:class:`~recovery.session.Session`.
"""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import torch

from recovery.agree import Plan, Record, join_requested
from recovery.policy import JobView, Policy
from resilient import events
from resilient.config import EXIT_EVICTED, RecoveryConfig
from resilient.errors import PeerLost, ResilientError

__all__ = ["Resizing", "link_rate"]

logger = logging.getLogger(__name__)


class Resizing:
    """Mixed into :class:`~recovery.session.Session`."""

    if TYPE_CHECKING:  # the session's own state and methods (never shadowed at run time)
        pg: Any
        config: RecoveryConfig
        policy: Policy
        recoveries: int
        _rank: int
        _world: int
        _total: int
        _next: int
        _step_s: float
        _recent: deque[float]

        def _recover(self, n: int, cause: BaseException) -> None: ...
        def _stop_and_report(self) -> tuple[Record, float]: ...

        _enter: Callable[..., Plan]  # Session._enter

        def _restore(self, plan: Plan) -> int: ...
        def _state_bytes(self) -> int: ...

    def _join_pending(self) -> bool:
        """At a step boundary of a shrunk group: did a replacement ask to join? The
        members agree with one small all_reduce (a store read may see the request
        on some ranks and not yet on others)."""
        pg = self.pg
        if pg is None or len(pg.members) == self._world:
            return False
        import torch.distributed as dist

        flag = torch.tensor([int(join_requested(pg.store, pg.epoch))], dtype=torch.int32)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX, group=pg)
        return bool(flag.item())

    def _judge_stragglers(self, n: int) -> None:
        """Ask the policy about each standing straggler and log each choice that
        differs from its last (``policy.decision`` with ``straggler``: its rank).
        Asked again at every step boundary: what it has cost so far grows while it
        stays slow, until an eviction is the cheaper choice (recovery.policy)."""
        verdicts = getattr(self.pg, "verdicts", None)
        if verdicts is None or self.pg is None:
            return
        for s in verdicts.standing():
            job = JobView(
                world=self._world, members=len(self.pg.members), step_s=self._unslowed_step_s(),
                steps_left=max(self._total - n, 0), state_bytes=self._state_bytes(),
                link_bytes_per_s=link_rate(self.pg),
            )  # fmt: skip
            choice = self.policy.straggler(
                job, slowdown=1 / max(s.relative, 1e-3), cause=s.cause,
                # Nobody publishing a budget (torchrun, Slurm): no eviction, as
                # an exit there restarts every worker, or none.
                replacement=(_budget(self.pg, s.rank) or "none")
                if self.config.evict_stragglers else None,
                shrink_allowed=self._may_shrink(), lost_s=s.lost_s,
            )  # fmt: skip
            if choice.action == s.judged:
                continue
            verdicts.judged(s.rank, s.cause, choice.action)
            self.policy.record(choice, epoch=self.pg.epoch, step=n, straggler=s.rank)
            if choice.action == "evict" and s.rank == self._rank and self._first_to_leave():
                self._leave(n, choice.reason)

    def _may_shrink(self) -> bool:
        """Whether the members may go on without one of them (configured, and
        ``min_ranks`` would still be met)."""
        assert self.pg is not None
        cfg = self.config
        return cfg.shrink_after_s is not None and len(self.pg.members) - 1 >= cfg.min_ranks

    def _unslowed_step_s(self) -> float:
        """The step time without the straggler: the lower quartile of the last
        steps (a verdict comes 4-20 steps after the slowing began, so most of the
        window is still unslowed); the smoothed time before enough steps ran."""
        if len(self._recent) < 8:
            return self._step_s
        ordered = sorted(self._recent)
        return ordered[len(ordered) // 4]

    def _first_to_leave(self) -> bool:
        """One eviction per epoch: two stragglers confirmed together would both leave,
        and the launcher may have a restart for one only. The first to claim the
        epoch's slot in the store leaves; the other keeps training (its straggling
        is judged again in the next epoch)."""
        assert self.pg is not None
        key, me = f"recovery/e{self.pg.epoch}/evicted", str(self._rank)
        try:
            won = bytes(self.pg.store.compare_set(key, "", me)).decode() == me
        except Exception as exc:  # the store unreachable: staying is the safe side
            logger.warning(
                "rank %d (epoch %d, step %d): cannot claim the eviction (%s); staying",
                self._rank, self.pg.epoch, self._next, exc,
            )  # fmt: skip
            return False
        if not won:
            logger.info(
                "rank %d (epoch %d, step %d): another straggler leaves this epoch; staying",
                self._rank, self.pg.epoch, self._next,
            )  # fmt: skip
        return won

    def _leave(self, n: int, why: str) -> None:
        """This rank is the straggler the policy evicts: leave the job at once.

        It exits like a crashed rank (``os._exit``), on purpose: the survivors'
        recovery from a lost rank is the proven path, while a normal interpreter
        exit would run the script's own cleanup, which may call collectives the
        others no longer match. Its state lives on in the survivors; the launcher
        replaces it (exit status ``EXIT_EVICTED``), or with no restart left the
        others shrink without it, and one step is replayed.
        """
        assert self.pg is not None
        logger.warning(
            "rank %d (epoch %d, step %d): evicted as a straggler (%s); exiting with %d",
            self._rank, self.pg.epoch, n, why, EXIT_EVICTED,
        )  # fmt: skip
        events.emit(
            "rank.evicted", epoch=self.pg.epoch, step=n, reason=why,
            action=f"exit with code {EXIT_EVICTED}; the launcher replaces it, or the job "
            "goes on without it",
        )  # fmt: skip
        events.exit_now(EXIT_EVICTED)

    def _maybe_grow(self) -> None:
        """Take in replacements that asked to join (a shrunk group only), before the
        next step; a peer lost meanwhile is recovered from as in a step."""
        try:
            # Checked again after a grow: the replacement just taken in makes that
            # same check before its first step, and every member must make it too.
            while self._join_pending():
                self._grow(self._next)
        except Exception as exc:
            lost = self.pg.lost if self.pg is not None else None
            if self.pg is None or (lost is None and not isinstance(exc, PeerLost)):
                raise
            self._recover(self._next, lost or exc)

    def _grow(self, n: int) -> None:
        """Take the replacements that asked in before step ``n``; nothing is replayed."""
        assert self.pg is not None
        pg, began = self.pg, time.monotonic()
        events.emit(
            "recovery.started", epoch=pg.epoch, step=n, reason="a replacement asked to join",
            action="agree on the next epoch with it, send it the state",
        )  # fmt: skip
        record, _ = self._stop_and_report()
        plan = self._enter(record, pg.epoch)
        self._restore(plan)
        self.recoveries += 1
        events.emit(
            "recovery.finished", epoch=plan.epoch, step=n,
            duration_ms=(time.monotonic() - began) * 1e3,
            action=f"{len(plan.members)} ranks train from step {n}",
        )  # fmt: skip

    def _shrink_check(self, lost: int | None, n: int) -> Callable[[], set[int]]:
        """Polled while survivors wait for a replacement: asks the policy (with what
        the launcher announced for the lost rank) whether to shrink now, and then
        names the ranks not to wait for: the lost one and every member announced
        "none" (a whole node lost); records each new choice as a
        ``policy.decision`` event."""
        assert self.pg is not None
        pg, allowed = self.pg, self._may_shrink()
        due, last = 0.0, ""
        gone: set[int] = set()

        def check() -> set[int]:
            nonlocal due, last, gone
            now = time.monotonic()
            if now < due or lost is None:
                return gone if last == "shrink" else set()
            due = now + 0.1  # an etcd read per check: 10 per second
            how = _announced(pg, lost)
            job = JobView(
                world=self._world, members=len(pg.members), step_s=self._step_s,
                steps_left=max(self._total - n, 0), state_bytes=self._state_bytes(),
                link_bytes_per_s=link_rate(pg),
            )  # fmt: skip
            choice = self.policy.rank_lost(job, replacement=how, shrink_allowed=allowed)
            if choice.action != last:
                last = choice.action
                self.policy.record(choice, epoch=pg.epoch, step=n)
            # With a whole node lost, its other ranks go too, in this same epoch:
            # the agreement shrinks only once every rank not given up reported.
            gone = {lost} | _unreplaced(pg) if choice.action == "shrink" else set()
            return gone

        return check


def link_rate(pg: Any, default: float = 1e9) -> float:
    """The measured data rate of this rank's rails together (bytes/s), or ``default``."""
    rates = getattr(pg.engine, "rail_rates", ())
    total = float(sum(r for r in rates if r > 0))
    return total if total > 0 else default


def _launcher_says(pg: Any, read: Callable[[Any], dict[str, Any] | None]) -> dict[str, Any]:
    """A record the launcher keeps in etcd, read through ``pg``'s membership; empty
    without one (no etcd, no launcher that writes it) or while etcd is unreachable,
    so the caller decides without it."""
    membership = getattr(pg, "membership", None)
    if membership is None:
        return {}
    try:
        return read(membership) or {}
    except ResilientError as exc:
        logger.debug("reading the launcher's record failed: %s", exc)
        return {}


def _budget(pg: Any, rank: int) -> str | None:
    """What would replace ``rank`` if it left now, from the launcher's published
    budget: warm (its spare stands ready), cold (no spare, or one still warming
    up: it has as much left to do as a cold start, at most) or none; None without
    a launcher that says (torchrun)."""
    record = _launcher_says(pg, lambda m: m.supervisor())
    if not record:
        return None
    if int(record.get("restarts_left", 0)) <= 0:
        return "none"
    if not record.get("warm_spares"):
        return "cold"
    ready = record.get("ready")
    return "warm" if ready is None or rank in ready else "cold"


def _unreplaced(pg: Any) -> set[int]:
    """Members the supervisors announced no replacement for ("none"): the ranks of a
    node lost with no spare node (resilient.launch.node_watch), or of a rank with
    no restart left. None of them will report for the next epoch."""
    membership = getattr(pg, "membership", None)
    if membership is None or not hasattr(membership, "replacements"):
        return set()
    try:
        said = membership.replacements()
    except ResilientError as exc:
        logger.debug("reading the launcher's announcements failed: %s", exc)
        return set()
    return {r for r in pg.members if said.get(r, {}).get("how") == "none"}


def _announced(pg: Any, rank: int | None) -> str | None:
    """What the launcher announced for lost ``rank`` (warm, cold, none), if anything."""
    if rank is None:
        return None
    record = _launcher_says(pg, lambda m: m.replacement(rank))
    return str(record["how"]) if record else None
