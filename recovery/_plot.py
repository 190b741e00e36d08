"""Draws an event timeline: one lane per writer (chaos, launcher, each rank) over time."""

from __future__ import annotations

from collections.abc import Sequence
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


def _labels(
    events: Sequence[dict[str, Any]], lanes: dict[str, int], t0: float, span: float
) -> list[tuple[float, int, str, int]]:
    """(t, lane, text, level) of the labels to draw: key kinds always, on up to
    three levels; others only where their lane has no label within 4 % of the span."""
    out: list[tuple[float, int, str, int]] = []
    last: dict[int, tuple[float, int]] = {}
    for ev in events:
        kind, t, lane = str(ev.get("kind")), float(ev["ts"]) - t0, lanes[_lane(ev)]
        prev_t, level = last.get(lane, (-1e9, -1))
        near = t - prev_t < 0.04 * span
        if kind in _QUIET or (near and kind not in _KEY):
            continue
        level = (level + 1) % 3 if near else 0
        last[lane] = (t, level)
        out.append((t, lane, kind, level))
    return out


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
    fig, ax = plt.subplots(figsize=(13, 1.4 + 0.75 * max(1, len(lanes))))
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
                    xytext=(3, (8, 17, -14)[level]), fontsize=7)  # fmt: skip
    ax.set_xlim(-0.03 * span, span * 1.1)  # room for the last labels
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
