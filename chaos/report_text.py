"""The chaos report (:func:`chaos.report.build_report`) as text for a terminal."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from chaos import _fast_path

__all__ = ["render"]


def _fmt(value: Any) -> str:
    if value is None:
        return "-"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def _detection_text(f: Mapping[str, Any]) -> str:
    """The detection as text: kind, writer rank, delay, and how many unrelated events."""
    by = (f.get("detection") or {}).get("rank")
    text = (
        f"detected {f['detected']}{'' if by is None else f' (rank {by})'} "
        f"after {_fmt(f['detect_ms'])} ms"
        if f.get("detected")
        else "no detection reported"
    )
    if n := (f.get("unrelated") or {}).get("count"):
        text += f" ({n} unrelated)"
    return text


def _recovery_text(f: Mapping[str, Any]) -> str:
    """The recovery time and the library's span beside it, where either was measured."""
    total, span = f.get("recovery_s"), f.get("library_recovery_s")
    if total is None and span is None:
        return ""
    return f"; training again after {_fmt(total)} s (library span {_fmt(span)} s)"


def render(report: Mapping[str, Any]) -> str:
    """The report as text for a terminal."""
    lines = [
        f"scenario {report['scenario']} ({report['topology']}): "
        f"{'PASSED' if report['passed'] else 'FAILED'} in {report['duration_s']:.1f} s, "
        f"launcher exit {_fmt(report['exit_code'])}"
        f"{' (timed out)' if report['timed_out'] else ''}"
    ]
    sm = report["step_ms"]
    lines.append(
        f"steps: target {report['steps']['target']}, done per rank "
        f"{report['steps']['completed']}, replayed {report['steps']['replayed']}"
        + (f", left out (shrink) {left}" if (left := report["steps"].get("left_out")) else "")
        + "; "
        f"ms/step before faults {_fmt(sm['before_ms'])}, during {_fmt(sm['during_ms'])}"
        f" (x{_fmt(sm['slowdown'])})"
    )
    if fast := _fast_path.render_line(report.get("fast_path")):
        lines.append(fast)
    lines.append("faults:")
    for f in report["faults"]:
        params = ", ".join(f"{k}={v}" for k, v in sorted(f["params"].items()))
        when = f"t={_fmt(f['fired_s'])}s step {_fmt(f['fired_step'])}"
        detected = _detection_text(f)
        acts = ", ".join(f.get("actions") or []) or "no actions reported"
        err = f"  ERROR: {f['error']}" if f.get("error") else ""
        how = f.get("detail", {}).get("injected", "real")
        how = "" if how == "real" else f" [{how}]"
        if held := f.get("detail", {}).get("held_for_spare_s"):
            how += f" [held {_fmt(held)} s for the warm spare]"
        lines.append(
            f"  [{f['index']}] {f['kind']}({params}){how} {when}, until "
            f"t={_fmt(f['stopped_s'])}s; {detected}; {acts}{_recovery_text(f)}{err}"
        )
    lines.append("expectations:")
    for r in report["expectations"]:
        mark = "pass" if r["passed"] else "FAIL"
        note = f"  ({r['note']})" if r["note"] else ""
        lines.append(
            f"  {mark}  {r['name']}: expected {_fmt(r['expected'])}, "
            f"measured {_fmt(r['measured'])}{note}"
        )
    return "\n".join(lines)
