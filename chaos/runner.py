"""Runs one chaos scenario end to end and reports what happened.

:func:`run_scenario` builds the testbed (netns as root, else loopback), starts the
scenario's own etcd (1 or 3 members, in the root namespace on the management
network), runs the fault-free reference job when an expectation needs it (cached
under :func:`chaos.reference_key.reference_key`), then runs the job under the
local launcher (or, with ``[job] nodes``, one ``resilient run`` agent per testbed
host: :mod:`chaos.multinode`) while a controller thread fires each fault at its time or step,
undoes it after ``duration_s``, and draws progress. Everything is torn down
afterwards, also on error, Ctrl-C and (under a :class:`~chaos.signals.SignalGuard`,
as ``resilient chaos`` installs) SIGTERM and SIGHUP; a signal during the reference
run ends the scenario there. The result is the dict of :func:`chaos.report.build_report`, also
written to ``OUT/report.json`` beside the ranks' logs (``OUT/logs``) and their
event logs (``OUT/run``).
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Final

from chaos import signals
from chaos._display import Display
from chaos._progress_watch import ProgressWatch
from chaos.etcd_security import ROOT_PASSWORD, client_env, etcd_security
from chaos.injector_kinds import make_injector
from chaos.injectors import InjectionContext, Injector, needs_netns
from chaos.multinode import NodeAgents, excused_nodes, job_exit_code
from chaos.reference_key import reference_key
from chaos.report import FaultRecord, RunFacts, build_report
from chaos.scenario import Fault, Scenario
from chaos.testbed import LoopbackTestbed, NetnsTestbed, Testbed, sweep_leftovers
from membership.etcd_client import EtcdClient
from membership.guarded import job_client
from membership.keys import JobKeys
from membership.server import EtcdCluster
from resilient.config import etcd_config
from resilient.errors import ChaosError, MembershipError, ResilientError
from resilient.events import EventLog, read_events
from resilient.launch.launcher import LaunchConfig, Launcher, new_job_name

__all__ = ["make_testbed", "run_scenario"]

logger = logging.getLogger(__name__)

# Every key a job writes is under its prefix (membership.keys): the launcher's
# names are job-<hex>.
_JOB_KEY: Final = re.compile(r"/resilient/job-[0-9a-f]+/")

_TICK_S: Final = 0.02
# A due fault waits at most this long for warm spares to stand ready (a scenario
# with spares means to test the job with them, and the warm takeover); then it
# fires anyway and the report says the spare was not ready.
_SPARE_HOLD_S: Final = 120.0
_LOSES_RANK: Final = frozenset({"kill", "hang"})


def make_testbed(scenario: Scenario) -> Testbed:
    """The testbed the scenario asks for: netns hosts, or loopback rails (network
    faults then go through the ranks' in-process fault hook)."""
    job = scenario.job
    # One host per node agent (each with its ranks), else one per rank.
    hosts = job.nodes + job.spare_nodes if job.nodes > 1 else job.nproc
    if job.topology == "netns":
        return NetnsTestbed(hosts, job.rails, ranks_per_host=job.ranks_per_node)
    return LoopbackTestbed(hosts, job.rails, ranks_per_host=job.ranks_per_node)


def _control(client: EtcdClient, job: str) -> Callable[[str, Mapping[str, Any] | None], None]:
    """Writes (or, with None, deletes) one in-process fault record of ``job``."""
    prefix = JobKeys(job).chaos_faults

    def write(fault_id: str, record: Mapping[str, Any] | None) -> None:
        try:
            if record is None:
                client.delete(prefix + fault_id)
            else:
                client.put(prefix + fault_id, json.dumps(dict(record)))
        except MembershipError as exc:
            raise ChaosError(f"fault control record {fault_id}: {exc}") from exc

    return write


def _script_args(scenario: Scenario) -> tuple[str, ...]:
    args = list(scenario.job.args)
    if "--steps" not in args:
        args += ["--steps", str(scenario.job.steps)]
    if "--seed" not in args:
        args += ["--seed", str(scenario.job.seed)]
    return tuple(args)


def _script_path(scenario: Scenario, source: str) -> str:
    script = Path(scenario.job.script)
    if script.is_absolute() or script.is_file() or not source:
        return str(script)
    beside = Path(source).parent / script
    return str(beside) if beside.is_file() else str(script)


class _Controller:
    """Fires and undoes faults and draws progress while the launcher runs."""

    def __init__(
        self,
        faults: tuple[Fault, ...],
        ctx: InjectionContext,
        launcher: Launcher | NodeAgents,
        watch: ProgressWatch,
        display: Display,
        timeout_s: float,
        events: EventLog,
    ) -> None:
        self.t0 = time.time()
        self._events = events
        self.records = [
            FaultRecord(
                index=i,
                kind=f.kind,
                params=dict(f.params),
                at_step=f.at_step,
                at_s=f.at_s,
                duration_s=f.duration_s,
                max_detect_ms=f.max_detect_ms,
            )
            for i, f in enumerate(faults)
        ]
        self._faults = faults
        self._injectors: list[Injector | None] = [None] * len(faults)
        self._ctx, self._launcher, self._watch = ctx, launcher, watch
        self._display, self._timeout_s = display, timeout_s
        self.timed_out = False
        self._halt = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-controller", daemon=True)
        self._held_since: dict[int, float] = {}  # fault index -> when it was first due
        self._spares_seen_ready = False  # every rank's first spare stood ready once
        self._trained_at: float | None = None  # when a rank first reported a step

    def start(self) -> None:
        self.t0 = time.time()
        self._thread.start()

    def finish(self) -> None:
        """Stop the thread and undo every fault still active."""
        self._halt.set()
        self._thread.join(15.0)
        for rec, inj in zip(self.records, self._injectors, strict=True):
            if inj is not None and inj.active:
                self._undo(rec, inj)

    def _now(self) -> float:
        return time.time() - self.t0

    def _due(self, fault: Fault) -> bool:
        if fault.at_s is not None:
            return self._training_s() >= fault.at_s
        rank = fault.param("rank")
        step = self._watch.step_of(int(rank)) if rank is not None else self._watch.max_step()
        return fault.at_step is not None and step >= fault.at_step

    def _training_s(self) -> float:
        """Seconds since a rank first reported a step (-1 before): what ``at_s``
        counts. A fault in the job's start-up has no committed step to recover to,
        and a busy host's start-up took longer than a soak's fault-free 10 s (every
        fault of seed 3 then hit a job that never trained)."""
        if self._trained_at is None:
            if self._watch.max_step() < 0:
                return -1.0
            self._trained_at = time.time()
        return time.time() - self._trained_at

    def _held(self, rec: FaultRecord, fault: Fault) -> bool:
        """Whether a due fault still waits for warm spares (up to ``_SPARE_HOLD_S``):
        no fault fires before every rank's spare first stands ready, and a fault that
        loses a rank waits for that rank's next spare. The wait goes in its detail."""
        now = self._now()
        since = self._held_since.setdefault(rec.index, now)
        waiting = self._spares_warming(fault)
        if waiting and now - since < _SPARE_HOLD_S:
            if now == since:
                self._display.notice(f"{fault.kind} is due; it waits for {waiting} to stand ready")
            return True
        self._spares_seen_ready = True
        if now > since:
            rec.detail["held_for_spare_s"] = round(now - since, 2)
            if waiting:
                rec.detail["spare"] = "not ready"
        return False

    def _spares_warming(self, fault: Fault) -> str:
        """Which warm spares ``fault`` waits for, in words; empty when none."""
        launcher = self._launcher
        if not self._spares_seen_ready:
            ranks = [r for r in range(launcher.config.nproc) if launcher.spare_warming(r)]
            if ranks:
                return f"the warm spares of ranks {ranks}"
        rank = fault.param("rank")
        if fault.kind in _LOSES_RANK and rank is not None and launcher.spare_warming(int(rank)):
            return f"rank {rank}'s warm spare"
        return ""

    def _step_of(self, fault: Fault) -> int:
        rank = fault.param("rank")
        return self._watch.step_of(int(rank)) if rank is not None else self._watch.max_step()

    def _fire(self, rec: FaultRecord, fault: Fault) -> None:
        rec.fired_s = self._now()
        rec.fired_step = self._step_of(fault)
        emulated = needs_netns(fault) and self._ctx.testbed.kind == "loopback"
        rec.detail["injected"] = "in-process, via etcd fault control" if emulated else "real"
        inj = make_injector(fault, self._ctx)
        self._injectors[rec.index] = inj
        try:
            inj.start()
            rec.detail.update(getattr(inj, "detail", {}))  # a node-kill's pids, say
            if (at := getattr(inj, "fired_at", None)) is not None:  # took effect then
                # Its step too (read just after: at most a step later than the
                # fault, where the step before its measurement was seconds early).
                rec.fired_s, rec.fired_step = at - self.t0, self._step_of(fault)
        except ChaosError as exc:
            rec.error = str(exc)
            # Undo what a start that failed midway did (one of two rules, say).
            with contextlib.suppress(ChaosError):
                inj.stop()
        self._display.fault(rec, "injected" if rec.error is None else "FAILED")
        self._log("fault.injected", rec, fault)
        if not inj.active:
            rec.stopped_s = rec.fired_s

    def _undo(self, rec: FaultRecord, inj: Injector) -> None:
        try:
            inj.stop()
        except ChaosError as exc:
            rec.error = f"{rec.error + '; ' if rec.error else ''}undo failed: {exc}"
        rec.stopped_s = self._now()
        flaps = getattr(inj, "flaps", None)
        if flaps is not None:
            rec.detail["flaps"] = flaps
        self._display.fault(rec, "undone")
        self._log("fault.cleared", rec, inj.fault)

    def _log(self, kind: str, rec: FaultRecord, fault: Fault) -> None:
        rank, rail = fault.param("rank"), fault.param("rail")
        links = []
        if rank is not None and rail is not None:
            peer = fault.param("peer")
            links = [(int(rank), -1 if peer is None else int(peer), int(rail))]
        # Stamped with when the fault happened, not when this line runs: the ranks
        # may log their detection before start() returns here.
        when = rec.fired_s if kind == "fault.injected" else rec.stopped_s
        self._events.emit(
            kind,
            rank=-1 if rank is None else int(rank),
            links=links,
            reason=f"{fault.kind}({', '.join(f'{k}={v}' for k, v in sorted(rec.params.items()))})",
            action=rec.error or "",
            step=rec.fired_step,
            fault=rec.index,
            ts=self.t0 + (when or 0.0),
        )

    def _run(self) -> None:
        while not self._halt.wait(_TICK_S):
            for rec, fault in zip(self.records, self._faults, strict=True):
                inj = self._injectors[rec.index]
                if rec.fired_s is None and self._due(fault) and not self._held(rec, fault):
                    self._fire(rec, fault)
                elif (
                    inj is not None
                    and inj.active
                    and fault.duration_s is not None
                    and rec.fired_s is not None
                    and self._now() >= rec.fired_s + fault.duration_s
                ):
                    self._undo(rec, inj)
            self._display.tick(self._now(), self._watch.snapshot(), self.records)
            if not self.timed_out and self._now() > self._timeout_s:
                self.timed_out = True
                self._display.notice(f"timeout after {self._timeout_s:g} s; stopping the job")
                self._launcher.request_stop()


def _pid_lookup(launcher: Launcher | NodeAgents, watch: ProgressWatch) -> Any:
    def pid_of(rank: int) -> int:
        pid = launcher.rank_pids().get(rank) or watch.pid_of(rank)
        if pid is None:
            raise ChaosError(f"rank {rank} is not running")
        return pid

    return pid_of


def _run_job(
    scenario: Scenario,
    testbed: Testbed,
    etcd: EtcdCluster,
    out: Path,
    faults: tuple[Fault, ...],
    display: Display,
    source: str,
) -> RunFacts:
    job, hosts = scenario.job, testbed.hosts
    launcher: Launcher | NodeAgents
    # Faults fire at a step: the ranks report each one (the default is 4/s).
    rank_env = (("RESILIENT_PROGRESS_INTERVAL_S", "0.02"),)
    config = LaunchConfig(
        nproc=job.ranks_per_node if job.nodes > 1 else job.nproc,
        nnodes=job.nodes,
        script=_script_path(scenario, source),
        script_args=_script_args(scenario),
        rails=job.rails,
        etcd=etcd.url,
        job=new_job_name(),
        max_restarts=job.max_restarts,
        # The fault-free reference loses no rank: spares there would only take CPU.
        warm_spares=job.warm_spares and bool(faults),
        primed_restarts=bool(faults),  # a fault-free run restarts nothing
        evict_stragglers=job.evict_stragglers,
        min_ranks=job.min_ranks,
        shrink_after_s=job.shrink_after_s,
        log_dir=str(out / "logs"),
        run_dir=str(out / "run"),
        rank_rails=tuple(h.rails for h in hosts) if job.nodes == 1 else (),
        rank_wrap=tuple(tuple(h.wrap([])) for h in hosts) if job.nodes == 1 else (),
        # The launcher hosts torch's rendezvous store: the ranks reach it where
        # they reach etcd, on the control plane; node agents: node 0's, on its host.
        master_addr=testbed.control_addr if job.nodes == 1 else hosts[0].mgmt_addr,
        echo=False,
        fault_control=testbed.kind == "loopback" and job.nodes == 1,
        rank_env=rank_env if job.nodes == 1 else (),
    )
    launcher = (
        Launcher(config)
        if job.nodes == 1
        else NodeAgents(config, testbed, dict(rank_env), spares=job.spare_nodes)
    )
    watch = ProgressWatch(etcd.endpoints, config.job).start()
    # The fault records are the job's keys: written under its token (membership.guarded).
    control_client = job_client(
        EtcdClient(etcd_config(etcd.url, retry_budget_s=3.0)),
        config.job,
        config.token,
    )
    ctx = InjectionContext(
        testbed=testbed,
        pid_of=_pid_lookup(launcher, watch),
        etcd=etcd,
        control=_control(control_client, config.job),
        agent_pid=launcher.agent_pid if isinstance(launcher, NodeAgents) else None,
    )
    log = EventLog(out / "run", job=config.job, rank=-1, name="chaos")
    ctl = _Controller(faults, ctx, launcher, watch, display, job.timeout_s, log)
    ctl.start()
    code: int | None = None
    try:
        code = launcher.run()
        if isinstance(launcher, NodeAgents):  # nodes a fault killed or cut off fail on purpose
            code = job_exit_code(launcher.codes, excused_nodes(ctl.records, launcher.codes))
    finally:
        ctl.finish()
        watch.stop()
        control_client.close()
        display.done()
        log.close()
    return RunFacts(
        t0=ctl.t0,
        duration_s=time.time() - ctl.t0,
        exit_code=code,
        timed_out=ctl.timed_out,
        faults=ctl.records,
        progress=watch.snapshot(),
        events=read_events(out / "run"),
        reference=None,
        out_dir=str(out),
    )


def _cache_dir() -> Path:
    base = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(base) / "resilient" / "chaos"


def _reference(
    scenario: Scenario,
    testbed: Testbed,
    etcd: EtcdCluster,
    out: Path,
    display: Display,
    source: str,
    use_cache: bool,
) -> dict[str, Any]:
    """The fault-free run's final parameters and speed, from the cache or run now."""
    key = reference_key(scenario, _script_path(scenario, source), _script_args(scenario))
    cached = _cache_dir() / f"{scenario.name}-{key}.json"
    if use_cache and cached.is_file():
        with contextlib.suppress(OSError, ValueError):
            ref: dict[str, Any] = json.loads(cached.read_text())
            ref["cached"] = True
            return ref
    display.notice("fault-free reference run")
    facts = _run_job(scenario, testbed, etcd, out / "reference", (), display, source)
    if facts.exit_code in (130, 143) and not facts.timed_out:
        # The launcher took the signal (its handlers stood in for ours meanwhile) and
        # stopped the ranks: stop the scenario too, rather than start the faulty run.
        raise signals.interrupt_for(facts.exit_code - 128)
    hashes = {t.last.get("params_sha256") for t in facts.progress.values() if t.done}
    ok = facts.exit_code == 0 and len(hashes) == 1 and len(facts.progress) == scenario.job.nproc
    first = facts.progress.get(0)
    ref = {
        "key": key,
        "completes": ok,
        "params_sha256": hashes.pop() if ok else None,
        "params_stats": first.last.get("params_stats") if ok and first is not None else None,
        "duration_s": round(facts.duration_s, 3),
        "cached": False,
    }
    if ok:
        with contextlib.suppress(OSError):
            cached.parent.mkdir(parents=True, exist_ok=True)
            cached.write_text(json.dumps(ref))
    return ref


@contextlib.contextmanager
def _control_plane(scenario: Scenario, testbed: Testbed, out: Path) -> Iterator[EtcdCluster]:
    """The scenario's etcd; with ``etcd_security`` over TLS with client certificates
    and user/password auth, whose credentials every client of the run (this process,
    the launcher it hosts, the ranks) reads from ``RESILIENT_ETCD_*`` meanwhile."""
    security = (
        etcd_security(out / "etcd-tls", testbed.control_addr)
        if scenario.job.etcd_security
        else None
    )
    etcd = EtcdCluster(
        scenario.job.etcd_members, host=testbed.control_addr, fsync=False,
        tls=security.server if security is not None else None,
    )  # fmt: skip
    try:
        etcd.start()
        if security is not None:
            etcd.enable_auth(ROOT_PASSWORD, user=security.user, password=security.password,
                             prefix="/resilient/")  # fmt: skip
        with client_env(security.env if security is not None else {}):
            yield etcd
    finally:
        with signals.shielded():
            etcd.stop()


def _stray_keys(etcd: EtcdCluster, *, secure: bool) -> list[str]:
    """The keys in the scenario's etcd outside every job's prefix (a leak); with
    etcd's security on, the job's user reads only under ``/resilient/``, which is
    all it may write."""
    client = EtcdClient(etcd_config(etcd.url, request_timeout_s=2.0, retry_budget_s=3.0))
    try:
        kvs, _ = client.get_prefix("/resilient/" if secure else "/")
    except MembershipError as exc:
        return [f"(not listed: {exc})"]
    finally:
        client.close()
    return [kv.key for kv in kvs if not _JOB_KEY.match(kv.key)]


def run_scenario(
    scenario: Scenario,
    *,
    out_dir: str | os.PathLike[str],
    source: str = "",
    display: Display | None = None,
    use_cache: bool = True,
) -> dict[str, Any]:
    """Run ``scenario`` and return its report (also written to ``out_dir/report.json``).

    Raises:
        ChaosError: the testbed could not be built or torn down.
        ResilientError: etcd or the launcher could not start.
        KeyboardInterrupt, SystemExit: SIGINT, or SIGTERM/SIGHUP (SystemExit(128 + N)),
            stopped the fault-free reference run; everything is torn down first.
    """
    out = Path(out_dir).resolve()
    out.mkdir(parents=True, exist_ok=True)
    display = display or Display(scenario.job.steps, silent=True)
    testbed = make_testbed(scenario)
    sweep_leftovers()
    with testbed, _control_plane(scenario, testbed, out) as etcd:
        display.notice(f"testbed {testbed.describe()}; etcd {etcd.url}")
        reference = None
        if scenario.expect.params_equal_fault_free or scenario.expect.params_close_fault_free:
            reference = _reference(scenario, testbed, etcd, out, display, source, use_cache)
        facts = _run_job(scenario, testbed, etcd, out, scenario.faults, display, source)
        facts.stray_keys = _stray_keys(etcd, secure=scenario.job.etcd_security)
    facts.reference = reference
    report = build_report(scenario, facts, source=source)
    try:
        (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    except OSError as exc:
        raise ResilientError(f"cannot write {out / 'report.json'}: {exc}") from exc
    return report
