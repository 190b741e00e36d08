"""Detection: what is wrong, seen as early as the signal allows.

- ``nic``: :class:`NicMonitor`, a rail whose interface goes down, in ~10 ms (sysfs).
- ``gpu``: :class:`GpuHealth`, GPU health from NVML when a GPU is there.
- ``peer_watch``: :class:`PeerWatch`, a peer's connections closing while this rank
  waits on someone else.
- ``announcements``: the launcher's word that a rank's process died.
- ``lost_peer``: telling a lost peer from a broken link.
- ``health_board``: :class:`HealthBoard`, the NICs and links each rank sees down,
  shared through the store; ``doorbell``: waking a peer's watcher without polling.
- ``rail_weights``: rail weights from measured rail rates, agreed by every rank;
  ``retransmits``: packet loss per rail from the kernel's TCP counters.
- ``stragglers``: :class:`StragglerWatch`, slow ranks from the signature exchange's
  clocks; ``straggler_scores``: the robust scoring with hysteresis behind it;
  ``stolen_time``: the wall time this process could not run.
- ``slow_rank``: agreeing on one slow rank, for the straggler-aware schedule.

Modules inside the package import each other by module path, never from here.
"""

from resilient.detect.gpu import GpuHealth
from resilient.detect.health_board import HealthBoard
from resilient.detect.nic import NicMonitor
from resilient.detect.peer_watch import PeerWatch
from resilient.detect.rail_weights import WeightLearner
from resilient.detect.slow_rank import SendRates, SlowRankVote
from resilient.detect.stolen_time import StolenTime
from resilient.detect.straggler_scores import StragglerConfig, StragglerDetector
from resilient.detect.stragglers import StragglerWatch, Verdicts

__all__ = [
    "GpuHealth",
    "HealthBoard",
    "NicMonitor",
    "PeerWatch",
    "SendRates",
    "SlowRankVote",
    "StolenTime",
    "StragglerConfig",
    "StragglerDetector",
    "StragglerWatch",
    "Verdicts",
    "WeightLearner",
]
