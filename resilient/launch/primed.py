"""A primed rank: ``python -m resilient.launch.primed``, a spare node's rank before it has one.

A warm spare (:mod:`resilient.launch.standby`) runs the script with its rank's
environment up to admission. A spare node's agent cannot: it learns which node's
ranks it runs only when it takes a lost node over. It can still pay in advance for
what every rank starts with, the interpreter and ``import torch`` (the larger part
of a cold start on a host whose cores are shared, docs/BENCHMARKS.md). So it starts
one of these per rank it would run, with the node's environment (no rank's
variables): each imports torch and this library, then waits on stdin for one line,
the JSON object ``{"env": {...}, "argv": [SCRIPT, ARGS...]}``, and runs SCRIPT as
``python SCRIPT ARGS`` would, in exactly that environment, with ``/dev/null`` as
stdin. End of file instead (the job ended, or the spare was not needed) exits 0;
a line that is not such an object exits 2 and says why on stderr.
"""

from __future__ import annotations

import os
import sys

from resilient.launch.handover import parse_handover
from resilient.launch.standby import detach_stdin, run_as_main

__all__: list[str] = []


def main() -> int:
    # What every rank imports first (the backend registers itself as torch loads).
    import torch
    import torch.distributed  # noqa: F401

    import resilient.process_group  # noqa: F401

    line = sys.stdin.buffer.readline()
    if not line:
        return 0
    try:
        env, argv = parse_handover(line)
    except ValueError as exc:
        print(f"resilient.launch.primed: {exc}", file=sys.stderr)
        return 2
    os.environ.clear()
    os.environ.update(env)
    os.close(detach_stdin())  # the agent's pipe said all it had to say
    run_as_main(argv)
    return 0


if __name__ == "__main__":
    sys.exit(main())
