"""Draws an event timeline: one lane per writer (chaos, launcher, each rank) over time."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Final

from resilient.errors import ResilientError

# Kind family -> (marker, colour, legend label).
_STYLE: Final = {
    "fault": ("X", "tab:red", "fault injected / cleared"),
    "detect": ("v", "tab:orange", "detection (link/nic down, rank lost, straggler)"),
    "act": ("o", "tab:green", "action (reroute, repair, restore, replay, epoch)"),
}
_DETECT: Final = frozenset(
    {"link.down", "link.degraded", "nic.down", "rank.lost", "rank.evicted",
     "straggler.suspected", "straggler.confirmed"}
)  # fmt: skip


# Always labelled; other kinds only when no label is near in their lane (a flapping
# straggler score or a burst of link.down would otherwise print over itself).
_KEY: Final = frozenset(
    {"fault.injected", "rank.lost", "rank.evicted", "rank.joined", "state.restored",
     "recovery.finished",
     "epoch.changed", "nic.down", "nic.up"}
)  # fmt: skip
_QUIET: Final = frozenset({"straggler.suspected", "straggler.cleared", "link.degraded"})


class PlotUnavailable(ResilientError):
    """matplotlib is not installed (it is an optional dependency)."""


def _family(kind: str) -> str:
    if kind.startswith("fault."):
        return "fault"
    return "detect" if kind in _DETECT else "act"


# Vertical offsets (points) of the label levels around an event's lane, nearest
# first; a lane is 72 points tall, so the top and bottom levels of two
# neighbouring lanes do not meet.
_LEVELS: Final = (7, 17, 27, -15, -25)
# Width of one label character at fontsize 7, in points, and of the axes (13 in).
_CHAR_PT: Final = 4.3
_AXES_PT: Final = 700.0
# The x-axis, in spans of the events: a little room before the first, room for
# the last labels after the last.
_X_FROM, _X_TO = -0.03, 1.1


def _seconds_per_char(span: float) -> float:
    """How many seconds of the x-axis one label character covers."""
    return _CHAR_PT / _AXES_PT * span * (_X_TO - _X_FROM)


@dataclass(slots=True)
class _Label:
    t: float
    lane: int
    level: int
    parts: list[list[Any]]  # [kind, how many] in order

    def text(self) -> str:
        return ", ".join(k if n == 1 else f"{k} x{n}" for k, n in self.parts)


def _labels(
    events: Sequence[dict[str, Any]], lanes: dict[str, int], t0: float, span: float
) -> list[tuple[float, int, str, int]]:
    """(t, lane, text, level) of the labels to draw.

    Each lane has :data:`_LEVELS` rows of labels; a label goes to the nearest row
    where it does not overlap the label before it (its width estimated from its
    length). Key kinds are always labelled: with every row taken, joined to the
    label that ends first ("rank.lost, state.restored"). Others only where a row
    is free. A kind already labelled in its lane within 4 % of the span is not
    labelled again (every rank reports the same straggler, say): that label
    counts them instead ("straggler.confirmed x4").
    """
    labels: list[_Label] = []
    ends: dict[int, list[float]] = {}  # lane -> where each row's last label ends
    said: dict[tuple[int, str], tuple[float, list[Any]]] = {}  # -> (t, its [kind, n])
    per_char = _seconds_per_char(span)

    def width(parts: list[list[Any]]) -> float:
        return sum(len(k) + 5 for k, _ in parts) * per_char

    for ev in events:
        kind, t, lane = str(ev.get("kind")), float(ev["ts"]) - t0, lanes[_lane(ev)]
        before = said.get((lane, kind))
        if before is not None and t - before[0] < 0.04 * span:
            before[1][1] += 1
            continue
        if kind in _QUIET:
            continue
        rows = ends.setdefault(lane, [-1e9] * len(_LEVELS))
        free = [i for i, end in enumerate(rows) if end <= t]
        if not free and kind not in _KEY:
            continue
        part: list[Any] = [kind, 1]
        if free:
            label = _Label(t, lane, free[0], [part])
            labels.append(label)
        else:
            level = min(range(len(rows)), key=lambda i: rows[i])
            label = next(lb for lb in reversed(labels) if lb.lane == lane and lb.level == level)
            label.parts.append(part)
        rows[label.level] = label.t + width(label.parts)
        said[(lane, kind)] = (t, part)
    return [(lb.t, lb.lane, lb.text(), lb.level) for lb in labels]


def _lane(ev: dict[str, Any]) -> str:
    rank = ev.get("rank", -1)
    if rank == -1:
        return "chaos" if str(ev.get("kind", "")).startswith("fault.") else "launcher"
    return f"rank {rank}"


def plot_timeline(
    events: Sequence[dict[str, Any]], path: str, *, start: float | None = None
) -> None:
    """Write a PNG of ``events`` to ``path``.

    Raises:
        PlotUnavailable: matplotlib is missing.
        OSError: the file cannot be written.
    """
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise PlotUnavailable(
            "--plot needs matplotlib: pip install 'resilient[plot]' (or matplotlib)"
        ) from exc
    t0 = start if start is not None else (float(events[0]["ts"]) if events else 0.0)
    lanes = sorted({_lane(ev) for ev in events}, key=lambda n: (n.startswith("rank"), n))
    y = {name: i for i, name in enumerate(lanes)}
    fig, ax = plt.subplots(figsize=(13, 1.4 + 1.0 * max(1, len(lanes))))
    seen: set[str] = set()
    span = max(1e-3, (float(events[-1]["ts"]) - t0) if events else 1.0)
    for ev in events:
        kind = str(ev.get("kind"))
        t, lane, fam = float(ev["ts"]) - t0, y[_lane(ev)], _family(kind)
        dur = ev.get("duration_ms")
        if dur:
            # A phase: drawn as a bar ending at the event (when it finished).
            ax.barh(lane, float(dur) / 1e3, left=t - float(dur) / 1e3, height=0.35,
                    color="tab:blue", alpha=0.3)  # fmt: skip
        marker, colour, _ = _STYLE[fam]
        ax.scatter([t], [lane], marker=marker, color=colour, s=22 if kind in _QUIET else 60,
                   zorder=3, alpha=0.5 if kind in _QUIET else 1.0)  # fmt: skip
        seen.add(fam)
    for t, lane, text, level in _labels(events, y, t0, span):
        ax.annotate(text, (t, lane), textcoords="offset points",
                    xytext=(3, _LEVELS[level]), fontsize=7)  # fmt: skip
    ax.set_xlim(_X_FROM * span, _X_TO * span)
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_ylim(-0.7, len(lanes) - 0.3)
    ax.set_xlabel("seconds since the first event")
    ax.set_title(f"recovery timeline ({len(events)} events)")
    ax.grid(axis="x", alpha=0.3)
    if seen:
        from matplotlib.lines import Line2D

        handles = [
            Line2D([], [], marker=m, color=c, linestyle="", markersize=8, label=text)
            for fam, (m, c, text) in _STYLE.items()
            if fam in seen
        ]
        handles.append(Line2D([], [], color="tab:blue", alpha=0.3, linewidth=8,
                              label="recovery phase (its duration_ms)"))  # fmt: skip
        ax.legend(handles=handles, loc="upper left", fontsize=8, bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
