"""Links: one two-rank connection per (peer, rail), the unit that fails and is repaired.

- ``table``: :class:`LinkTable`, a rank's links, built on first use, carried across epochs.
- ``link``: :class:`Link`, deadlines, breaking, failover hooks, TCP health of a link.
- ``pair_groups``: the two-rank gloo or NCCL group a :class:`Link` runs over.
- ``socket_link``: :class:`SocketLink`, a link over a plain TCP socket (the CPU default).
- ``socket_connect``: the store rendezvous that connects a socket link's two ends.
- ``socket_pair``: framed, tag-matched messages over one socket.
- ``socket_engine``: the engine that moves every pair's bytes in the waiting thread.
- ``socket_frames``: the frame header, the call bits of tags, :class:`DigestMismatch`.
- ``native_steps`` (C part: ``_stepio``): a quiet step's socket traffic moved in C.
- ``byte_views``: a tensor's bytes as a memoryview and back.
- ``ledger``: a link's unfinished ops and the epoch's tag salt.
- ``stall``: stalled ops reported long before their deadline.
- ``gloo_sockets``, ``gloo_connects``, ``gloo_wait``: the TCP connections under a gloo
  link, its aborted connection attempts, and waits that cutting it interrupts.
- ``repair``: broken links rebuilt in the background and put back.
- ``transfer``: a state moved over one link; ``rails``: a rank's rail addresses.
- ``fault_hook``: link faults injected in-process, for chaos runs without root.

Importing the package is cheap: the names below are loaded on first use (so a
process that needs only ``fault_hook`` or ``rails`` does not import torch). Modules
inside the package import each other by module path, never from here.
"""

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from resilient.links.byte_views import as_tensor, bytes_of
    from resilient.links.ledger import OpLedger, salt_of
    from resilient.links.link import Link
    from resilient.links.rails import resolve_rails
    from resilient.links.repair import (
        CTL_TABLE,
        DATA_TABLE,
        LinkRepair,
        install_agreed,
        staged_rows,
    )
    from resilient.links.socket_frames import CALL_SHIFT, NEWS, DigestMismatch
    from resilient.links.socket_link import SocketLink
    from resilient.links.table import Counters, LinkTable

__all__ = [
    "CALL_SHIFT",
    "CTL_TABLE",
    "DATA_TABLE",
    "NEWS",
    "Counters",
    "DigestMismatch",
    "Link",
    "LinkRepair",
    "LinkTable",
    "OpLedger",
    "SocketLink",
    "as_tensor",
    "bytes_of",
    "install_agreed",
    "resolve_rails",
    "salt_of",
    "staged_rows",
]

_LAZY = {
    "as_tensor": "resilient.links.byte_views",
    "bytes_of": "resilient.links.byte_views",
    "OpLedger": "resilient.links.ledger",
    "salt_of": "resilient.links.ledger",
    "Link": "resilient.links.link",
    "resolve_rails": "resilient.links.rails",
    "CTL_TABLE": "resilient.links.repair",
    "DATA_TABLE": "resilient.links.repair",
    "LinkRepair": "resilient.links.repair",
    "install_agreed": "resilient.links.repair",
    "staged_rows": "resilient.links.repair",
    "CALL_SHIFT": "resilient.links.socket_frames",
    "NEWS": "resilient.links.socket_frames",
    "DigestMismatch": "resilient.links.socket_frames",
    "SocketLink": "resilient.links.socket_link",
    "Counters": "resilient.links.table",
    "LinkTable": "resilient.links.table",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'resilient.links' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)
