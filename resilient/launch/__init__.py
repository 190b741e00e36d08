"""The local launcher: ``resilient run``, a torchrun-like supervisor of one machine's ranks.

* :mod:`~resilient.launch.launcher`: :class:`Launcher`, which starts the ranks, restarts
  only the one that failed, and keeps warm spares.
* :mod:`~resilient.launch.launch_config`: :class:`LaunchConfig`, what it starts and how.
* :mod:`~resilient.launch.rank_env`: the environment variables each rank gets.
* :mod:`~resilient.launch.rank_procs`: output relaying, signals, exits and reaping.
* :mod:`~resilient.launch.slots` and :mod:`~resilient.launch.spares`: rank slots and
  the warm spares kept for them; :mod:`~resilient.launch.standby` is the spare's side,
  :mod:`~resilient.launch.primed` a spare node's rank past ``import torch``.
* :mod:`~resilient.launch.leases`: ranks whose member lease expired while they run.
* :mod:`~resilient.launch.node_agent`: one agent per machine (``--nnodes``) meeting
  the others in etcd.
* :mod:`~resilient.launch.metrics`: the job's Prometheus metrics.
"""

from resilient.launch.launch_config import LaunchConfig, loopback_rails, new_job_name
from resilient.launch.launcher import Launcher
from resilient.launch.rank_env import RANK_VAR_HELP, RankVar

__all__ = ["RANK_VAR_HELP", "LaunchConfig", "Launcher", "RankVar", "loopback_rails", "new_job_name"]
