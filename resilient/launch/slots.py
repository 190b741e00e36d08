"""The launcher's rank slots, and the warm spares it keeps for them.

A :class:`Slot` is one rank id: the process that holds it now, its incarnation,
and the standby (:class:`resilient.launch.spares.Spare`) that would take the next
incarnation. :class:`SpareTending` is the part of the launcher's run that starts
those standbys when due, reports one that died before it was needed, and hands a
slot to its standby on a restart.
"""

from __future__ import annotations

import logging
import signal
import subprocess
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from resilient.launch.rank_procs import RankOutput, describe_exit, signal_group, stop_all
from resilient.launch.spares import PrimedRanks, Spare

if TYPE_CHECKING:
    from resilient.launch.launch_config import LaunchConfig

__all__ = [
    "NEXT_SPARE_S",
    "Slot",
    "SpareTending",
    "finished_notice",
    "kill_now",
    "replacement_slots",
    "slot_procs",
    "slot_state",
    "stop_slots",
]

logger = logging.getLogger(__name__)

# After a spare took its rank, the next one starts this much later: it builds the
# whole job (torch, the model, DDP) and would take CPU from the recovery under way.
NEXT_SPARE_S: Final = 5.0
# A spare killed by a signal (the OOM killer, an operator) is started again, this
# many times per rank at most; one that exited by itself would only do so again.
SPARE_RESTARTS: Final = 2


@dataclass(slots=True)
class Slot:
    """One rank id: the process holding it now and how many held it before."""

    rank: int
    incarnation: int = 0
    proc: subprocess.Popen[bytes] | None = None
    done: bool = False
    left: bool = False  # lost with no restart left; the job went on without it
    hung: bool = False  # killed by us after its lease expired
    spare: Spare | None = None  # warm standby for incarnation + 1
    spare_at: float | None = None  # when to start the next standby (monotonic)
    spares_killed: int = 0  # standbys that died by a signal before they were needed
    primed_killed: int = 0  # the same of primed processes
    primed: PrimedRanks | None = None  # a process past `import torch` for a cold restart
    primed_at: float | None = None  # when to start it (monotonic)
    died_after_leaving: int = 0  # exit code of a rank that died once it had left the job


def slot_state(slot: Slot) -> str:
    """``done``, ``running`` or ``restarting`` (for the metrics)."""
    if slot.done:
        return "done"
    return "running" if slot.proc is not None and slot.proc.poll() is None else "restarting"


def finished_notice(slots: Sequence[Slot]) -> str:
    """What the launcher says when every rank of ``slots`` is done."""
    left = [s.rank for s in slots if s.left]
    died = {s.rank: s.died_after_leaving for s in slots if s.died_after_leaving}
    return (
        f"all {len(slots) - len(left)} rank(s) finished"
        + (f" (ranks {left} were left out: the job shrank)" if left else "")
        + "".join(
            f"; rank {rank} then exited with {describe_exit(code)}" for rank, code in died.items()
        )
    )


def replacement_slots(
    cfg: LaunchConfig, incarnations: dict[int, int], slots: Sequence[Slot]
) -> list[Slot]:
    """The slots of node ``cfg.node_rank`` taken over by a spare node: each global
    rank at its next incarnation (``incarnations``), spares due as in ``slots``."""
    return [
        Slot(cfg.global_rank(local), incarnation=incarnations.get(cfg.global_rank(local), 1),
             spare_at=old.spare_at, primed_at=old.primed_at)
        for local, old in enumerate(slots)
    ]  # fmt: skip


def slot_procs(slots: Sequence[Slot]) -> list[subprocess.Popen[bytes]]:
    """Every process ``slots`` hold: ranks, standbys and primed processes."""
    procs = [s.proc for s in slots if s.proc is not None]
    procs += [s.spare.proc for s in slots if s.spare is not None]
    procs += [p for s in slots if s.primed is not None for p in s.primed.procs]
    return procs


def stop_slots(
    slots: Sequence[Slot], others: Sequence[subprocess.Popen[bytes]], *, grace_s: float
) -> None:
    """Stop every process of ``slots`` and ``others`` (rank_procs.stop_all); primed
    processes are told to exit first (end of file: they exit 0 at once)."""
    for slot in slots:
        if slot.primed is not None:
            slot.primed.close()
    stop_all([*slot_procs(slots), *others], grace_s=grace_s)


def kill_now(slots: Sequence[Slot]) -> None:
    """SIGKILL every live rank and standby of ``slots`` (their whole sessions); safe
    from another thread (nothing is reaped here)."""
    for proc in slot_procs(slots):
        if proc.returncode is None:
            signal_group(proc, signal.SIGKILL)


class SpareTending:
    """Warm spares of the launcher's slots (mixed into the launcher's run)."""

    _cfg: LaunchConfig
    _restarts: int
    _slots: Sequence[Slot]
    _out: RankOutput
    _fenced: str | None

    if TYPE_CHECKING:

        def _env(self, slot: Slot, incarnation: int | None = None) -> dict[str, str]: ...
        def _publish_budget(self) -> None: ...

    def _slot_of(self, rank: int) -> Slot | None:
        """The slot of global ``rank``, or None when another node runs it."""
        local = rank - self._cfg.first_rank
        return self._slots[local] if 0 <= local < len(self._slots) else None

    def _spares_on(self) -> bool:
        """Warm spares are wanted, and a restart is left for one to take."""
        return self._cfg.warm_spares and self._restarts < self._cfg.max_restarts

    def _spares_ready(self) -> list[int]:
        """The ranks whose warm spare stands ready now."""
        return [
            s.rank for s in self._slots if s.spare is not None and s.spare.ready_after_s is not None
        ]

    def spare_warming(self, rank: int) -> bool:
        """Whether ``rank`` has a warm spare started (or due to start) that does not
        stand ready yet. Read from other threads: looks, never reaps."""
        slot = self._slot_of(rank)
        if not self._spares_on() or slot is None or slot.done:
            return False
        spare = slot.spare
        return spare.ready_after_s is None if spare is not None else slot.spare_at is not None

    def _start_spare(self, slot: Slot) -> None:
        """Start a standby for ``slot``'s next incarnation, if spares are on and the
        restart budget could still use one."""
        cfg = self._cfg
        if not self._spares_on() or slot.spare is not None:
            return
        env = self._env(slot, incarnation=slot.incarnation + 1)
        try:
            slot.spare = Spare.start([cfg.script, *cfg.script_args], env, cfg.wrap_of(slot.rank))
        except OSError as exc:
            logger.warning("rank %d: could not start a warm spare: %s", slot.rank, exc)
            return
        if self._fenced is not None:  # the node was fenced while it started
            signal_group(slot.spare.proc, signal.SIGKILL)

    def _tend_spare(self, slot: Slot) -> None:
        """Start ``slot``'s next standby when due; report one that exited before it
        was needed (its output goes to the rank's log). One killed by a signal is
        started again later (up to SPARE_RESTARTS times); else a loss starts cold."""
        spare = slot.spare
        if spare is not None and spare.ready_after_s is None and spare.poll_ready():
            self._out.notice(
                f"rank {slot.rank}'s warm spare stands ready "
                f"({spare.ready_after_s:.1f} s after it started)"
            )
            # The ranks price an eviction by whether the spare stands ready.
            self._publish_budget()
        if spare is not None and (code := spare.exit_code()) is not None:
            spare.close()
            was_ready = spare.ready_after_s is not None
            again = code < 0 and slot.spares_killed < SPARE_RESTARTS and not slot.done
            if again:
                slot.spares_killed += 1
                slot.spare_at = time.monotonic() + NEXT_SPARE_S
            slot.spare = None  # after spare_at: see _restart
            if was_ready:
                self._publish_budget()
            self._exited_early(slot, "warm spare", spare.proc, code, again, "a loss of the rank")
        elif slot.spare_at is not None and time.monotonic() >= slot.spare_at:
            if not slot.done:
                self._start_spare(slot)
            slot.spare_at = None  # only now: see _restart

    def _primes_on(self) -> bool:
        """Cold restarts start from a primed process: asked for, no warm spares
        (they go further), and a restart left for one to take."""
        cfg = self._cfg
        return cfg.primed_restarts and not cfg.warm_spares and self._restarts < cfg.max_restarts

    def _tend_primed(self, slot: Slot) -> None:
        """Start ``slot``'s primed process when due; close it once it can no longer
        be used (the rank is done, or no restart is left: it holds ~300 MB)."""
        if slot.done or not self._primes_on():
            if slot.primed is not None:
                slot.primed.close()
            slot.primed_at = None
            return
        if slot.primed is not None:
            self._primed_exited(slot, slot.primed)
        if slot.primed is not None or slot.primed_at is None or time.monotonic() < slot.primed_at:
            return
        slot.primed_at = None
        cfg = self._cfg
        try:
            slot.primed = PrimedRanks(1, cfg.node_environ(), cfg.wrap_of(slot.rank))
        except OSError as exc:
            logger.warning("rank %d: could not start a primed process: %s", slot.rank, exc)
            return
        if self._fenced is not None:  # the node was fenced while it started
            for proc in slot.primed.procs:
                signal_group(proc, signal.SIGKILL)

    def _primed_exited(self, slot: Slot, primed: PrimedRanks) -> None:
        """Report ``slot``'s primed process if it exited before it was needed (its
        output goes to the rank's log). One killed by a signal is started again
        later (up to SPARE_RESTARTS times); else the next restart starts cold."""
        gone = primed.exited()
        if gone is None:
            return
        proc, code = gone
        primed.close()
        slot.primed = None
        again = code < 0 and slot.primed_killed < SPARE_RESTARTS
        if again:
            slot.primed_killed += 1
            slot.primed_at = time.monotonic() + NEXT_SPARE_S
        self._exited_early(slot, "primed process", proc, code, again, "its next restart")

    def _exited_early(
        self,
        slot: Slot,
        what: str,
        proc: subprocess.Popen[bytes],
        code: int,
        again: bool,
        cold: str,
    ) -> None:
        """Say that ``slot``'s standby ``what`` exited before it was needed and what
        follows (``again``: another in NEXT_SPARE_S, else ``cold`` starts cold);
        its output goes to the rank's log."""
        then = f"another starts in {NEXT_SPARE_S:.0f} s" if again else f"{cold} starts cold"
        self._out.notice(
            f"rank {slot.rank}'s {what} exited ({describe_exit(code)}) before it was "
            f"needed; its output follows in the rank's log; {then}"
        )
        self._out.attach(slot.rank, slot.incarnation + 1, proc)

    def _take_primed(self, slot: Slot) -> PrimedRanks | None:
        """``slot``'s primed process, for a cold restart (None if it has none); the
        next is due NEXT_SPARE_S later, not to take CPU from the recovery."""
        primed, slot.primed = slot.primed, None
        if primed is not None:
            slot.primed_at = time.monotonic() + NEXT_SPARE_S
        return primed

    def _promote_spare(self, slot: Slot) -> bool:
        """Hand ``slot`` to its standby (already at ``slot.incarnation``); False if none."""
        spare, slot.spare = slot.spare, None
        if spare is None or not spare.hand_over():
            return False
        slot.proc = spare.proc
        self._out.attach(slot.rank, slot.incarnation, spare.proc)
        return True
