"""The ``resilient`` command: ``run`` (local launcher), ``chaos`` and ``events``.

Importing this module must stay cheap (no torch, no gRPC) so that ``--help`` is
instant: heavy modules are imported by the code paths that need them.
"""

from __future__ import annotations

import argparse
import dataclasses
import logging
import socket
import sys
from collections.abc import Callable, Sequence
from typing import NoReturn

from chaos.cli import add_parser as add_chaos_parser
from recovery.cli import add_parser as add_events_parser
from resilient.config import env_token, scheduler_env
from resilient.errors import ConfigError, LauncherError
from resilient.launch.launcher import RANK_VAR_HELP, LaunchConfig, Launcher, new_job_name

__all__ = ["build_parser", "main"]

_PROG = "resilient"
# argparse's own exit code for usage errors; ours match it.
_USAGE_ERROR = 2

_Handler = Callable[[argparse.Namespace], int]

_RUN_DESCRIPTION = """\
Launch NPROC ranks of a Python script on this machine and supervise them.
With --nnodes N, run one such agent per machine (node ranks 0..N-1, one --etcd
and one RESILIENT_TOKEN for all): node K's local rank L is global rank K*NPROC+L.

Unlike torchrun, a failed rank is restarted alone: it keeps its rank id, gets the
next incarnation number, and the other ranks keep running. When the job-wide restart
budget (--max-restarts) is spent, the next failure stops every rank and the launcher
exits with that rank's exit code (128+N for death by signal N), unless --min-ranks
lets the job shrink and go on without it. Ctrl-C or SIGTERM
stop every rank (SIGTERM, then SIGKILL after a grace period) and exit with 130/143.
Each rank's output is printed with a "[rank N]" prefix."""


class _Parser(argparse.ArgumentParser):
    """Reports usage errors as one line (``resilient: error: ...``), exit code 2."""

    def error(self, message: str) -> NoReturn:
        self.exit(_USAGE_ERROR, f"{_PROG}: error: {message} (see '{self.prog} --help')\n")


def _env_epilog() -> str:
    rows = [f"  {var.value}\n      {text}" for var, text in RANK_VAR_HELP.items()]
    return "environment of each rank:\n" + "\n".join(rows)


def _add_run(subparsers: argparse._SubParsersAction[_Parser]) -> None:
    run = subparsers.add_parser(
        "run",
        help="launch and supervise the ranks of a training script on this machine",
        description=_RUN_DESCRIPTION,
        epilog=_env_epilog(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    _add_job_flags(run)
    _add_supervision_flags(run)
    run.add_argument("script", help="the Python script each rank runs (with python -u)")
    run.add_argument(
        "script_args",
        nargs=argparse.REMAINDER,
        metavar="ARGS",
        help="arguments passed to the script unchanged",
    )
    run.set_defaults(handler=_cmd_run)


def _add_job_flags(run: argparse.ArgumentParser) -> None:
    run.add_argument(
        "--nproc",
        "--nproc-per-node",
        dest="nproc",
        type=int,
        default=1,
        metavar="N",
        help="number of ranks to start on this machine (default: 1)",
    )
    _add_node_flags(run)
    run.add_argument(
        "--rails",
        type=_rails,
        default=1,
        metavar="R|NAMES",
        help="network rails (NICs) per rank: a count R (on loopback rail r of rank k is "
        "127.0.<r+1>.<k+1>; one machine only) or interface names or addresses, "
        "comma-separated, the same for every rank of this node, e.g. eth0,eth1 (default: 1)",
    )
    run.add_argument(
        "--etcd",
        metavar="URL",
        help="client URL(s) of an existing etcd cluster, comma-separated "
        "(default: start an embedded single-member etcd for this run; for local runs "
        "and tests only, production jobs should use their own etcd >= 3.5.3)",
    )
    run.add_argument(
        "--job",
        metavar="NAME",
        help="job name, the key prefix of the job in etcd: letters, digits, '_', '.', "
        "'-' (default: job-<8 random hex digits>)",
    )


def _add_node_flags(run: argparse.ArgumentParser) -> None:
    run.add_argument(
        "--nnodes",
        type=_nnodes,
        metavar="N|MIN:MAX",
        help="node agents in the job, one per machine; they meet in etcd (--etcd) "
        "(default: $SLURM_NNODES, else 1). MIN:MAX as torchrun's: the job starts with "
        "MAX nodes and goes on while at least MIN run (the same as --nnodes MAX "
        "--min-nodes MIN; a node lost with no spare is left out)",
    )
    run.add_argument(
        "--node-rank",
        type=int,
        metavar="K",
        help="this agent's node, 0..N-1 (default: $SLURM_NODEID, else "
        "$JOB_COMPLETION_INDEX, else 0)",
    )
    run.add_argument(
        "--spare",
        action="store_true",
        help="with --nnodes > 1: a spare node agent (no --node-rank): it waits until a "
        "node's agent is lost (its node lease expired), takes that node rank over and "
        "starts its ranks as replacements; exits 0 if the job ends without needing it",
    )
    run.add_argument(
        "--master-addr",
        metavar="ADDR",
        help="with --nnodes > 1: the address of node 0 the other nodes' ranks reach its "
        "init store at (torch's MASTER_ADDR; node 0 only; default: this host's name)",
    )
    run.add_argument(
        "--join-timeout",
        type=float,
        default=300.0,
        metavar="S",
        help="with --nnodes > 1: seconds to wait for every node agent (default: 300)",
    )


def _nnodes(text: str) -> tuple[int, int | None]:
    """``--nnodes``: N, or torchrun's MIN:MAX; returns (nodes at start, floor or None)."""
    low, colon, high = text.strip().partition(":")
    if not low.isdigit() or (colon and not high.isdigit()):
        raise argparse.ArgumentTypeError(f"{text!r}: a node count N or a range MIN:MAX")
    if not colon:
        return int(low), None
    lo, hi = int(low), int(high)
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"{text!r}: need 1 <= MIN <= MAX")
    # MIN == MAX is a fixed size, as torchrun reads it: no floor below it.
    return hi, (lo if lo < hi else None)


def _min_nodes(nnodes: tuple[int, int | None] | None, flag: int | None) -> int | None:
    """The node floor from ``--nnodes MIN:MAX`` and ``--min-nodes``.

    Raises:
        ConfigError: both are given and disagree.
    """
    if nnodes is None or nnodes[1] is None:
        return flag
    size, floor = nnodes
    if flag is not None and flag != floor:
        raise ConfigError(
            f"--nnodes {floor}:{size} and --min-nodes {flag} disagree on the node floor: "
            "give one of them"
        )
    return floor


def _rails(text: str) -> int | tuple[str, ...]:
    """``--rails``: a count, or comma-separated interface names or addresses."""
    if text.strip().isdigit():
        return int(text)
    names = tuple(n.strip() for n in text.split(","))
    if not all(names):
        raise argparse.ArgumentTypeError(f"{text!r}: a count or names like eth0,eth1")
    return names


def _add_supervision_flags(run: argparse.ArgumentParser) -> None:
    run.add_argument(
        "--max-restarts",
        type=int,
        default=0,
        metavar="K",
        help="restart budget for the whole job: a failed rank is restarted alone "
        "until K restarts (of any ranks) have been used; 0 = the first failure ends "
        "the job (default: 0)",
    )
    run.add_argument(
        "--warm-spares",
        action="store_true",
        help="keep one standby process per rank that has already run the script up to "
        "recovery.Session's admission (torch, model, DDP, warm-up); a failed rank's "
        "standby takes over at once instead of a cold start (uses a process and a "
        "model's memory per rank; only while restarts are left; scripts that do not "
        "train under recovery.Session get cold restarts)",
    )
    run.add_argument(
        "--no-primed-restarts",
        dest="primed_restarts",
        action="store_false",
        help="do not keep a process per rank that has imported torch for the rank's "
        "next cold restart (by default, with --max-restarts above 0 and no "
        "--warm-spares, one waits per rank: ~300 MB of host memory each, a few "
        "seconds off each restart)",
    )
    run.add_argument(
        "--evict-stragglers",
        action="store_true",
        help="a rank confirmed as a straggler may leave the job (exit code 75), when the "
        "recovery policy estimates that cheaper than waiting for it every step: it is "
        "replaced like a failed rank while restarts are left, else the others shrink "
        "without it; needs --max-restarts or --min-ranks (default: off, stragglers "
        "are waited for or routed around)",
    )
    run.add_argument(
        "--min-ranks",
        type=int,
        metavar="M",
        help="elastic shrink: when a rank is lost and no restart is left, the job goes "
        "on without it while at least M ranks run; the survivors wait --shrink-after "
        "seconds for a replacement, then continue with fewer ranks (default: off, "
        "the job stops)",
    )
    run.add_argument(
        "--min-nodes",
        type=int,
        metavar="M",
        help="with --nnodes > 1: --min-ranks in whole nodes (M * ranks per node): a node "
        "lost with no spare node to take it over is left out, all its ranks in one "
        "epoch, while at least M nodes' ranks run (default: off)",
    )
    run.add_argument(
        "--shrink-after",
        type=float,
        default=10.0,
        metavar="S",
        help="with --min-ranks: seconds survivors wait for a replacement before they "
        "shrink (default: 10)",
    )
    run.add_argument(
        "--metrics-port",
        type=int,
        metavar="PORT",
        help="serve Prometheus metrics on http://0.0.0.0:PORT/metrics: ranks and "
        "incarnations, restarts, recoveries, event counts, links down, straggler "
        "scores, each rank's step and step time (default: off)",
    )
    run.add_argument(
        "--log-dir",
        metavar="DIR",
        help="also write each rank's output to DIR/rank<N>.log (appended across restarts)",
    )
    run.add_argument(
        "--run-dir",
        metavar="DIR",
        help="directory for the ranks' recovery event logs and run state, passed as "
        "RESILIENT_RUN_DIR (default: none)",
    )
    run.add_argument(
        "--lease-ttl",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds a silent rank stays listed in etcd before the job sees it as lost; "
        ">= 2 (default: 5)",
    )
    run.add_argument(
        "--grace",
        type=float,
        default=5.0,
        metavar="S",
        help="seconds between SIGTERM and SIGKILL when stopping ranks (default: 5)",
    )


def build_parser() -> argparse.ArgumentParser:
    """The ``resilient`` argument parser (exposed for documentation and tests)."""
    parser = _Parser(
        prog=_PROG,
        description="Fault-tolerant collectives for PyTorch: local launcher and chaos tools.",
    )
    parser.add_argument(
        "-v", "--verbose", action="store_true", help="log the launcher's own steps (INFO)"
    )
    subparsers = parser.add_subparsers(
        dest="command", metavar="COMMAND", required=True, parser_class=_Parser
    )
    _add_run(subparsers)
    add_chaos_parser(subparsers)
    add_events_parser(subparsers)
    return parser


def _cmd_run(args: argparse.Namespace) -> int:
    """Raises: ConfigError, LauncherError (printed by :func:`main`)."""
    node_rank, nnodes, slurm_job = scheduler_env()
    min_nodes = _min_nodes(args.nnodes, args.min_nodes)
    nnodes = args.nnodes[0] if args.nnodes is not None else nnodes or 1
    token = env_token()
    if nnodes > 1 and not token:
        raise ConfigError(
            f"--nnodes {nnodes}: every node agent needs the same secret in RESILIENT_TOKEN "
            "(e.g. export RESILIENT_TOKEN=$(openssl rand -hex 16) before starting them)"
        )
    if args.spare and args.node_rank is not None:
        raise ConfigError("--spare: a spare node takes the node rank of the node it replaces")
    if args.spare:
        node_rank = 0  # replaced by the lost node's, once it is taken over
    master = args.master_addr or ("127.0.0.1" if nnodes == 1 else socket.getfqdn())
    names = args.rails if isinstance(args.rails, tuple) else ()
    config = LaunchConfig(
        nproc=args.nproc,
        nnodes=nnodes,
        node_rank=args.node_rank if args.node_rank is not None else node_rank or 0,
        spare=args.spare,
        master_addr=master,
        join_timeout_s=args.join_timeout,
        script=args.script,
        script_args=tuple(args.script_args),
        rails=len(names) if names else args.rails,
        rail_names=names,
        etcd=args.etcd,
        max_restarts=args.max_restarts,
        warm_spares=args.warm_spares,
        primed_restarts=args.primed_restarts,
        min_ranks=args.min_ranks,
        min_nodes=min_nodes,
        shrink_after_s=args.shrink_after,
        evict_stragglers=args.evict_stragglers,
        metrics_port=args.metrics_port,
        log_dir=args.log_dir,
        run_dir=args.run_dir,
        lease_ttl_s=args.lease_ttl,
        grace_s=args.grace,
        job=args.job or slurm_job or new_job_name(),
    )
    if token:
        config = dataclasses.replace(config, token=token)
    return Launcher(config).run()


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``resilient`` command; returns the process exit code.

    Usage errors and :class:`ConfigError`/:class:`LauncherError` are printed as one
    ``resilient: error: ...`` line and give exit code 2; ``run`` otherwise returns
    the job's exit code.
    """
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as exc:
        # --help and usage errors exit inside argparse; as a function we return instead.
        return exc.code if isinstance(exc.code, int) else _USAGE_ERROR
    logging.basicConfig(
        level=logging.INFO if args.verbose else logging.WARNING,
        format=f"{_PROG}: %(levelname)s: %(message)s",
    )
    try:
        code: int = args.handler(args)
    except (ConfigError, LauncherError) as exc:
        print(f"{_PROG}: error: {exc}", file=sys.stderr)
        return _USAGE_ERROR
    return code
