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
    {"link.down", "link.degraded", "nic.down", "rank.lost", "straggler.suspected",
     "straggler.confirmed"}
)  # fmt: skip


class PlotUnavailable(ResilientError):
    """matplotlib is not installed (it is an optional dependency)."""


def _family(kind: str) -> str:
    if kind.startswith("fault."):
        return "fault"
    return "detect" if kind in _DETECT else "act"


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
    fig, ax = plt.subplots(figsize=(11, 1.2 + 0.55 * max(1, len(lanes))))
    seen: set[str] = set()
    span = max(1e-3, (float(events[-1]["ts"]) - t0) if events else 1.0)
    last_label: dict[int, tuple[float, int]] = {}
    for ev in events:
        t, lane, fam = float(ev["ts"]) - t0, y[_lane(ev)], _family(str(ev.get("kind")))
        dur = ev.get("duration_ms")
        if dur:
            # A phase: drawn as a bar ending at the event (when it finished).
            ax.barh(lane, float(dur) / 1e3, left=t - float(dur) / 1e3, height=0.35,
                    color="tab:blue", alpha=0.35)  # fmt: skip
        marker, colour, label = _STYLE[fam]
        ax.scatter([t], [lane], marker=marker, color=colour, s=60, zorder=3,
                   label=None if fam in seen else label)  # fmt: skip
        seen.add(fam)
        # Labels of events close together in one lane alternate above and below.
        prev_t, flip = last_label.get(lane, (-1e9, 1))
        flip = -flip if t - prev_t < 0.06 * span else 1
        last_label[lane] = (t, flip)
        ax.annotate(str(ev.get("kind")), (t, lane), textcoords="offset points",
                    xytext=(3, 8 if flip > 0 else -14), fontsize=7)  # fmt: skip
    ax.set_xlim(-0.03 * span, span * 1.1)  # room for the last labels
    ax.set_yticks(range(len(lanes)), lanes)
    ax.set_ylim(-0.7, len(lanes) - 0.3)
    ax.set_xlabel("seconds since the first event")
    ax.set_title(f"recovery timeline ({len(events)} events)")
    ax.grid(axis="x", alpha=0.3)
    if seen:
        ax.legend(loc="upper left", fontsize=8, bbox_to_anchor=(1.0, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
