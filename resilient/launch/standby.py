"""A warm spare: ``python -m resilient.launch.standby [--ready-fd N] SCRIPT [ARGS...]``.

The launcher starts one per rank, with the environment of the rank's next
incarnation, and keeps the write end of its stdin and the read end of the pipe
``--ready-fd`` names (the spare writes one byte there when it stands ready, see
:mod:`resilient.launch.spares`). The spare runs SCRIPT as ``__main__`` with ARGS at
once, exactly as ``python SCRIPT ARGS`` would, so it pays in advance for
everything a replacement does before it can be admitted:
importing torch, ``resilient.init()`` (as a joining rank: collectives run alone,
see :mod:`resilient.collectives.solo`), building the model, DDP's constructor and
:class:`recovery.Session`'s warm-up passes. Then the session calls
:func:`wait_for_go`, which blocks until the launcher writes ``go`` (the rank was
lost and this process takes it). Only after that does the spare join the job's
membership and report for the next epoch, so a standby is never visible to the
running ranks.

End of file instead of ``go`` (the launcher closed the pipe: the job ended or the
spare is not needed) makes the spare exit 0. SCRIPT gets ``/dev/null`` as stdin.
"""

from __future__ import annotations

import contextlib
import os
import runpy
import select
import sys
import time
from typing import Final

__all__ = ["detach_stdin", "run_as_main", "standing_by", "wait_for_go"]

# How often the wait looks whether the launcher is still there (the pipe's EOF
# normally says so; a parent-death signal kills the spare too).
_POLL_S: Final = 1.0

# The launcher's end of the pipe, duplicated away from fd 0; None outside a spare.
_go_fd: int | None = None
# Where to say "ready" once, when the spare starts waiting; None once said.
_ready_fd: int | None = None


def standing_by() -> bool:
    """Whether this process is a warm spare that was not handed its rank yet."""
    return _go_fd is not None


def wait_for_go() -> float:
    """Block until the launcher hands this spare its rank; returns the seconds waited.

    Unbounded by design: a spare waits as long as the job runs. It ends when the
    launcher writes ``go`` (return), closes the pipe or dies (``SystemExit(0)``).

    Raises:
        SystemExit: with code 0, when the launcher no longer needs this spare.
    """
    global _go_fd
    fd, began = _go_fd, time.monotonic()
    if fd is None:
        return 0.0
    _say_ready()
    line = b""
    while not line.endswith(b"\n"):
        ready, _, _ = select.select([fd], [], [], _POLL_S)
        if not ready:
            if os.getppid() == 1:  # orphaned: nobody will ever say go
                raise SystemExit(0)
            continue
        chunk = os.read(fd, 64)
        if not chunk:
            raise SystemExit(0)
        line += chunk
    os.close(fd)
    _go_fd = None
    if line.strip() != b"go":
        raise SystemExit(0)
    return time.monotonic() - began


def _say_ready() -> None:
    """Tell the launcher this spare stands ready (it may hold a fault until then).
    Best effort: a launcher that is gone closes the go pipe as well."""
    global _ready_fd
    fd, _ready_fd = _ready_fd, None
    if fd is None:
        return
    with contextlib.suppress(OSError):
        os.write(fd, b"r")
    with contextlib.suppress(OSError):
        os.close(fd)


def detach_stdin() -> int:
    """Move the launcher's pipe off fd 0 (the script must not read ``go`` by
    accident); the script's stdin becomes /dev/null. Returns the pipe's new fd.
    Also a primed rank's, once handed its rank (resilient.launch.primed)."""
    fd = os.dup(0)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    sys.stdin = open(0, closefd=False)  # noqa: SIM115 - fd 0, kept for the process
    return fd


def main() -> int:
    global _go_fd, _ready_fd
    argv = sys.argv[1:]
    if argv[:1] == ["--ready-fd"] and len(argv) >= 2 and argv[1].isdigit():
        _ready_fd, argv = int(argv[1]), argv[2:]
        # Only this process says ready; what the script starts must not hold the pipe.
        with contextlib.suppress(OSError):
            os.set_inheritable(_ready_fd, False)
    if not argv:
        usage = "usage: python -m resilient.launch.standby [--ready-fd N] SCRIPT [ARGS...]"
        print(usage, file=sys.stderr)
        return 2
    _go_fd = detach_stdin()
    run_as_main(argv)
    return 0


def run_as_main(argv: list[str]) -> None:
    """Run ``argv[0]`` with arguments ``argv[1:]`` as ``python SCRIPT ARGS`` would."""
    sys.argv = list(argv)
    sys.path.insert(0, os.path.dirname(os.path.abspath(argv[0])))
    runpy.run_path(argv[0], run_name="__main__")


if __name__ == "__main__":
    # Run as ``-m``, this file is ``__main__``; the session imports
    # ``resilient.launch.standby``, a second module object. Make them one, so the gate
    # set here is the gate the session sees.
    sys.modules["resilient.launch.standby"] = sys.modules[__name__]
    sys.exit(main())
