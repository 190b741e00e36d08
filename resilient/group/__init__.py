"""The process group's collaborators: what :class:`ResilientProcessGroup` holds.

- ``epoch_control``: :class:`EpochControl`, what the group runs for one epoch (members,
  engines, health board, call checks, learners) and how it moves to the next.
- ``peer_loss``: :class:`PeerLoss`, declaring a peer lost and giving up the
  epoch's calls; ``rescue``: finishing a small call a lost peer left complete on
  some survivors only.
- ``calls``: :class:`CallRunner`, the communication thread that runs calls in order.
- ``gathers``: :class:`GatherCalls`, the gather and scatter collectives.
- ``state_transfer``: :class:`StateTransfer`, a donor's state to a replacement over a
  data link, and links built ahead of first use.
- ``args``: argument checks on the caller's thread, and the known-call cache.
- ``work``: :class:`ResilientWork` and tensor packing; ``handoff``: handing work to
  another thread without waking it while holding the GIL.

Modules inside the package import each other by module path, never from here.
"""

from resilient.group.calls import CallRunner
from resilient.group.epoch_control import EpochControl
from resilient.group.gathers import GatherCalls
from resilient.group.peer_loss import PeerLoss
from resilient.group.state_transfer import StateTransfer
from resilient.group.work import ResilientWork

__all__ = [
    "CallRunner",
    "EpochControl",
    "GatherCalls",
    "PeerLoss",
    "ResilientWork",
    "StateTransfer",
]
