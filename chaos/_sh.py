"""Running the kernel tools (ip, tc, iptables) with a timeout and a clear error."""

from __future__ import annotations

import logging
import os
import shutil
import subprocess
from collections.abc import Sequence

from resilient.errors import ChaosError

logger = logging.getLogger(__name__)

# Long enough for iptables' xtables lock under load, short enough to never hang a run.
_TIMEOUT_S = 15.0


def is_root() -> bool:
    return os.geteuid() == 0


def require_root(what: str) -> None:
    """Raises ChaosError when not root (network namespaces, tc and iptables need it)."""
    if not is_root():
        raise ChaosError(f"{what} needs root (network namespaces, tc and iptables)")


def require_tool(name: str, hint: str) -> str:
    """The path of ``name``; raises ChaosError with ``hint`` when it is not installed."""
    path = shutil.which(name)
    if path is None:
        raise ChaosError(f"{name!r} is not installed; {hint}")
    return path


def run(argv: Sequence[str], *, check: bool = True, timeout_s: float = _TIMEOUT_S) -> str:
    """Run one command and return its stdout.

    Raises:
        ChaosError: it is missing, timed out, or (with ``check``) exited non-zero;
            the message holds the command and its stderr.
    """
    try:
        done = subprocess.run(
            list(argv), capture_output=True, text=True, timeout=timeout_s, check=False
        )
    except FileNotFoundError as exc:
        raise ChaosError(f"{argv[0]!r} is not installed (needed for: {' '.join(argv)})") from exc
    except subprocess.TimeoutExpired as exc:
        raise ChaosError(f"{' '.join(argv)}: no answer within {timeout_s:g} s") from exc
    if check and done.returncode != 0:
        raise ChaosError(f"{' '.join(argv)}: exit {done.returncode}: {done.stderr.strip()}")
    if done.returncode != 0:
        logger.debug("%s: exit %d: %s", " ".join(argv), done.returncode, done.stderr.strip())
    return done.stdout


def in_netns(netns: str | None, argv: Sequence[str]) -> list[str]:
    """``argv`` run inside ``netns`` (unchanged for None: the current namespace)."""
    if netns is None:
        return list(argv)
    return ["ip", "netns", "exec", netns, *argv]
