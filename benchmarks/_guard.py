"""Clean exits for the benchmarks that make kernel state (``failover.py``, ``degraded.py``
build a netns testbed; ``allreduce.py --rail-rate-mbit`` shapes ``lo``).

Everything those scripts create in the kernel is known to :mod:`chaos.cleanup`:
network namespaces named ``rsl-<id>-*`` (the tbf qdiscs of the ``throttle`` injector and
the NIC states of ``nic-down`` live inside them and go with them), one root-namespace
veth ``rsl<id>m`` per testbed, and the htb qdisc with handle ``7273:`` that
``_common.TcShaper`` puts on ``lo``; none of them adds iptables rules. Each has an
owner record with its builder's pid, and :func:`chaos.cleanup.remove_leftovers`
deletes those whose owner is gone. What this module adds:

* :class:`SignalGuard` (from :mod:`chaos.signals`): SIGINT raises KeyboardInterrupt,
  SIGTERM and SIGHUP raise SystemExit(128 + signum) in the main thread, so the
  scripts' ``finally`` blocks run (the ranks are reaped, the testbed is taken down);
  inside :meth:`SignalGuard.shielded` a signal is held until the block ends, so that
  cleanup itself is never cut short (``NetnsTestbed.down`` shields itself).
* :func:`sweep_own_leftovers`: at start, removes the leftovers of earlier runs whose
  process died (SIGKILL, a crash); live runs' objects are left alone.
* :func:`netns_left`: which of a testbed's namespaces still exist (after cleanup: none).
"""

from __future__ import annotations

import subprocess
from collections.abc import Sequence

from chaos.signals import SIGNALS, SignalGuard, interrupt_for

__all__ = ["SIGNALS", "SignalGuard", "interrupt_for", "netns_left", "sweep_own_leftovers"]


def sweep_own_leftovers() -> int:
    """Delete the library's leftovers whose owner died (``rsl-*`` testbeds, ``lo``'s qdisc).

    Returns how many objects went (namespaces, links, qdiscs, rules, owner records).
    Objects whose owner still runs (another engineer's chaos run, say) are not
    touched: the owner record's pid decides. Nothing happens without root.
    """
    from chaos.testbed import sweep_leftovers

    return sweep_leftovers()


def netns_left(names: Sequence[str]) -> list[str]:
    """Those of ``names`` that ``ip netns list`` still shows."""
    try:
        out = subprocess.run(
            ["ip", "netns", "list"], capture_output=True, text=True, timeout=10, check=False
        ).stdout
    except (OSError, subprocess.TimeoutExpired):
        return list(names)  # cannot tell: say so
    present = {line.split()[0] for line in out.splitlines() if line.strip()}
    return [n for n in names if n in present]
