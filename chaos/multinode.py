"""A chaos job on several nodes: one ``resilient run`` agent per testbed host.

With ``[job] nodes = N`` the runner does not host a launcher itself. It starts N
agent subprocesses, ``resilient run --nnodes N --node-rank K --nproc-per-node P``,
agent K inside host K's namespace (``ip netns exec``) with that host's rail
addresses (``--rails 10.100.0.<K+1>,...``), all of them on the scenario's etcd on
the management network. The agents meet in etcd and node 0's agent hosts torch's
init store on its management address; global rank ``K * P + L`` runs on host K.
On the loopback testbed the agents run in the root namespace on loopback rails.
With ``spare_nodes = S`` S more agents (``--spare``) run on hosts N..N+S-1: a
spare takes a lost node's rank over and starts its ranks there, on its own rails.

:class:`NodeAgents` stands in for :class:`~resilient.launch.launcher.Launcher`
towards the runner (``run``, ``request_stop``, ``rank_pids``, ``spare_warming``,
``config``) and adds :meth:`NodeAgents.agent_pid` for the node faults. Each
agent's own output goes to ``logs/agent-node<K>.log`` (a spare's to
``logs/agent-spare<S>.log``), its ranks' to
``logs/rank<N>.log`` and their events to ``run/``, as with one launcher.

Every agent, and every process below it, is gone when :meth:`NodeAgents.run`
returns or raises (Ctrl-C included): asked to stop with SIGTERM first (an agent
then stops its ranks), each process tree left after the grace period is killed
(:func:`chaos.node_faults.kill_tree`; the ranks run in sessions of their own).
"""

from __future__ import annotations

import contextlib
import logging
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Collection, Iterable, Mapping
from pathlib import Path
from typing import IO, Final

from chaos import signals
from chaos.node_faults import kill_tree
from chaos.report import FaultRecord
from chaos.testbed import Testbed
from resilient.errors import ChaosError, LauncherError
from resilient.launch.launch_config import EXIT_FENCED
from resilient.launch.launcher import LaunchConfig
from resilient.procs import spawn

__all__ = ["NodeAgents", "agent_argv", "excused_nodes", "job_exit_code"]

logger = logging.getLogger(__name__)

_POLL_S: Final = 0.1
# How long agents may take to meet in etcd (all start at once here).
_JOIN_TIMEOUT_S: Final = 60.0
# Beyond the agents' own SIGTERM-to-SIGKILL grace for their ranks.
_STOP_SLACK_S: Final = 5.0


def agent_argv(config: LaunchConfig, testbed: Testbed, host_index: int) -> list[str]:
    """The command line of the agent on host ``host_index``, wrapped to run there:
    node K's on host K, a spare node's (``--spare``) on a host after the nodes'.

    ``config`` is the job as node 0 sees it (``nproc`` ranks per node, ``nnodes``);
    its ``master_addr`` is where node 0's agent hosts the init store.
    """
    host = testbed.hosts[host_index]
    rails = ",".join(host.rails) if testbed.kind == "netns" else str(config.rails)
    spare = host_index >= config.nnodes
    argv = [
        sys.executable, "-m", "resilient", "run", "--nnodes", str(config.nnodes),
        *(["--spare"] if spare else ["--node-rank", str(host_index)]),
        "--nproc-per-node", str(config.nproc), "--rails", rails,
        "--etcd", str(config.etcd), "--job", config.job,
        "--master-addr", config.master_addr, "--join-timeout", f"{_JOIN_TIMEOUT_S:g}",
        "--max-restarts", str(config.max_restarts),
        "--lease-ttl", f"{config.lease_ttl_s:g}", "--grace", f"{config.grace_s:g}",
    ]  # fmt: skip
    if config.min_ranks is not None:
        argv += ["--min-ranks", str(config.min_ranks)]
        argv += ["--shrink-after", f"{config.shrink_after_s:g}"]
    for flag, path in (("--log-dir", config.log_dir), ("--run-dir", config.run_dir)):
        if path is not None:
            argv += [flag, path]
    argv += [os.path.abspath(config.script), *config.script_args]
    return host.wrap(argv)


def excused_nodes(records: Iterable[FaultRecord], codes: Mapping[int, int | None]) -> set[int]:
    """Nodes whose agent failed because a fault meant it to: killed by a fired
    ``node-kill``, or fenced (exit :data:`EXIT_FENCED`: it lost etcd, so it killed
    its ranks lest they run beside a replacement) after a ``node-partition``."""
    out = set()
    for rec in records:
        if rec.fired_s is None or rec.error is not None or "node" not in rec.params:
            continue
        node = int(rec.params["node"])
        if rec.kind == "node-kill" or (
            rec.kind == "node-partition" and codes.get(node) == EXIT_FENCED
        ):
            out.add(node)
    return out


def job_exit_code(codes: Mapping[int, int | None], killed: Collection[int] = ()) -> int | None:
    """The job's exit code from its agents': 0 when every agent but those a fault
    killed (``killed``) exited 0, else the first other failure (death by signal N
    as 128 + N); None when an agent had no exit code (it never ran)."""
    for node in sorted(codes):
        code = codes[node]
        if node in killed:
            continue
        if code is None:
            return None
        if code != 0:
            return 128 - code if code < 0 else code
    return 0


class NodeAgents:
    """Runs and supervises the job's node agents; see the module docstring."""

    def __init__(
        self, config: LaunchConfig, testbed: Testbed, env: Mapping[str, str], *, spares: int = 0
    ) -> None:
        if config.nnodes + spares != len(testbed.hosts):
            raise ChaosError(
                f"{config.nnodes} node agents and {spares} spare(s) need as many testbed "
                f"hosts, got {len(testbed.hosts)}"
            )
        self._config, self._testbed = config, testbed
        self._env = {**os.environ, **env, "RESILIENT_TOKEN": config.token}
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self._procs: dict[int, subprocess.Popen[bytes]] = {}
        self.codes: dict[int, int | None] = {}

    @property
    def config(self) -> LaunchConfig:
        return self._config

    def request_stop(self) -> None:
        """Ask a running ``run()`` (from another thread) to stop every agent."""
        self._stop.set()

    def rank_pids(self) -> dict[int, int]:
        """Empty: the ranks are the agents' children (the runner finds a rank's pid
        in its progress records)."""
        return {}

    def spare_warming(self, rank: int) -> bool:
        """False: scenarios with nodes run no warm spares (chaos.scenario)."""
        return False

    def agent_pid(self, node: int) -> int:
        """The pid of node ``node``'s agent.

        Raises:
            ChaosError: that agent is not running (not started, or exited).
        """
        with self._lock:
            proc = self._procs.get(node)
        if proc is None or proc.poll() is not None:
            raise ChaosError(f"node {node}'s agent is not running")
        return proc.pid

    def run(self) -> int | None:
        """Start every agent, wait until all have exited (or a stop was requested:
        SIGTERM to each), and return :func:`job_exit_code` of their codes, none
        excused (the runner excuses the nodes its faults killed, from ``codes``).

        Raises:
            LauncherError: an agent could not be started (the others are stopped).
        """
        logs: list[IO[bytes]] = []
        try:
            for index in range(len(self._testbed.hosts)):
                logs.append(self._start(index))
            self._wait()
        finally:
            with signals.shielded():
                self._stop_all()
                for log in logs:
                    log.close()
        return job_exit_code(self.codes)

    def _start(self, node: int) -> IO[bytes]:
        """Start the agent of host ``node`` (a spare's past the job's nodes)."""
        log_dir = Path(self._config.log_dir or ".")
        log_dir.mkdir(parents=True, exist_ok=True)
        name = f"node{node}" if node < self._config.nnodes else f"spare{node - self._config.nnodes}"
        log = (log_dir / f"agent-{name}.log").open("ab")
        argv = agent_argv(self._config, self._testbed, node)
        try:
            proc = spawn(argv, env=self._env, stdout=log, stderr=subprocess.STDOUT)
        except OSError as exc:
            log.close()
            raise LauncherError(f"could not start node {node}'s agent: {exc}") from exc
        with self._lock:
            self._procs[node] = proc
        logger.info("node %d: agent pid %d: %s", node, proc.pid, " ".join(argv))
        return log

    def _wait(self) -> None:
        deadline: float | None = None
        while True:
            with self._lock:
                running = {n: p for n, p in self._procs.items() if p.poll() is None}
            if not running:
                break
            if self._stop.is_set() and deadline is None:
                deadline = time.monotonic() + self._config.grace_s + _STOP_SLACK_S
                for proc in running.values():
                    _signal(proc, signal.SIGTERM)
            if deadline is not None and time.monotonic() > deadline:
                break  # _stop_all kills what is left
            time.sleep(_POLL_S)

    def _stop_all(self) -> None:
        """Kill every agent still running, with its whole tree; record the codes."""
        with self._lock:
            procs = dict(self._procs)
        for node, proc in procs.items():
            if proc.poll() is None:
                with contextlib.suppress(ChaosError):  # it exited meanwhile
                    kill_tree(proc.pid)
                logger.warning("node %d's agent (pid %d) was still running: killed", node, proc.pid)
            try:
                self.codes[node] = proc.wait(timeout=10.0)
            except subprocess.TimeoutExpired:
                self.codes[node] = None


def _signal(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, sig)
