"""A CPU quota on one process: the ``slow-cpu`` fault's cgroup.

A slow node in the field is a CPU (or GPU) that keeps running, slower: thermal
throttling, a noisy neighbour, a degraded part. The ``slow`` fault's SIGSTOP duty
cycle is something else (a rank frozen for tens of milliseconds at a time). Here the
rank keeps running and the kernel's CFS bandwidth control caps it: a cgroup with a
quota of ``cpus`` CPU-periods per period, the process (every thread) moved into it.

The cgroup is named ``rsl-<owner pid>-<what>`` under the CPU controller's root:
cgroup v2 where the unified hierarchy has the ``cpu`` controller
(``cpu.max``), else v1's ``cpu`` hierarchy (``cpu.cfs_quota_us``). A cgroup whose
owner is dead is a leftover (:func:`sweep`, called by :mod:`chaos.cleanup`).
"""

from __future__ import annotations

import contextlib
import logging
import os
import re
import time
from collections.abc import Callable
from pathlib import Path
from typing import Final

from resilient.errors import ChaosError

__all__ = ["CpuQuota", "cpu_root", "measure_cpus", "sweep"]

logger = logging.getLogger(__name__)

PERIOD_US: Final = 100_000
_MIN_QUOTA_US: Final = 1000  # the kernel refuses less
_V2: Final = Path("/sys/fs/cgroup")
_V1: Final = Path("/sys/fs/cgroup/cpu")
_NAME: Final = re.compile(r"rsl-(\d+)-[\w.-]+")


def cpu_root() -> tuple[Path, int]:
    """The CPU controller's root directory and cgroup version.

    Raises:
        ChaosError: no cgroup CPU controller is mounted (or not as root).
    """
    with contextlib.suppress(OSError):
        if "cpu" in (_V2 / "cgroup.controllers").read_text().split():
            return _V2, 2
    if (_V1 / "cpu.cfs_quota_us").exists():
        return _V1, 1
    raise ChaosError(
        "slow-cpu needs a cgroup CPU controller (cgroup v2 with cpu enabled, or v1's "
        "cpu hierarchy at /sys/fs/cgroup/cpu); none is mounted here"
    )


def descendants(pid: int) -> list[int]:
    """The processes below ``pid`` (children, theirs, ...), from /proc."""
    parent: dict[int, int] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            with contextlib.suppress(OSError, ValueError, IndexError):
                raw = (entry / "stat").read_bytes()
                parent[int(entry.name)] = int(raw[raw.rindex(b")") + 2 :].split()[1])
    found, todo = [], [pid]
    while todo:
        below = todo.pop()
        kids = [p for p, pp in parent.items() if pp == below]
        found += kids
        todo += kids
    return found


def _ticks(pid: int) -> int:
    """CPU time the process used so far, in clock ticks (utime + stime)."""
    raw = Path(f"/proc/{pid}/stat").read_bytes()
    fields = raw[raw.rindex(b")") + 2 :].split()  # the command name may hold ")"
    return int(fields[11]) + int(fields[12])


def measure_cpus(pid: int, window_s: float = 0.2) -> float:
    """How many CPUs ``pid`` used over the next ``window_s`` (all its threads).

    Raises:
        ChaosError: the process is gone.
    """
    hz = os.sysconf("SC_CLK_TCK")
    try:
        before, began = _ticks(pid), time.monotonic()
        time.sleep(window_s)
        used, took = _ticks(pid) - before, time.monotonic() - began
    except (OSError, ValueError, IndexError) as exc:
        raise ChaosError(f"slow-cpu: cannot read the CPU time of pid {pid}: {exc}") from exc
    return used / hz / took


class CpuQuota:
    """A cgroup that caps what its processes run at ``cpus`` CPUs (0.25: a quarter of one).

    Raises (constructor):
        ChaosError: no CPU controller, or the cgroup could not be made.
    """

    def __init__(self, what: str, cpus: float) -> None:
        if cpus <= 0:
            raise ChaosError(f"slow-cpu: a quota of {cpus} CPUs is not positive")
        self.root, self.version = cpu_root()
        self.path = self.root / f"rsl-{os.getpid()}-{what}"
        quota = max(_MIN_QUOTA_US, round(cpus * PERIOD_US))
        try:
            self.path.mkdir(exist_ok=True)
            if self.version == 2:
                (self.path / "cpu.max").write_text(f"{quota} {PERIOD_US}")
            else:
                (self.path / "cpu.cfs_period_us").write_text(str(PERIOD_US))
                (self.path / "cpu.cfs_quota_us").write_text(str(quota))
        except OSError as exc:
            with contextlib.suppress(OSError):
                self.path.rmdir()
            raise ChaosError(f"slow-cpu: cannot set up cgroup {self.path}: {exc}") from exc
        self.cpus = quota / PERIOD_US

    def add(self, pid: int) -> bool:
        """Move process ``pid`` (all its threads) and its descendants in; False if it
        is gone. The descendants too, as on a slow node: among them is the rank's
        stolen-time meter, whose late wake-ups are how a throttled rank shows
        (:mod:`resilient.detect.stolen_time`)."""
        for proc in [pid, *descendants(pid)]:
            try:
                (self.path / "cgroup.procs").write_text(str(proc))
            except ProcessLookupError:
                if proc == pid:
                    return False
            except OSError as exc:
                if not Path(f"/proc/{proc}").exists():
                    if proc == pid:
                        return False
                    continue
                raise ChaosError(
                    f"slow-cpu: cannot move pid {proc} into {self.path}: {exc}"
                ) from exc
        return True

    def pids(self) -> list[int]:
        with contextlib.suppress(OSError):
            return [int(x) for x in (self.path / "cgroup.procs").read_text().split()]
        return []

    def remove(self) -> None:
        """Move its processes back to the root cgroup (full speed) and delete it."""
        _release(self.root, self.path)


def _release(root: Path, path: Path) -> None:
    for _ in range(3):  # a process forking meanwhile lands here too: look again
        with contextlib.suppress(OSError):
            for pid in (path / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):  # gone meanwhile
                    (root / "cgroup.procs").write_text(pid)
        try:
            path.rmdir()
            return
        except FileNotFoundError:
            return
        except OSError:
            time.sleep(0.05)
    logger.warning("slow-cpu: cgroup %s could not be removed", path)


def sweep(dead: Callable[[int], bool]) -> list[tuple[str, int]]:
    """Remove ``rsl-<pid>-*`` cgroups whose owner ``dead(pid)`` says is gone; returns
    (path, owner pid) of each removed. Nothing without a CPU controller."""
    try:
        root, _ = cpu_root()
    except ChaosError:
        return []
    removed: list[tuple[str, int]] = []
    with contextlib.suppress(OSError):
        for child in root.iterdir():
            m = _NAME.fullmatch(child.name)
            if m and child.is_dir() and dead(int(m.group(1))):
                _release(root, child)
                removed.append((str(child), int(m.group(1))))
    return removed
