"""What a node agent registers in etcd about itself (:mod:`membership.nodes`)."""

from __future__ import annotations

import json
import logging
import os
import socket
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Final

if TYPE_CHECKING:
    from membership.etcd_client import KeyValue

__all__ = ["NodeInfo", "parse_row", "this_host"]

logger = logging.getLogger(__name__)

# What must agree between the agents of one job, with the flag that sets it.
_MUST_AGREE: Final = (
    ("nnodes", "--nnodes"),
    ("nproc_per_node", "--nproc-per-node"),
    ("rails", "rail count (--rails)"),
)


@dataclass(frozen=True, kw_only=True, slots=True)
class NodeInfo:
    """What a node agent registers: its place in the job, where torch's init store
    is (``store``, ``host:port``) and this start's run id (``run``, RESILIENT_RUN_ID);
    those two are set by node 0 only; ``probe``: where the agent's beacon listens
    (:mod:`membership.node_probe`), empty when it has none."""

    node_rank: int
    nnodes: int
    nproc_per_node: int
    rails: int
    host: str = ""
    pid: int = 0
    store: str = ""
    run: str = ""
    # Where the agent's beacon listens (membership.node_probe), ``host:port``.
    probe: str = ""

    def to_json(self) -> str:
        return json.dumps(asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, raw: bytes | str) -> NodeInfo:
        """Raises: ValueError, KeyError, TypeError: not a node record."""
        d = json.loads(raw)
        return cls(
            node_rank=int(d["node_rank"]),
            nnodes=int(d["nnodes"]),
            nproc_per_node=int(d["nproc_per_node"]),
            rails=int(d["rails"]),
            host=str(d.get("host", "")),
            pid=int(d.get("pid", 0)),
            store=str(d.get("store", "")),
            run=str(d.get("run", "")),
            probe=str(d.get("probe", "")),
        )

    def where(self) -> str:
        return f"node {self.node_rank} (agent pid {self.pid} on {self.host or '?'})"

    def mismatch(self, other: NodeInfo) -> str | None:
        """How ``other`` disagrees with this node, or None when they agree."""
        diffs = [
            f"{flag} {getattr(other, name)} there, {getattr(self, name)} here"
            for name, flag in _MUST_AGREE
            if getattr(other, name) != getattr(self, name)
        ]
        return "; ".join(diffs) or None


def parse_row(row: KeyValue | None) -> NodeInfo | None:
    """The node record in ``row``; None when there is none or it is malformed
    (logged: a record no agent of this version wrote)."""
    if row is None:
        return None
    try:
        return NodeInfo.from_json(row.value)
    except (ValueError, KeyError, TypeError):
        logger.warning("ignoring a malformed node record at %s", row.key)
        return None


def this_host() -> tuple[str, int]:
    """This machine's name and this process's pid, for a :class:`NodeInfo`."""
    return socket.gethostname(), os.getpid()
