"""A primed rank: ``python -m resilient.launch.primed``, a rank's process before it has one.

A warm spare (:mod:`resilient.launch.standby`) runs the script with its rank's
environment up to admission. Where that is not wanted or not possible (a spare
node's agent learns which node's ranks it runs only when it takes a lost node
over), the launcher can still pay in advance for what every rank starts with,
the interpreter and ``import torch`` (the larger part of a cold start on a host
whose cores are shared, docs/BENCHMARKS.md). It starts one of these per rank slot
for the slot's next restart (``LaunchConfig.primed_restarts``), and a spare node
one per rank it would run, with the node's environment (no rank's variables).
Each imports torch (and ``torch._dynamo``, which DDP's constructor imports) and
this library, then waits on stdin for one line,
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
    # What every rank imports first (the backend registers itself as torch loads),
    # and torch._dynamo, which DDP's constructor imports (1.4 s quiet: sympy).
    import torch
    import torch._dynamo
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
