"""``resilient events RUN_DIR``: every writer's events merged into one timeline.

Prints a table (time since the first event, who, what, which links, how long, why),
or with ``--json`` the events as ``{"schema_version": 1, "events": [...]}`` on the
last line; ``--plot FILE.png`` draws per-rank lanes over time (matplotlib).
Exit status 0, or 2 for a run directory without events or bad arguments.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

__all__ = ["add_parser", "filter_events", "format_table", "run_command"]

DESCRIPTION = """\
Merge the recovery event logs of a run directory into one timeline, ordered by time:
which fault was injected where, which rank saw what first (link.down, rank.lost, ...),
which action followed (reroute, repair, restart, restore) and how long each took."""

EPILOG = """\
examples:
  resilient events /tmp/chaos-out/run
  resilient events RUN --kind link.,rank.lost --since 10     # from 10 s after the start
  resilient events RUN --json | tail -1 | jq '.events | length'
  resilient events RUN --plot timeline.png                     # needs matplotlib

the run directory is --run-dir of 'resilient run', or OUT/run of 'resilient chaos';
events live in RUN/events/*.jsonl (docs/EVENTS.md)."""

_USAGE_ERROR = 2


def add_parser(subparsers: Any) -> None:
    """Register ``events`` on the ``resilient`` command's subparsers."""
    cmd = subparsers.add_parser(
        "events",
        help="merge the recovery event logs of a run directory into one timeline",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cmd.add_argument("run_dir", help="run directory (holds events/*.jsonl)")
    cmd.add_argument("--json", action="store_true", help="print the events as JSON (last line)")
    cmd.add_argument(
        "--kind",
        default=None,
        help="only these kinds, comma-separated; a trailing dot matches a family (link.)",
    )
    cmd.add_argument(
        "--since",
        type=float,
        default=None,
        help="only events this many seconds after the first one (or after a UNIX time)",
    )
    cmd.add_argument("--rank", type=int, default=None, help="only events of this rank")
    cmd.add_argument("--plot", default=None, metavar="FILE.png", help="draw the timeline")
    cmd.set_defaults(handler=run_command)


def filter_events(
    events: Sequence[dict[str, Any]],
    *,
    kinds: str | None = None,
    since: float | None = None,
    rank: int | None = None,
) -> list[dict[str, Any]]:
    """The events matching every filter given (see the options of the command)."""
    start = float(events[0]["ts"]) if events else 0.0
    wanted = [k.strip() for k in kinds.split(",") if k.strip()] if kinds else []

    def keep(ev: dict[str, Any]) -> bool:
        kind = str(ev.get("kind", ""))
        if wanted and not any(
            kind == w or (w.endswith(".") and kind.startswith(w)) for w in wanted
        ):
            return False
        if since is not None:
            # Small numbers are offsets from the first event, large ones UNIX times.
            bound = start + since if since < 1e9 else since
            if float(ev["ts"]) < bound:
                return False
        return rank is None or ev.get("rank") == rank

    return [ev for ev in events if keep(ev)]


def _links(ev: dict[str, Any]) -> str:
    parts = []
    for link in ev.get("links") or []:
        if isinstance(link, list) and len(link) == 3:
            a, b, rail = link
            parts.append(f"{a}-{'*' if b == -1 else b}@r{rail}")
    return ",".join(parts) or "-"


def _who(ev: dict[str, Any]) -> str:
    rank = ev.get("rank", -1)
    return "-" if rank == -1 else f"{rank}/{ev.get('incarnation', 0)}"


def format_table(events: Sequence[dict[str, Any]], start: float | None = None) -> str:
    """The events as an aligned table; times are seconds since ``start``."""
    if not events:
        return "no events"
    t0 = float(events[0]["ts"]) if start is None else start
    rows = [("t+s", "rank/inc", "epoch", "kind", "links", "ms", "what")]
    for ev in events:
        dur = ev.get("duration_ms")
        what = "; ".join(x for x in (str(ev.get("reason") or ""), str(ev.get("action") or "")) if x)
        rows.append(
            (
                f"{float(ev['ts']) - t0:8.3f}",
                _who(ev),
                str(ev.get("epoch", "-")),
                str(ev.get("kind", "?")),
                _links(ev),
                "-" if dur is None else f"{float(dur):.1f}",
                what[:120],
            )
        )
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]) - 1)]
    return "\n".join(
        "  ".join(c.ljust(w) for c, w in zip(r[:-1], widths, strict=True)) + "  " + r[-1]
        for r in rows
    )


def run_command(args: argparse.Namespace) -> int:
    from resilient.events import SCHEMA_VERSION, events_dir, read_events

    run_dir = Path(args.run_dir)
    if not events_dir(run_dir).is_dir():
        print(
            f"resilient: error: {events_dir(run_dir)}: no event logs here (is {run_dir} "
            "a --run-dir of 'resilient run', or OUT/run of 'resilient chaos'?)",
            file=sys.stderr,
        )
        return _USAGE_ERROR
    events = read_events(run_dir)
    start = float(events[0]["ts"]) if events else None
    chosen = filter_events(events, kinds=args.kind, since=args.since, rank=args.rank)
    print(format_table(chosen, start))
    if args.plot:
        from recovery._plot import PlotUnavailable, plot_timeline

        try:
            plot_timeline(chosen, args.plot, start=start)
        except PlotUnavailable as exc:
            print(f"resilient: error: {exc}", file=sys.stderr)
            return _USAGE_ERROR
        print(f"timeline drawn to {args.plot}")
    if args.json:
        print(json.dumps({"schema_version": SCHEMA_VERSION, "events": chosen}, default=str))
    return 0
