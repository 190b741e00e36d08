"""Shared helpers of the benchmark scripts: rank processes, gloo groups, tc shaping, stats.

Imported as ``_common`` by the scripts in this folder (``python benchmarks/X.py`` puts
the folder on ``sys.path``; spawned ranks inherit that path).
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import multiprocessing as mp
import os
import queue
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import time
import traceback
from collections.abc import Callable, Sequence
from datetime import timedelta
from types import FrameType
from typing import Any

from chaos._netns import enter_netns
from resilient.config import DataPlaneConfig

__all__ = [
    "DATA_TRANSPORT",
    "CpuMeter",
    "TcShaper",
    "control_barrier",
    "enter_netns",
    "gloo_group",
    "gloo_process_group",
    "load_line",
    "max_over_ranks",
    "print_table",
    "rail_address",
    "run_ranks",
    "set_parent_death_signal",
    "summarise",
    "tcp_store",
]

RankTarget = Callable[..., Any]
# The library's own default, so a plain run measures what users get.
DATA_TRANSPORT = DataPlaneConfig().data_transport
ELIDE_EVERY = DataPlaneConfig().elide_every


def rail_address(rank: int, rail: int) -> str:
    """Loopback address of ``rank`` on ``rail`` (the convention of ``resilient run``)."""
    return f"127.0.{rail + 1}.{rank + 1}"


def set_parent_death_signal() -> None:
    """Make the kernel SIGKILL this process when its parent dies (Linux; no-op elsewhere)."""
    if not sys.platform.startswith("linux"):
        return
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


# -- gloo ------------------------------------------------------------------------------
def gloo_group(
    store: Any, name: str, rank: int, world: int, addrs: Sequence[str], timeout_s: float
) -> Any:
    """A ``ProcessGroupGloo`` with one device per address in ``addrs`` (no default group)."""
    import torch.distributed as dist
    from torch._C._distributed_c10d import PrefixStore

    opts: Any = getattr(dist.ProcessGroupGloo, "_Options")()  # noqa: B009 - private API
    opts._timeout = timedelta(seconds=timeout_s)
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname=a) for a in addrs]
    return dist.ProcessGroupGloo(PrefixStore(name, store), rank, world, opts)


def gloo_process_group(
    store: Any, name: str, rank: int, world: int, addrs: Sequence[str], timeout_s: float
) -> tuple[Any, Any]:
    """``(ProcessGroup, its gloo backend)``: what DDP needs (it refuses a bare backend)."""
    import torch
    import torch.distributed as dist
    from torch._C._distributed_c10d import PrefixStore

    backend = gloo_group(store, name, rank, world, addrs, timeout_s)
    pg = dist.ProcessGroup(PrefixStore(name, store), rank, world)
    gloo = dist.ProcessGroup.BackendType.GLOO
    pg._register_backend(torch.device("cpu"), gloo, backend)
    pg._set_default_backend(gloo)
    return pg, backend


def control_barrier(pg: Any, timeout_s: float) -> None:
    """Synchronise ranks: a one-element all_reduce on an unshaped gloo group."""
    import torch

    pg.allreduce([torch.zeros(1)]).wait(timedelta(seconds=timeout_s))


# -- rank processes --------------------------------------------------------------------
def _entry(target: RankTarget, rank: int, world: int, port: int, results: Any, args: Any) -> None:
    set_parent_death_signal()
    try:
        results.put((rank, "ok", target(rank, world, port, *args)))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def _collect(procs: list[Any], results: Any, timeout_s: float) -> dict[int, Any]:
    """Wait for one result per process; fail early if one dies silently or time runs out."""
    out: dict[int, Any] = {}
    errors: dict[int, str] = {}
    deadline = time.monotonic() + timeout_s
    while len(out) + len(errors) < len(procs):
        if errors and time.monotonic() > deadline:
            break  # report the failures we have; the others are stuck behind them
        if time.monotonic() > deadline:
            missing = sorted(set(range(len(procs))) - set(out) - set(errors))
            raise TimeoutError(f"ranks {missing} gave no result within {timeout_s:.0f} s")
        try:
            rank, status, value = results.get(timeout=0.5)
        except queue.Empty:
            dead = [i for i, p in enumerate(procs) if p.exitcode not in (None, 0)]
            if dead and not errors:
                raise RuntimeError(
                    f"ranks {dead} died (exit codes {[procs[i].exitcode for i in dead]})"
                ) from None
            continue
        (out if status == "ok" else errors)[rank] = value
        if status != "ok":
            deadline = min(deadline, time.monotonic() + 15.0)
    if errors:
        raise RuntimeError("\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items())))
    return out


def _reap(procs: list[Any]) -> None:
    """Join every process; terminate, then kill, whatever does not exit."""
    deadline = time.monotonic() + 10.0
    for p in procs:
        p.join(timeout=max(0.0, deadline - time.monotonic()))
    for p in procs:
        if p.is_alive():
            p.terminate()
    for p in procs:
        p.join(timeout=5)
        if p.is_alive():
            p.kill()
            p.join(timeout=5)


def run_ranks(target: RankTarget, world: int, args: tuple[Any, ...], timeout_s: float) -> list[Any]:
    """Run ``target(rank, world, port, *args)`` on ``world`` spawned processes.

    ``port`` is a free port for a TCPStore (rank 0 hosts it). Returns the results by
    rank. Raises RuntimeError with every failing rank's traceback, TimeoutError when a
    rank is silent for ``timeout_s``. The processes are always reaped.
    """
    from resilient.procs import free_port

    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=_entry, args=(target, r, world, port, results, args), daemon=True)
        for r in range(world)
    ]
    try:
        for p in procs:
            p.start()
        out = _collect(procs, results, timeout_s)
    finally:
        _reap(procs)
    return [out[r] for r in range(world)]


# -- tc shaping ------------------------------------------------------------------------
class TcShaper:
    """Rate limits per address on a device (``lo``) with one htb class per (address, side).

    gloo binds only the listening side of a pair to the device address; the connecting
    side is unbound, so on loopback its packets carry source 127.0.0.1. Every pair
    connection therefore shows exactly one rail address: as the destination of what
    the connector sends, or as the source of what the listener sends back. Each
    address gets two classes at the rail's rate: ``in`` (u32 match on destination /32)
    and ``out`` (u32 match on source /32), so both directions of every link are shaped.
    Other traffic (the TCPStore, the control group on 127.0.0.1) goes to a fast default
    class.

    The root qdisc has handle ``7273:`` and an owner record (:mod:`chaos.cleanup`), so
    that a run killed outright leaves a qdisc the next run (or ``resilient chaos
    --cleanup``) knows as ours and removes; a qdisc someone else put there is never
    replaced or deleted.
    """

    def __init__(self, dev: str = "lo") -> None:
        self.dev = dev
        self.installed = False

    @staticmethod
    def check_available() -> None:
        """Raise SystemExit with a clear message unless tc shaping can work here."""
        if os.geteuid() != 0:
            raise SystemExit("--rail-rate-mbit needs root (tc qdisc on lo); run as root")
        if shutil.which("tc") is None:
            raise SystemExit("--rail-rate-mbit needs the 'tc' command (iproute2)")

    def _tc(self, *args: str, check: bool = True) -> None:
        proc = subprocess.run(
            ["tc", *args], capture_output=True, text=True, timeout=10, check=False
        )
        if check and proc.returncode != 0:
            raise RuntimeError(f"tc {' '.join(args)} failed: {proc.stderr.strip()}")

    def install(self, rates_mbit: dict[str, float]) -> None:
        """Shape each address in ``rates_mbit`` (both directions) at its rate.

        Leftovers of dead runs go first. Raises SystemExit when the device carries a
        qdisc of a live run or of someone else, RuntimeError when tc fails.
        """
        from chaos.cleanup import QDISC_MAJOR, claim_qdisc
        from resilient.errors import ChaosError

        try:
            claim_qdisc(self.dev)
        except ChaosError as exc:
            raise SystemExit(f"--rail-rate-mbit: {exc}") from exc
        self.installed = True
        d, major = self.dev, QDISC_MAJOR
        self._tc("qdisc", "add", "dev", d, "root", "handle", f"{major}:", "htb", "default", "1")
        self._class(1, "40gbit")
        for i, (addr, mbit) in enumerate(sorted(rates_mbit.items())):
            for side, (match, prio) in enumerate((("dst", "1"), ("src", "2"))):
                minor = 16 + 2 * i + side
                self._class(minor, f"{mbit}mbit")
                self._tc(
                    "filter", "add", "dev", d, "parent", f"{major}:", "protocol", "ip",
                    "prio", prio, "u32", "match", "ip", match, f"{addr}/32",
                    "flowid", f"{major}:{minor:x}",
                )  # fmt: skip

    def _class(self, minor: int, rate: str) -> None:
        from chaos.cleanup import QDISC_MAJOR as major

        self._tc(
            "class", "add", "dev", self.dev, "parent", f"{major}:", "classid",
            f"{major}:{minor:x}", "htb", "rate", rate, "ceil", rate, "burst", "256k",
            "cburst", "256k", "quantum", "200000",
        )  # fmt: skip

    def remove(self) -> None:
        """Remove the shaping and its owner record (idempotent; safe from signal
        handlers and atexit). Deletes only our own qdisc."""
        if self.installed:
            from chaos.cleanup import release_qdisc

            self.installed = False
            release_qdisc(self.dev)

    def remove_on_exit(self) -> None:
        """Remove the shaping at interpreter exit and on SIGINT/SIGTERM/SIGHUP."""
        atexit.register(self.remove)

        def handler(signum: int, frame: FrameType | None) -> None:
            self.remove()
            print(f"signal {signum}: rate limits removed, stopping", file=sys.stderr)
            if signum == signal.SIGINT:
                raise KeyboardInterrupt
            raise SystemExit(128 + signum)

        for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(sig, handler)


# -- statistics and output --------------------------------------------------------------
def max_over_ranks(per_rank: Sequence[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Per configuration, the slowest rank's time of each iteration."""
    return {
        name: [max(ts) for ts in zip(*(r[name] for r in per_rank), strict=True)]
        for name in per_rank[0]
    }


def summarise(samples: list[float]) -> dict[str, float]:
    """Median, min and max of one configuration's per-iteration times."""
    return {
        "median": statistics.median(samples),
        "min": min(samples),
        "max": max(samples),
    }


def print_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    """Print a plain aligned table."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    print("  ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)))


class CpuMeter:
    """CPU time of the whole machine vs this process and its reaped children.

    ``other_load`` estimates how many CPUs other work (other users' tests, say) kept
    busy during the run: (machine user+nice+system time - ours) / wall time. Loopback
    softirq time is left out of both sides. Approximate, but it tells a quiet
    measurement from a disturbed one.
    """

    def __init__(self) -> None:
        self._start = (time.monotonic(), self._machine_s(), self._own_s())

    @staticmethod
    def _machine_s() -> float:
        try:
            with open("/proc/stat") as f:
                fields = [int(v) for v in f.readline().split()[1:4]]  # user nice system
        except (OSError, ValueError):
            return 0.0
        return sum(fields) / os.sysconf("SC_CLK_TCK")

    @staticmethod
    def _own_s() -> float:
        me, kids = (
            resource.getrusage(resource.RUSAGE_SELF),
            resource.getrusage(resource.RUSAGE_CHILDREN),
        )
        return me.ru_utime + me.ru_stime + kids.ru_utime + kids.ru_stime

    def report(self) -> dict[str, float]:
        wall = time.monotonic() - self._start[0]
        machine = self._machine_s() - self._start[1]
        own = self._own_s() - self._start[2]
        return {
            "wall_s": round(wall, 1),
            "own_cpu_s": round(own, 1),
            "other_cpu_s": round(max(0.0, machine - own), 1),
            "other_load": round(max(0.0, machine - own) / max(wall, 1e-9), 2),
        }


def load_line() -> str:
    """The 1/5/15-minute load averages and CPU count, for the record."""
    one, five, fifteen = os.getloadavg()
    return f"load average {one:.2f} {five:.2f} {fifteen:.2f} on {os.cpu_count()} CPUs"


def tcp_store(rank: int, world: int, port: int, timeout_s: float, host: str = "127.0.0.1") -> Any:
    """The rendezvous store; rank 0 hosts it on ``host``."""
    from torch._C._distributed_c10d import TCPStore

    return TCPStore(host, port, world, rank == 0, timeout=timedelta(seconds=timeout_s))


def print_conditions(s: dict[str, Any]) -> None:
    """The load and CPU lines every benchmark prints before its table."""
    print("load:", " / ".join(s["load"]), "(before / after)")
    cpu = s["cpu"]
    print(
        f"CPU during the run: ours {cpu['own_cpu_s']} s, other processes {cpu['other_cpu_s']} s "
        f"in {cpu['wall_s']} s (other load {cpu['other_load']:.2f} CPUs)"
    )


def add_common_flags(p: Any) -> None:
    """Flags both benchmarks share: the resilient group's options and the run limit."""
    p.add_argument(
        "--no-check-mismatch", action="store_true", help="resilient: skip the signature check"
    )
    p.add_argument(
        "--topology",
        choices=("auto", "ring", "mesh"),
        default="auto",
        help="resilient schedule (DataPlaneConfig.topology, default auto)",
    )
    p.add_argument(
        "--data-transport",
        choices=("socket", "gloo"),
        default=DATA_TRANSPORT,
        help="resilient data links: plain sockets or two-rank gloo groups "
        f"(DataPlaneConfig.data_transport, default {DATA_TRANSPORT})",
    )
    p.add_argument(
        "--elide-every",
        type=int,
        default=ELIDE_EVERY,
        metavar="K",
        help="resilient: keep the signature exchange for every K-th call only, check the "
        f"others by a digest in their data (DataPlaneConfig.elide_every, default {ELIDE_EVERY})",
    )
    p.add_argument(
        "--no-native-io",
        action="store_true",
        help="resilient without its C mesh and ring steps (DataPlaneConfig.native_io=False)",
    )
    p.add_argument("--timeout", type=float, default=None, help="whole-run limit in seconds")
