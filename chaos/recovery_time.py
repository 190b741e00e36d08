"""A fault's recovery time as the job saw it: from the fault to training again.

The library's own span (``recovery.finished``'s ``duration_ms``) starts when a
rank caught the loss and ends before the interrupted step is done again, so it
leaves out detection and the replayed step. This measure does not: it runs from
the moment the fault fired to the moment every rank that trains on had finished
a step beyond the furthest one finished before the fault, from the ranks' step
commit times (:attr:`chaos._progress_watch.RankTrack.commits`).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from chaos._progress_watch import Commit, RankTrack

__all__ = ["Recovery", "recovery_time"]


@dataclass(frozen=True, slots=True)
class Recovery:
    """``seconds`` from the fault to training again (None: some rank never got
    there), and ``step``, the step every rank had to finish (the furthest step
    finished before the fault, plus one)."""

    seconds: float | None
    step: int


def _commits(track: RankTrack) -> Sequence[Commit]:
    # Hand-made tracks and old records have samples only; each is a commit too.
    return track.commits or track.samples


def recovery_time(
    progress: Mapping[int, RankTrack], fired: float, ranks: Iterable[int]
) -> Recovery:
    """Recovery from a fault that fired at ``fired`` (absolute time).

    Let ``S`` be the highest step number any rank (of ``progress``, those left out
    later included) finished at or before ``fired``, -1 if none. For each rank of
    ``ranks`` (those that train on: survivors and replacements, not ranks the job
    shrank without), ``T_r`` is the earliest time after ``fired`` at which it,
    in any incarnation, finished a step numbered above ``S``. The recovery time
    is ``max_r T_r - fired``: when the whole job was past the step the fault
    interrupted, replayed steps (numbered ``S`` or below) not counting as progress.
    None where a rank of ``ranks`` never finished such a step, or ``ranks`` is empty.
    """
    done = [s for t in progress.values() for ts, s, _ in _commits(t) if ts <= fired]
    last = max(done, default=-1)
    ends: list[float] = []
    for rank in ranks:
        track = progress.get(rank)
        commits = _commits(track) if track is not None else ()
        first = min((ts for ts, s, _ in commits if ts > fired and s > last), default=None)
        if first is None:
            return Recovery(None, last + 1)
        ends.append(first)
    return Recovery(max(ends) - fired if ends else None, last + 1)
