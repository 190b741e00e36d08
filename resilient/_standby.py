"""A warm spare: ``python -m resilient._standby SCRIPT [ARGS...]``.

Imports torch and the data plane (seconds on a cold machine: most of a cold
replacement's start), then waits for one line on stdin. ``go`` runs SCRIPT as
``__main__`` with ARGS, exactly as ``python SCRIPT ARGS`` would; anything else
(end of file: the launcher closed the pipe) exits 0. The launcher started it with
the environment of the rank's next incarnation.
"""

from __future__ import annotations

import os
import runpy
import sys


def main() -> int:
    if len(sys.argv) < 2:
        print("usage: python -m resilient._standby SCRIPT [ARGS...]", file=sys.stderr)
        return 2
    script, *args = sys.argv[1:]
    # The slow part, paid up front: torch, and torch._dynamo, which DDP's
    # constructor imports on first use (measured: 1.4 s and 1.8 s here).
    import torch._dynamo
    import torch.distributed
    import torch.nn.parallel

    import recovery.session
    import resilient.backend

    del torch, recovery, resilient  # imported for their cost only

    if sys.stdin.readline().strip() != "go":
        return 0
    sys.argv = [script, *args]
    sys.path.insert(0, os.path.dirname(os.path.abspath(script)))
    runpy.run_path(script, run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
