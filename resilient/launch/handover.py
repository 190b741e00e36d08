"""The line that hands a primed rank (:mod:`resilient.launch.primed`) its rank.

Apart from both ends: the agent's side (:class:`resilient.launch.spares.PrimedRanks`)
must not import the module the primed process runs as ``__main__``.
"""

from __future__ import annotations

import json
from typing import Any

__all__ = ["handover_line", "parse_handover"]


def handover_line(env: dict[str, str], argv: list[str]) -> bytes:
    """The line that hands a primed process its rank (see the module docstring)."""
    return json.dumps({"env": env, "argv": argv}).encode() + b"\n"


def parse_handover(line: bytes) -> tuple[dict[str, str], list[str]]:
    """``(env, argv)`` of a hand-over line.

    Raises:
        ValueError: not a JSON object with a string map ``env`` and a non-empty
            string list ``argv``.
    """
    try:
        obj: Any = json.loads(line)
    except ValueError as exc:
        raise ValueError(f"the hand-over is not JSON: {exc}") from exc
    env, argv = (obj.get("env"), obj.get("argv")) if isinstance(obj, dict) else (None, None)
    if not isinstance(env, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in env.items()
    ):
        raise ValueError("the hand-over's env is not a map of strings")
    if not isinstance(argv, list) or not argv or not all(isinstance(a, str) for a in argv):
        raise ValueError("the hand-over's argv is not a non-empty list of strings")
    return env, argv
