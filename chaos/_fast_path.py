"""The fast-path share: rail passes moved whole in C, outside and inside fault windows.

Each rank's progress records carry its cumulative ``c_passes`` and ``python_passes``
(:mod:`resilient.progress`, from ``resilient.links.native_steps.STATS``: a rail pass
is one rail's share of one collective call). The passes between two consecutive
records of one process happened between their timestamps: an interval that
overlaps no fault's window counts as outside the faults, any other as during
them. A process's first record counts from the job's start when it is the
track's first, else from the track's previous record (another process's: a
replacement), so its warm-up never counts outside a fault that it followed.

The scenario's ``expect.min_fast_path_share`` bounds the share outside the fault
windows, summed over ranks, where the job runs on 2+ rails and the C module is
built; 0, the default, only reports it (the straggler-aware schedule, which a
degraded NIC or a loaded host brings on, still runs in Python).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from chaos._progress_watch import PassSample, RankTrack

__all__ = ["Tally", "fast_path", "render_line", "verdict"]

Window = tuple[float, float]  # absolute times; the end may be inf


@dataclass(frozen=True, slots=True)
class Tally:
    """Rail passes moved whole in C and by the Python path."""

    c: int = 0
    python: int = 0

    def plus(self, c: int, python: int) -> Tally:
        return Tally(self.c + c, self.python + python)

    @property
    def share(self) -> float | None:
        total = self.c + self.python
        return self.c / total if total else None

    def as_dict(self) -> dict[str, Any]:
        return {"c_passes": self.c, "python_passes": self.python, "share": self.share}


def tally(passes: Sequence[PassSample], windows: Sequence[Window]) -> tuple[Tally, Tally]:
    """One rank's passes (outside the fault windows, during them), see the module doc."""
    outside, during = Tally(), Tally()
    prev: PassSample | None = None
    for sample in passes:
        ts, inc, pid, c, py = sample
        same = prev is not None and (prev[1], prev[2]) == (inc, pid)
        if same and prev is not None and c >= prev[3] and py >= prev[4]:
            dc, dpy = c - prev[3], py - prev[4]
        else:  # a new process counts from zero (a lower count: a restart in place)
            dc, dpy = c, py
        start = prev[0] if prev is not None else float("-inf")
        if any(start < hi and ts >= lo for lo, hi in windows):
            during = during.plus(dc, dpy)
        else:
            outside = outside.plus(dc, dpy)
        prev = sample
    return outside, during


def fast_path(
    progress: Mapping[int, RankTrack], windows: Sequence[Window], *, rails: int
) -> dict[str, Any]:
    """The report's ``fast_path`` section: totals and per-rank tallies, and
    ``c_built`` (every reporting rank's C module is built; None: none reported)."""
    per_rank: dict[int, dict[str, Any]] = {}
    outside, during = Tally(), Tally()
    for rank, track in sorted(progress.items()):
        if not track.passes:
            continue
        out_r, dur_r = tally(track.passes, windows)
        outside, during = outside.plus(out_r.c, out_r.python), during.plus(dur_r.c, dur_r.python)
        per_rank[rank] = {"outside_faults": out_r.as_dict(), "during_faults": dur_r.as_dict()}
    built = [bool(t.last["c_built"]) for t in progress.values() if "c_built" in t.last]
    return {
        "rails": rails,
        "c_built": all(built) if built else None,
        "outside_faults": outside.as_dict(),
        "during_faults": during.as_dict(),
        "per_rank": per_rank,
    }


def verdict(summary: Mapping[str, Any], bound: float) -> tuple[bool, str]:
    """Whether the share outside the faults meets ``bound``, and the row's note."""
    share = summary["outside_faults"]["share"]
    if not summary["per_rank"]:
        missing = "no rank reported its rail passes (c_passes/python_passes in its progress)"
        if summary["rails"] < 2 or bound == 0:
            return True, f"not checked; {missing}"
        return False, missing
    if summary["rails"] < 2:
        return True, "not checked: the bound is for 2+ rails, the job runs on 1"
    if summary["c_built"] is False:
        return True, "not checked: the C steps module is not built"
    if bound == 0:
        return True, "report only (expect.min_fast_path_share = 0)"
    if share is None:
        return False, "no rail pass outside the fault windows"
    shares = {
        r: t["outside_faults"]["share"]
        for r, t in summary["per_rank"].items()
        if t["outside_faults"]["share"] is not None
    }
    low = min(shares, key=lambda r: shares[r])
    note = f"C passes / all outside the fault windows; lowest rank {low}: {shares[low]:.1%}"
    return share >= bound, note


def _pct(tally: Mapping[str, Any]) -> str:
    share = tally["share"]
    total = tally["c_passes"] + tally["python_passes"]
    return f"{tally['c_passes']}/{total} in C" + (f" ({share:.1%})" if share is not None else "")


def render_line(summary: Mapping[str, Any] | None) -> str | None:
    """The report's text line for the fast path, or None where no rank reported it."""
    if not summary or not summary["per_rank"]:
        return None
    ranks = ", ".join(
        f"r{r} {_pct(t['outside_faults'])}" for r, t in sorted(summary["per_rank"].items())
    )
    built = {True: "", False: ", C module not built", None: ""}[summary["c_built"]]
    return (
        f"fast path (rail passes, {summary['rails']} rail(s){built}): outside faults "
        f"{_pct(summary['outside_faults'])}, during faults {_pct(summary['during_faults'])}; "
        f"outside per rank: {ranks}"
    )
