"""The local launcher: a torchrun-like supervisor that restarts only the rank that failed.

``Launcher(LaunchConfig(nproc=4, script="train.py")).run()`` starts an embedded etcd
(unless ``etcd`` names a cluster), spawns ``nproc`` ranks of ``python -u script`` on
this machine, relays their output prefixed ``[rank N]``, and supervises them (with
``nnodes`` > 1 it is one node's agent: :mod:`resilient.launch.node_agent`):

* a rank that exits 0 is done; so is one killed by a signal *after* it left the
  job on purpose (its process group shut down and wrote its departure to etcd):
  a native library aborting at interpreter exit is reported, not restarted;
* a rank that fails (non-zero exit or a signal) is started again *alone*, with the
  same rank id and its incarnation + 1, while the job-wide restart budget
  (``max_restarts``, as in torchrun) lasts; the other ranks are not touched, so
  the data plane can shrink around the lost rank and re-admit the replacement
  (its warm spare if kept, else its primed process past ``import torch``);
* once the budget is spent, the next failure stops every rank and the launcher
  returns that rank's exit code (death by signal N reported as 128+N, like a shell).

SIGINT/SIGTERM to the launcher stop every rank (SIGTERM, ``grace_s``, SIGKILL) and
the embedded etcd, and ``run()`` returns 130/143. Every child runs in its own session
with a parent-death signal, so none outlives the launcher.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import sys
import threading
import time
from typing import TYPE_CHECKING, Any, Final

from resilient.config import EXIT_EVICTED
from resilient.errors import LauncherError, MembershipError
from resilient.launch.launch_config import (
    EXIT_FENCED,
    MAX_LOCAL_RANKS,
    MAX_RAILS,
    LaunchConfig,
    loopback_rails,
    new_job_name,
)
from resilient.launch.node_agent import fence_notice, meet_nodes, node_notice, takeover_notice
from resilient.launch.node_watch import NodeWatch, fenced_events, takeover_events
from resilient.launch.rank_env import RANK_VAR_HELP, RankVar
from resilient.launch.rank_procs import (
    RankOutput,
    SignalTrap,
    describe_exit,
    reap,
    shell_exit_code,
    signal_group,
)
from resilient.launch.slots import (
    NEXT_SPARE_S,
    Slot,
    SpareTending,
    finished_notice,
    kill_now,
    replacement_slots,
    slot_state,
    stop_slots,
)
from resilient.launch.spares import PrimedRanks

if TYPE_CHECKING:
    from membership.server import EmbeddedEtcd
    from resilient.events import EventLog
    from resilient.launch.leases import LeaseWatch
    from resilient.launch.metrics import JobMetrics, MetricsServer
    from resilient.launch.node_agent import NodeMeeting

__all__ = [
    "MAX_LOCAL_RANKS",
    "MAX_RAILS",
    "RANK_VAR_HELP",
    "LaunchConfig",
    "Launcher",
    "RankVar",
    "loopback_rails",
    "new_job_name",
]

logger = logging.getLogger(__name__)

_POLL_S: Final = 0.05
# How often member leases are checked for a hung rank (plus the lease TTL).
_LEASE_POLL_S: Final = 0.25
# How long to wait for a dead rank's last output before announcing its exit.
_DRAIN_S: Final = 1.0


class _Run(SpareTending):
    """The state of one ``Launcher.run()``: etcd, the rank slots, the restart budget."""

    def __init__(
        self, config: LaunchConfig, trap: SignalTrap, stop: threading.Event | None = None
    ) -> None:
        self._cfg = config
        self._trap = trap
        self._stop = stop if stop is not None else threading.Event()
        self._out = RankOutput(config.log_dir, echo=config.echo)
        # Spares are due at once (the supervisor starts them after the ranks);
        # until then spare_warming() already counts them.
        spares_due = 0.0 if config.warm_spares else None
        self._slots = [
            # primed_at 0: started once the ranks are (when primed restarts are on)
            Slot(config.global_rank(local), spare_at=spares_due, primed_at=0.0)
            for local in range(config.nproc)
        ]
        self._etcd: EmbeddedEtcd | None = None
        self._etcd_url = config.etcd or ""
        # torch's rendezvous store, hosted here (node 0's agent) rather than by
        # rank 0: a rank 0 that a replacement takes over would otherwise take the
        # store with it. Other nodes' agents learn where it is in etcd.
        self._nodes: NodeMeeting | None = None
        self._master_addr = config.master_addr
        self._master_port = 0
        self._restarts = 0
        self._leases: LeaseWatch | None = None
        self._metrics: MetricsServer | None = None
        self._job_metrics: JobMetrics | None = None
        self._lease_poll_at = 0.0
        self._fenced: str | None = None  # why the node lease's watchdog fenced us
        self._fenced_at = 0.0  # when (time.time(): its events are dated then)
        self._primed = PrimedRanks(0, {})  # a spare node's ranks past `import torch`
        self._node_watch: NodeWatch | None = None
        self._events: EventLog | None = None
        if config.run_dir is not None:
            from resilient.events import EventLog

            self._events = EventLog(config.run_dir, job=config.job, rank=-1, name="launcher")

    def execute(self) -> int:
        """Start everything and supervise until the job ends; return the exit code.

        Raises:
            LauncherError: a directory, the embedded etcd or a rank could not be started.
        """
        self._make_dirs()
        self._start_etcd()
        cfg = self._cfg
        if cfg.spare:  # past `import torch` while the spare waits for a node to take
            self._primed = PrimedRanks(cfg.nproc, cfg.node_environ())
        try:
            self._nodes = meet_nodes(cfg, self._etcd_url, self._stopping)
        except LauncherError:
            if (code := self._signalled()) is not None:
                return code  # SIGINT/SIGTERM while the agents waited for each other
            raise
        if self._nodes.finished:
            self._out.notice(f"job {cfg.job} finished (node 0 is done); this spare was not needed")
            return 0
        self._master_addr = self._nodes.master_addr
        self._master_port = self._nodes.master_port
        if self._etcd_url:
            from resilient.launch.leases import LeaseWatch

            self._leases = LeaseWatch(self._etcd_url, cfg.job, cfg.token)
        if self._nodes.took_over is not None:
            cfg = self._take_over(self._nodes.took_over, self._nodes.incarnations)
        self._nodes.watch_lease(self._fence)
        self._node_watch = NodeWatch(
            cfg, self._nodes, self._leases, emit=self._event, notice=self._out.notice
        )
        self._publish_budget()
        self._out.notice(
            f"job {cfg.job}: {node_notice(cfg)}{cfg.nproc} rank(s) x {cfg.rails} rail(s), "
            f"etcd {self._etcd_url}"
            f"{' (embedded)' if self._etcd else ''}, up to {cfg.max_restarts} restart(s)"
        )
        for slot in self._slots:
            if (code := self._signalled()) is not None:
                return code
            self._start(slot)
        self._serve_metrics()
        return self._supervise()

    def _take_over(self, node: int, incarnations: dict[int, int]) -> LaunchConfig:
        """This spare took lost ``node`` over (or this agent took its own node back):
        its ranks start as replacements, at the next incarnation each, announced so
        that the survivors wait for them (or, shrunk without them, admit them)."""
        self._cfg = cfg = dataclasses.replace(self._cfg, node_rank=node)
        self._slots = replacement_slots(cfg, incarnations, self._slots)
        assert self._nodes is not None
        self._out.notice(takeover_notice(node, self._slots, came_back=self._nodes.came_back))
        for slot in self._slots:
            self._announce(slot, "cold")
        takeover_events(self._event, self._nodes, node, self._slots)
        return cfg

    def _fence(self, why: str) -> None:
        """Called from the node lease's watchdog thread: kill every rank and standby
        now, so none runs once etcd may have let another node take this one's ranks.
        Set first: a process started after the kill list was read sees it and dies."""
        self._fenced_at, self._fenced = time.time(), why
        kill_now(self._slots)

    def _fenced_exit(self) -> int | None:
        if self._fenced is None:
            return None
        self._out.notice(fence_notice(self._cfg.node_rank, self._fenced, EXIT_FENCED))
        fenced_events(self._event, self._cfg.node_rank, self._slots, self._fenced, self._fenced_at)
        return EXIT_FENCED

    def shutdown(self) -> None:
        """Stop every live rank, then the embedded etcd; safe to call at any point."""
        try:
            self._stop_ranks()
        finally:
            self._out.close()
            if self._leases is not None:
                self._leases.close()
            if self._metrics is not None:
                self._metrics.stop()
            if self._job_metrics is not None:
                self._job_metrics.close()
            if self._events is not None:
                self._events.close()
            if self._nodes is not None:
                self._nodes.close()
                self._nodes = None
            if self._etcd is not None:
                self._etcd.stop()
                self._etcd = None

    def _supervise(self) -> int:
        while True:
            if (code := self._signalled()) is not None or (code := self._fenced_exit()):
                return code
            self._poll_leases()
            if self._node_watch is not None:
                self._node_watch.poll()
            for slot in self._slots:
                if (code := self._check(slot)) is not None:
                    return self._fenced_exit() or code  # a rank the fence killed
                self._tend_spare(slot)
                self._tend_primed(slot)
            if all(slot.done for slot in self._slots):
                if self._nodes is not None:
                    self._nodes.mark_done()
                self._out.notice(finished_notice(self._slots))
                return 0
            time.sleep(_POLL_S)

    def _serve_metrics(self) -> None:
        """Start the Prometheus endpoint, if asked for (resilient.launch.metrics).

        Raises:
            LauncherError: the port cannot be bound.
        """
        cfg = self._cfg
        if cfg.metrics_port is None:
            return
        from resilient.launch.metrics import JobMetrics, MetricsServer

        def slots() -> list[tuple[int, int, str]]:
            return [(s.rank, s.incarnation, slot_state(s)) for s in self._slots]

        self._job_metrics = JobMetrics(
            job=cfg.job, slots=slots, restarts=lambda: self._restarts,
            run_dir=cfg.run_dir, etcd_url=self._etcd_url or None,
        )  # fmt: skip
        try:
            self._metrics = MetricsServer("0.0.0.0", cfg.metrics_port, self._job_metrics.collect)
        except OSError as exc:
            raise LauncherError(f"cannot serve metrics on port {cfg.metrics_port}: {exc}") from exc
        self._metrics.start()
        self._out.notice(f"metrics on http://0.0.0.0:{self._metrics.port}/metrics")

    def _poll_leases(self) -> None:
        """Kill a rank whose lease expired while it runs (hung): the kill path and
        the restart budget then handle it like a crash (see resilient.launch.leases)."""
        now = time.monotonic()
        if self._leases is None or now < self._lease_poll_at:
            return
        self._lease_poll_at = now + _LEASE_POLL_S
        for rank, inc in self._leases.expired():
            slot = self._slot_of(rank)  # None: another node's rank
            if slot is None or slot.done or slot.proc is None or slot.incarnation != inc:
                continue
            if reap(slot.proc) is not None:
                continue
            slot.hung = True
            self._out.notice(
                f"rank {rank} (incarnation {inc}) hung: its lease expired while it runs; killing it"
            )
            signal_group(slot.proc, signal.SIGKILL)

    def _check(self, slot: Slot) -> int | None:
        """Act on ``slot``'s exit, if it exited; a non-None result ends the job with it."""
        if slot.done or slot.proc is None or self._fenced is not None:
            return None
        code = reap(slot.proc)
        if code is None:
            return None
        self._out.drain(slot.rank, _DRAIN_S)
        if code == 0:
            slot.done = True
            logger.info("rank %d (incarnation %d) finished", slot.rank, slot.incarnation)
            return None
        if code < 0 and not slot.hung and self._departed(slot):
            self._died_after_leaving(slot, code)
            return None
        what = (
            f"rank {slot.rank} hung (its lease expired) and was killed"
            if slot.hung
            else f"rank {slot.rank} left the job as a straggler (exit code {code})"
            if code == EXIT_EVICTED
            else f"rank {slot.rank} exited with {describe_exit(code)}"
        )
        slot.hung = False
        budget = self._cfg.max_restarts
        restart = self._restarts < budget
        left = not restart and self._may_shrink(slot)
        self._event(
            "rank.lost", rank=slot.rank, incarnation=slot.incarnation, reason=what,
            action="restart" if restart else "go on without it (shrink)" if left
            else "stop the job (no restarts left)",
            left=left,
        )  # fmt: skip
        if restart:
            self._restart(slot, what)
            return None
        if left:
            slot.done = slot.left = True
            self._announce(slot, "none")
            self._out.notice(
                f"{what}; no restarts left: the job goes on without it (--min-ranks "
                f"{self._cfg.min_ranks}; the others shrink after {self._cfg.shrink_after_s:g} s)"
            )
            return None
        self._out.notice(
            f"{what}; no restarts left ({self._restarts}/{budget} used); stopping the other ranks"
        )
        return shell_exit_code(code)

    def _departed(self, slot: Slot) -> bool:
        return self._leases is not None and self._leases.departed(slot.rank, slot.incarnation)

    def _died_after_leaving(self, slot: Slot, code: int) -> None:
        """``slot``'s rank died by a signal after it had left the job on purpose (a
        native library aborting while the interpreter shut down, say). Its work
        was done and its group closed: a replacement would find nothing to join."""
        slot.done = True
        slot.died_after_leaving = code
        what = f"rank {slot.rank} exited with {describe_exit(code)} after it had left the job"
        self._event(
            "rank.lost", rank=slot.rank, incarnation=slot.incarnation, reason=what,
            action="none: its work was done and its process group shut down",
        )  # fmt: skip
        self._out.notice(f"{what} (its process group had shut down); not restarted")

    def _restart(self, slot: Slot, what: str) -> None:
        self._restarts += 1
        slot.incarnation += 1
        # Due before the spare is handed over: spare_warming() is read from other
        # threads, and must not see a moment with neither a spare nor one due.
        slot.spare_at = time.monotonic() + NEXT_SPARE_S
        warm = self._promote_spare(slot)
        self._publish_budget()  # after the promotion: that spare stands ready no more
        self._announce(slot, "warm" if warm else "cold")
        primed = not warm and self._start(slot)
        how = " (warm spare)" if warm else " (primed)" if primed else ""
        self._out.notice(
            f"{what}; restarting as incarnation {slot.incarnation}{how} "
            f"({self._restarts}/{self._cfg.max_restarts} restarts used)"
        )
        self._event(
            "recovery.started", rank=slot.rank, incarnation=slot.incarnation,
            action=f"restarted rank {slot.rank} as incarnation {slot.incarnation}{how}",
        )  # fmt: skip

    def _publish_budget(self) -> None:
        if self._leases is not None:
            cfg = self._cfg
            left = cfg.max_restarts - self._restarts
            self._leases.publish_budget(left, self._spares_on(), self._spares_ready())

    def _announce(self, slot: Slot, how: str) -> None:
        """Tell the survivors (through etcd) whether and how the rank is replaced."""
        if self._leases is not None:
            self._leases.announce(slot.rank, slot.incarnation, how, None)

    def _may_shrink(self, slot: Slot) -> bool:
        """Whether the job may go on without ``slot`` (``min_ranks`` still running)."""
        floor = self._cfg.min_ranks
        # Other nodes' ranks count as running: each agent knows only its own.
        others = self._cfg.world_size - len(self._slots)
        others += sum(1 for s in self._slots if s is not slot and not s.left)
        return floor is not None and others >= floor

    def _event(self, kind: str, **fields: Any) -> None:
        if self._events is not None:
            self._events.emit(kind, **fields)

    def pids(self) -> dict[int, int]:
        """The pid of every rank whose process is running now."""
        return {s.rank: s.proc.pid for s in self._slots if s.proc is not None and not s.done}

    def _stopping(self) -> bool:
        return self._trap.received is not None or self._stop.is_set()

    def _signalled(self) -> int | None:
        sig = self._trap.received
        if sig is None and self._stop.is_set():
            sig = signal.SIGTERM
            self._out.notice("stop requested; stopping all ranks")
            return 128 + sig
        if sig is None:
            return None
        self._out.notice(f"received {signal.Signals(sig).name}; stopping all ranks")
        return 128 + sig

    def _make_dirs(self) -> None:
        for path in (self._cfg.log_dir, self._cfg.run_dir):
            if path is None:
                continue
            try:
                os.makedirs(path, exist_ok=True)
            except OSError as exc:
                raise LauncherError(f"cannot create directory {path!r}: {exc}") from exc

    def _start_etcd(self) -> None:
        if self._cfg.etcd is not None:
            return
        # Imported here: the membership package pulls in gRPC, which `resilient --help`
        # and launches against an external etcd do not need.
        from membership.server import EmbeddedEtcd

        try:
            self._etcd = EmbeddedEtcd()
            self._etcd.start()
        except MembershipError as exc:
            raise LauncherError(f"could not start the embedded etcd: {exc}") from exc
        self._etcd_url = self._etcd.url

    def _start(self, slot: Slot) -> bool:
        """Start ``slot``'s rank; True if from a primed process (a spare node's, or
        the slot's own for a restart). Raises: LauncherError."""
        cfg = self._cfg
        script = [cfg.script, *cfg.script_args]
        argv = [*cfg.wrap_of(slot.rank), sys.executable, "-u", *script]
        source = self._take_primed(slot) or self._primed
        try:
            slot.proc, primed = source.start(self._env(slot), script, argv)
        except OSError as exc:
            raise LauncherError(f"could not start rank {slot.rank}: {exc}") from exc
        if self._fenced is not None:  # fenced while it started: see _fence
            signal_group(slot.proc, signal.SIGKILL)
        try:
            self._out.attach(slot.rank, slot.incarnation, slot.proc)
        except OSError as exc:
            raise LauncherError(f"rank {slot.rank}: cannot open its log file: {exc}") from exc
        how = "primed, " if primed else ""
        pid, inc = slot.proc.pid, slot.incarnation
        logger.info("rank %d started (%spid %d, incarnation %d)", slot.rank, how, pid, inc)
        return primed

    def _env(self, slot: Slot, incarnation: int | None = None) -> dict[str, str]:
        inc = slot.incarnation if incarnation is None else incarnation
        return self._cfg.environ(
            slot.rank, inc, master_addr=self._master_addr, master_port=self._master_port,
            etcd_url=self._etcd_url, run_id=self._nodes.run_id if self._nodes else "",
        )  # fmt: skip

    def _stop_ranks(self) -> None:
        self._primed.close()  # end of file: primed processes exit 0 at once
        stop_slots(self._slots, self._primed.procs, grace_s=self._cfg.grace_s)


class Launcher:
    """Runs one job described by a :class:`LaunchConfig`; see the module docstring."""

    def __init__(self, config: LaunchConfig) -> None:
        self._config = config
        self._stop = threading.Event()
        self._state: _Run | None = None

    def request_stop(self) -> None:
        """Ask a running ``run()`` (from another thread) to stop all ranks, as on SIGTERM."""
        self._stop.set()

    def rank_pids(self) -> dict[int, int]:
        """The pid of each rank running now (empty when ``run()`` is not running)."""
        state = self._state
        return state.pids() if state is not None else {}

    def spare_warming(self, rank: int) -> bool:
        """Whether ``rank``'s warm spare is started (or due) but not ready yet; False
        when spares are off, or ``run()`` is not running."""
        state = self._state
        return state is not None and state.spare_warming(rank)

    @property
    def config(self) -> LaunchConfig:
        return self._config

    def run(self) -> int:
        """Launch and supervise the ranks; return the job's exit code.

        0 when every rank exited 0; the failing rank's code (128+N for signal N) when
        the restart budget ran out; 130/143 after SIGINT/SIGTERM. Signal handlers are
        installed only while this runs, and only when called from the main thread.
        Every rank and the embedded etcd are stopped before it returns or raises.

        Raises:
            LauncherError: a directory, the embedded etcd or a rank could not be started.
        """
        with SignalTrap() as trap:
            state = _Run(self._config, trap, self._stop)
            self._state = state
            try:
                return state.execute()
            finally:
                self._state = None
                state.shutdown()
