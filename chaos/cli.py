"""``resilient chaos SCENARIO.toml [--json] [--out DIR]``: run a scenario, print its report.

Exit status: 0 when every expectation held, 1 when one failed (the report says
which and what was measured), 2 for a bad scenario file or a testbed that could
not be built, 130/143/129 when interrupted by SIGINT/SIGTERM/SIGHUP (everything is
torn down first). ``resilient chaos --cleanup [--force]`` removes the leftovers of
dead runs instead (:func:`chaos.cleanup.remove_leftovers`) and exits 0.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

__all__ = ["add_parser", "run_command"]

DESCRIPTION = """\
Run a fault-injection scenario (TOML) against a job and report whether it survived:
kill, hang or slow down ranks, take NICs down, flap or throttle links, drop packets
or lose etcd members at the scenario's times or steps, then check the scenario's
expectations (the job completed, replicas stayed bitwise identical, equal to a
fault-free run, detection and recovery within bounds).

As root with topology = "netns" each rank runs on its own host (a network namespace
with one veth per rail); otherwise ranks share loopback and only process and etcd
faults can be injected. The report lists each fault with its time, the library's
first detection and actions (from the run's event log), recovery durations, steps
replayed and each expectation with its measured value."""

EPILOG = """\
exit status: 0 every expectation held, 1 one failed, 2 bad scenario or testbed error,
130/143/129 interrupted (SIGINT/SIGTERM/SIGHUP; the testbed is removed first).

cleanup (--cleanup, as root): what chaos runs and benchmarks make in the kernel is
removed when they exit, fail or get SIGINT/SIGTERM/SIGHUP; a run killed outright
(SIGKILL, a crash) leaves it until the next run starts, or until --cleanup. That
removes every object whose owner process is dead (see the owner records in
$RESILIENT_CHAOS_STATE/resilient-chaos, default /tmp): network namespaces rsl-*,
root veths rsl<id>m, htb qdiscs with handle 7273: (benchmarks' rate limits on lo)
and root-namespace iptables rules commented rsl-<pid>. It prints one line per
object removed and exits 0; with --force it also removes those of live runs.
Nothing without these names, handle or comment is touched.

files written to --out (default: a new directory under the system temp dir):
  report.json   the report printed at the end
  logs/         each rank's output (rank<N>.log)
  run/          the ranks' recovery event logs
  reference/    the fault-free reference run, when an expectation needs it

example:
  sudo resilient chaos examples/scenarios/throttle.toml --out /tmp/throttle"""

_USAGE_ERROR = 2
_FAILED = 1


def add_parser(subparsers: Any) -> None:
    """Register ``chaos`` on the ``resilient`` command's subparsers."""
    cmd = subparsers.add_parser(
        "chaos",
        help="run a fault-injection scenario (TOML) against a job and report whether it survived",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    cmd.add_argument("scenario", nargs="?", help="scenario file (TOML); see examples/scenarios/")
    cmd.add_argument("--out", default=None, help="directory for report.json and the logs")
    cmd.add_argument(
        "--json", action="store_true", help="print the report as JSON on the last line"
    )
    cmd.add_argument(
        "--no-cache",
        action="store_true",
        help=(
            "always redo the fault-free reference run (normally cached by the job, the "
            "code, the built C extension and torch's version)"
        ),
    )
    cmd.add_argument(
        "--quiet", action="store_true", help="no step progress (faults and notices still shown)"
    )
    cmd.add_argument(
        "--soak",
        type=float,
        metavar="DURATION_S",
        default=None,
        help="run no scenario file: a soak of about DURATION_S seconds, faults drawn from "
        "the whole matrix one at a time, then a check that nothing leaked (root, netns)",
    )
    cmd.add_argument("--seed", type=int, default=0, help="with --soak: draws the faults")
    cmd.add_argument(
        "--steps-per-s",
        type=float,
        default=15.0,
        help="with --soak: the job's rate here, which sizes its steps so that the run "
        "lasts about DURATION_S (default 15, the quiet 2-core development host)",
    )
    cmd.add_argument(
        "--cleanup",
        action="store_true",
        help="run no scenario: remove what dead chaos runs and benchmarks left in the "
        "kernel (namespaces, veths, qdiscs, iptables rules), one line per object; root",
    )
    cmd.add_argument(
        "--force",
        action="store_true",
        help="with --cleanup: also remove the objects of runs still going",
    )
    cmd.set_defaults(handler=run_command)


def run_command(args: argparse.Namespace) -> int:
    """Run the scenario (or ``--cleanup``); the exit status of the module docstring."""
    if args.cleanup:
        return _cleanup(force=args.force)
    if (args.scenario is None) == (args.soak is None) or args.force:
        what = (
            "--force needs --cleanup"
            if args.force
            else "a scenario file or --soak is needed, not both"
        )
        print(f"resilient: error: {what} (see resilient chaos --help)", file=sys.stderr)
        return _USAGE_ERROR
    from chaos.signals import SignalGuard

    # SIGTERM and SIGHUP raise too (not only SIGINT), so the testbed is always removed.
    # (While ranks run, the launcher's own handlers stand in: it stops the ranks.)
    guard = SignalGuard().install()
    try:
        return _run(args)
    except KeyboardInterrupt:
        print("resilient: interrupted by SIGINT; everything torn down", file=sys.stderr)
        return 130
    except SystemExit as exc:
        if not isinstance(exc.code, int) or exc.code - 128 not in (signal.SIGTERM, signal.SIGHUP):
            raise
        name = signal.Signals(exc.code - 128).name
        print(f"resilient: interrupted by {name}; everything torn down", file=sys.stderr)
        return exc.code
    finally:
        guard.uninstall()


def _soak(args: argparse.Namespace) -> Any:
    """The soak's scenario from ``--soak``, ``--seed`` and ``--steps-per-s``.

    Raises:
        ValueError: a duration or rate out of range.
    """
    from chaos.soak import soak_scenario

    return soak_scenario(args.soak, args.seed, steps_per_s=args.steps_per_s)


def _cleanup(*, force: bool) -> int:
    from chaos import _sh
    from chaos.cleanup import remove_leftovers
    from resilient.errors import ChaosError

    if not _sh.is_root():
        print("resilient: error: --cleanup needs root (namespaces, tc, iptables)", file=sys.stderr)
        return _USAGE_ERROR
    try:
        removed = remove_leftovers(force=force)
    except ChaosError as exc:  # ip or tc missing, or a command that hung
        print(f"resilient: error: {exc}", file=sys.stderr)
        return _USAGE_ERROR
    for item in removed:
        print(f"removed {item}")
    if not removed:
        print("nothing to remove")
    return 0


def _run(args: argparse.Namespace) -> int:
    # The launcher forks ranks while our etcd clients run: gRPC's fork handlers only
    # warn then ("skipping fork() handlers"), and every child execs at once anyway.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    # Imported here: `resilient --help` must not pay for gRPC and the chaos machinery.
    from chaos._display import Display
    from chaos.report import render
    from chaos.runner import run_scenario
    from chaos.scenario import Scenario, ScenarioError, load
    from chaos.soak import run_soak
    from resilient.errors import ResilientError

    try:
        scenario = load(args.scenario) if args.soak is None else _soak(args)
    except (ScenarioError, ValueError) as exc:
        print(f"resilient: error: {exc}", file=sys.stderr)
        return _USAGE_ERROR
    out = args.out or tempfile.mkdtemp(prefix=f"chaos-{scenario.name}-{time.strftime('%H%M%S')}-")
    display = Display(scenario.job.steps, progress=not args.quiet)
    display.notice(f"scenario {scenario.name}: {len(scenario.faults)} fault(s); output in {out}")

    def run(s: Scenario, to: Path) -> dict[str, Any]:
        source = str(args.scenario or "")
        return run_scenario(
            s, out_dir=to, source=source, display=display, use_cache=not args.no_cache
        )

    try:
        report = (
            run(scenario, Path(out)) if args.soak is None else run_soak(scenario, Path(out), run)
        )
    except ResilientError as exc:
        print(f"resilient: error: {exc}", file=sys.stderr)
        return _USAGE_ERROR
    print(render(report))
    if "soak" in report:
        leaks = report["soak"]["leaks"]
        soak = report["soak"]
        print(
            f"soak: {len(soak['faults'])} fault(s) drawn, {soak['fired']} fired "
            f"({soak['fired_while_training']} while training); leaks: {len(leaks) or 'none'}"
        )
        for line in leaks:
            print(f"  LEAK {line}")
    print(f"report written to {Path(out) / 'report.json'}")
    if args.json:
        print(json.dumps(report, default=str))
    if report["exit_code"] in (130, 143) and not report["timed_out"]:
        return int(report["exit_code"])
    return 0 if report["passed"] else _FAILED
