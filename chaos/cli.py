"""``resilient chaos SCENARIO.toml [--json] [--out DIR]``: run a scenario, print its report.

Exit status: 0 when every expectation held, 1 when one failed (the report says
which and what was measured), 2 for a bad scenario file or a testbed that could
not be built, 130/143 when interrupted (everything is torn down first).
"""

from __future__ import annotations

import argparse
import json
import os
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
130/143 interrupted.

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
    cmd.add_argument("scenario", help="scenario file (TOML); see examples/scenarios/")
    cmd.add_argument("--out", default=None, help="directory for report.json and the logs")
    cmd.add_argument(
        "--json", action="store_true", help="print the report as JSON on the last line"
    )
    cmd.add_argument(
        "--no-cache",
        action="store_true",
        help="always redo the fault-free reference run (normally cached by scenario+code)",
    )
    cmd.add_argument(
        "--quiet", action="store_true", help="no step progress (faults and notices still shown)"
    )
    cmd.set_defaults(handler=run_command)


def run_command(args: argparse.Namespace) -> int:
    # The launcher forks ranks while our etcd clients run: gRPC's fork handlers only
    # warn then ("skipping fork() handlers"), and every child execs at once anyway.
    os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")
    # Imported here: `resilient --help` must not pay for gRPC and the chaos machinery.
    from chaos._display import Display
    from chaos.report import render
    from chaos.runner import run_scenario
    from chaos.scenario import ScenarioError, load
    from resilient.errors import ResilientError

    try:
        scenario = load(args.scenario)
    except ScenarioError as exc:
        print(f"resilient: error: {exc}", file=sys.stderr)
        return _USAGE_ERROR
    out = args.out or tempfile.mkdtemp(prefix=f"chaos-{scenario.name}-{time.strftime('%H%M%S')}-")
    display = Display(scenario.job.steps, progress=not args.quiet)
    display.notice(f"scenario {scenario.name}: {len(scenario.faults)} fault(s); output in {out}")
    try:
        report = run_scenario(
            scenario,
            out_dir=out,
            source=str(args.scenario),
            display=display,
            use_cache=not args.no_cache,
        )
    except ResilientError as exc:
        print(f"resilient: error: {exc}", file=sys.stderr)
        return _USAGE_ERROR
    print(render(report))
    print(f"report written to {Path(out) / 'report.json'}")
    if args.json:
        print(json.dumps(report, default=str))
    if report["exit_code"] in (130, 143) and not report["timed_out"]:
        return int(report["exit_code"])
    return 0 if report["passed"] else _FAILED
