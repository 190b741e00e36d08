"""Choosing a remedy by estimated cost: one place, and every choice logged with why.

A fault usually has more than one remedy. Each is estimated as the seconds by
which it would move the job's end (its delay), from what the ranks measured: the
step time, the steps left, the state a replacement must receive and the link rate
it comes over. The cheapest remedy that is allowed wins, and a ``policy.decision``
event records every option with its estimate and the reason.

``rank.lost`` (:meth:`Policy.rank_lost`)
    *replace*: every survivor waits until the replacement reports (a warm spare
    or a cold start, as the launcher announced) and then sends it the state.
    *shrink*: go on at once with M = N - 1 ranks; each step then does the lost
    rank's share of the data too, so it takes about N/M as long, until a
    replacement grows the group back (or the job ends). With no replacement
    coming, waiting buys nothing: shrink (if ``min_ranks`` allows) or stop.

``straggler.confirmed`` (:meth:`Policy.straggler`)
    *tolerate*: every step waits for it, (slowdown - 1) of a step each.
    *reroute*: when its links are what is slow, the straggler-aware all_reduce
    leaves it out of the reduction work (resilient.detect.slow_rank) and the remaining
    cost is its own traffic.
    *evict* (only with ``evict_stragglers``): it leaves the job and is replaced
    as if it had crashed: a replacement reports (a warm spare or a cold start,
    as the launcher publishes), receives the state, and one step is replayed;
    from then on steps run at full speed. With no restart left, or no launcher
    that publishes its budget (``recovery.Session`` then says none: under
    torchrun an exit restarts every worker), it is not an option.
    How long a compute or stalled straggler stays slow is not known when it is
    confirmed (a rank starved while processes start beside it is slow for a few
    seconds; a throttled GPU, for good). Tolerating it is therefore priced at what
    it has cost so far (the time its peers waited for it since it was suspected,
    measured), capped at its cost to the job's end: it is tolerated until it has
    cost as much as an eviction would, then evicted if it is still slow. This is
    the rent-or-buy rule, which against a replacement never pays more than twice
    what the best choice in hindsight would have. A link straggler, whose cost
    is not measured, is assumed slow to the end.
    ``recovery.Session`` asks at every step boundary while a straggler stands and
    logs each choice that differs from its last on every rank; the straggler acts
    on its own choice (it exits with ``EXIT_EVICTED``), the others recover from
    its loss as from a crash. The straggler-aware schedule itself switches on the ranks' agreed
    link evidence in the data plane.

Two preferences change the rank-loss choice. ``replace-first`` (the default)
waits up to ``shrink_after_s`` for an announced replacement even where shrinking
now would be cheaper, so a replaced run stays bitwise equal to a fault-free one.
``cost`` takes the cheaper option; a shrunk group grows back when the
replacement reports.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from dataclasses import dataclass, field

from resilient import events
from resilient.config import RecoveryConfig

__all__ = ["Choice", "JobView", "Option", "Policy"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True, slots=True)
class JobView:
    """What the ranks know of the job when a choice is due."""

    world: int  # ranks the job was started with
    members: int  # ranks taking part now (before the fault)
    step_s: float  # recent time per step (0 when not measured yet)
    steps_left: int
    state_bytes: int = 0  # what a rank behind must receive
    link_bytes_per_s: float = 1e9  # the rate it would come at


@dataclass(frozen=True, slots=True)
class Option:
    """One remedy: its estimated delay to the job's end, and how that was reckoned."""

    action: str
    cost_s: float
    note: str


@dataclass(frozen=True, slots=True)
class Choice:
    """What the policy picked for one fault, against what."""

    fault: str
    action: str
    reason: str
    options: tuple[Option, ...] = field(default=())

    def as_fields(self) -> dict[str, object]:
        return {
            "fault": self.fault,
            "options": [
                {"action": o.action, "cost_s": _round(o.cost_s), "note": o.note}
                for o in self.options
            ],
        }


def _round(x: float) -> float | None:
    return None if math.isinf(x) else round(x, 3)


def _cheapest(options: Sequence[Option]) -> Option:
    return min(options, key=lambda o: o.cost_s)


def _transfer_s(job: JobView) -> float:
    return job.state_bytes / max(job.link_bytes_per_s, 1.0)


def _replace(job: JobView, how: str, eta: float) -> Option:
    """Everyone waits until the replacement reports, then it receives the state."""
    if math.isinf(eta):
        return Option("replace", math.inf, "no replacement comes")
    note = (
        f"{how} replacement reports in ~{eta:g} s, then {job.state_bytes} B at "
        f"{job.link_bytes_per_s / 1e6:.0f} MB/s"
    )
    return Option("replace", eta + _transfer_s(job), note)


def _shrink(job: JobView, eta: float, allowed: bool) -> Option:
    """The survivors do the lost rank's share too until the replacement grows the
    group back (then it receives the state) or, with none coming, to the end."""
    if not allowed:
        return Option("shrink", math.inf, "not allowed (no shrink_after_s, or min_ranks)")
    left = max(job.members - 1, 1)
    coming = not math.isinf(eta)
    steps = min(job.steps_left, eta / max(job.step_s, 1e-9)) if coming else job.steps_left
    cost = steps * job.step_s * (job.members / left - 1.0) + (_transfer_s(job) if coming else 0.0)
    ms = job.step_s * 1e3
    note = f"{left} ranks do {job.members}'s work for {steps:.0f} steps of {ms:.0f} ms"
    return Option("shrink", cost, note)


class Policy:
    """Pure cost estimates plus the event that records each choice."""

    def __init__(self, config: RecoveryConfig | None = None) -> None:
        """``config``: the preference (``policy``) and the replacement ETAs
        (``warm_eta_s``, ``cold_eta_s``: a warm spare has built the job already and
        reports within ~0.1 s of the launcher's "go" (0.5 s leaves room for a busy
        machine); a cold start reports after about 4 s here, importing torch and
        torch._dynamo and building the job; see docs/BENCHMARKS.md)."""
        self.config = config or RecoveryConfig()

    def rank_lost(self, job: JobView, *, replacement: str | None, shrink_allowed: bool) -> Choice:
        """Replace or shrink, for a lost rank. ``replacement``: what the launcher
        announced (warm, cold, none) or None (not known yet: a restart is assumed,
        cold). The action is ``replace`` (wait), ``shrink`` (go on now) or ``stop``
        (no replacement and no shrink allowed)."""
        how = replacement or "cold"
        cfg = self.config
        eta = {"warm": cfg.warm_eta_s, "cold": cfg.cold_eta_s}.get(how, math.inf)
        replace, shrink = _replace(job, how, eta), _shrink(job, eta, shrink_allowed)
        options = (replace, shrink)
        best = _cheapest(options)
        if math.isinf(best.cost_s):
            return Choice("rank.lost", "stop", "no replacement comes and no shrink", options)
        coming = not math.isinf(eta)
        if best is shrink and coming and cfg.policy == "replace-first":
            return Choice(
                "rank.lost", "replace",
                f"a {how} replacement comes: wait for it (replace-first keeps the run "
                f"bitwise reproducible) although shrinking would cost ~{shrink.cost_s:.2f} s "
                f"against ~{replace.cost_s:.2f} s",
                options,
            )  # fmt: skip
        other = shrink if best is replace else replace
        worse = "is impossible" if math.isinf(other.cost_s) else f"~{other.cost_s:.2f} s"
        return Choice(
            "rank.lost", best.action,
            f"{best.action} costs ~{best.cost_s:.2f} s, {other.action} {worse}", options,
        )  # fmt: skip

    def straggler(
        self,
        job: JobView,
        *,
        slowdown: float,
        cause: str,
        replacement: str | None = None,
        shrink_allowed: bool = False,
        lost_s: float | None = None,
    ) -> Choice:
        """Tolerate, reroute around or evict a confirmed straggler (``slowdown``: its
        time over its peers' median; ``cause``: stalled, compute or link;
        ``replacement``: what would replace it, warm, cold or none, or None when
        not known: a cold start is assumed; ``shrink_allowed``: with none, the
        others may go on without it; ``lost_s``: the seconds the job has lost to
        it so far, or None when not measured: then it is assumed slow to the end)."""
        per_step = max(slowdown - 1.0, 0.0) * job.step_s
        tolerate = Option(
            "tolerate", per_step * job.steps_left,
            f"every step waits {per_step * 1e3:.0f} ms for it over {job.steps_left} steps",
        )  # fmt: skip
        if lost_s is not None and lost_s < tolerate.cost_s:
            # How long a slowdown lasts is not known when it is seen: assume as long
            # again as it has lasted (see the module docstring).
            tolerate = Option(
                "tolerate", lost_s,
                f"it has cost {lost_s:.2f} s so far: as much again is assumed",
            )  # fmt: skip
        if cause == "link":
            # Left out of the reduction work, it still sends its data once and
            # receives the result once: about 1/world of the slow part remains.
            rest = per_step / max(job.members, 1)
            reroute = Option(
                "reroute", rest * job.steps_left,
                "straggler-aware all_reduce: it only sends its data and takes the result",
            )  # fmt: skip
        else:
            stalled = cause == "stalled"
            what = "it could not run part of the time" if stalled else "its compute is slow"
            reroute = Option("reroute", math.inf, f"{what}, not its links: rerouting cannot help")
        options = (tolerate, reroute, self._evict(job, replacement or "cold", shrink_allowed))
        best = _cheapest(options)
        others = ", ".join(
            f"{o.action} {'impossible' if math.isinf(o.cost_s) else f'~{o.cost_s:.2f} s'}"
            for o in options
            if o is not best
        )
        return Choice(
            "straggler.confirmed", best.action,
            f"{best.action} costs ~{best.cost_s:.2f} s ({others})", options,
        )  # fmt: skip

    def _evict(self, job: JobView, how: str, shrink_allowed: bool) -> Option:
        if not self.config.evict_stragglers:
            return Option("evict", math.inf, "not enabled (--evict-stragglers)")
        if how not in ("warm", "cold"):
            if not shrink_allowed:
                return Option("evict", math.inf, "no restart left to replace it, and no shrink")
            # No replacement comes: the others go on without it (a shrink), each
            # doing a share of its work until the end; one step is replayed.
            alone = _shrink(job, math.inf, True)
            return Option(
                "evict", alone.cost_s + job.step_s,
                f"it leaves with no restart left; {alone.note}; one step is replayed",
            )  # fmt: skip
        eta = self.config.warm_eta_s if how == "warm" else self.config.cold_eta_s
        cost = eta + _transfer_s(job) + job.step_s
        note = (
            f"it leaves; a {how} replacement reports in ~{eta:g} s and receives "
            f"{job.state_bytes} B; one step of {job.step_s * 1e3:.0f} ms is replayed"
        )
        return Option("evict", cost, note)

    @staticmethod
    def record(
        choice: Choice, *, epoch: int, step: int | None = None, rank: int | None = None,
        **fields: object,
    ) -> None:  # fmt: skip
        """Emit the ``policy.decision`` event (plus ``fields``) and log the choice."""
        events.emit(
            "policy.decision", epoch=epoch, step=step, rank=rank, reason=choice.reason,
            action=choice.action, **choice.as_fields(), **fields,
        )  # fmt: skip
        logger.info(
            "epoch %d, step %s: %s -> %s (%s)", epoch, step, choice.fault, choice.action,
            choice.reason,
        )  # fmt: skip
