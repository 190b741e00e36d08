"""iptables rules that silently drop a set of loopback addresses (a partition: no
error, no FIN, no RST), for tests that run as root."""

from __future__ import annotations

import subprocess
from collections.abc import Sequence


def drop_rules(addrs: Sequence[str], tag: str) -> list[list[str]]:
    """INPUT drops, as a partition loses packets in transit (the sender then sees them
    unacknowledged and retransmits). On loopback the connecting end of a link is
    unbound (source 127.0.0.1), so each address is matched on either side."""
    return [
        ["INPUT", flag, addr, "-m", "comment", "--comment", tag, "-j", "DROP"]
        for addr in addrs
        for flag in ("-d", "-s")
    ]


def iptables(action: str, rules: list[list[str]], *, check: bool = False) -> None:
    """Apply ``action`` (-I, -D) to each rule; -w waits for the xtables lock.

    Raises:
        RuntimeError: with ``check``, a rule was refused.
    """
    for rule in rules:
        done = subprocess.run(["iptables", "-w", "10", action, *rule], check=False,
                              capture_output=True, text=True, timeout=20)  # fmt: skip
        if check and done.returncode != 0:
            raise RuntimeError(f"iptables {action} {rule}: {done.stderr.strip()}")
