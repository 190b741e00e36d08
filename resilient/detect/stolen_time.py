"""How much of the wall time this process could not run: stopped, throttled, starved.

A process that is SIGSTOPped, CPU-throttled by its cgroup or starved by a noisy
neighbour is slow at everything, compute and communication alike, so its peers'
clocks show little: they block in the same collectives it blocks in. From outside,
though, it shows plainly, and :class:`StolenTime` keeps it as a running total
(straggler detection compares it across ranks).

The meter is a small child process, not a thread. Every :data:`PERIOD_S` (every
:data:`IDLE_PERIOD_S` while nothing is stolen) it reads the rank's state
(``/proc/<pid>/stat``): the time a rank was stopped counts, to a period. A
throttled rank's time comes from its CPU cgroup's own account (``cpu.stat``'s
``throttled_time``, v2's ``throttled_usec``; the root cgroup has none), a starved
one's from the meter's own lateness (it shares the rank's cgroup and cores): a
sleep that wakes more than :data:`_LATE_S` late counts. The total goes into 8
bytes of shared memory the rank reads without a system call.

Why not a thread of the rank, as it was until 2026-12-04: a thread's late wake-up
counts its wait for the GIL as stolen (31-37 ms of every 100 beside a main
thread busy in Python, on a healthy rank), and each wake-up takes the GIL from
the rank's own threads (what that costs a DDP step was within the benchmark's
noise: docs/BENCHMARKS.md).

The child leaves the rank's process group (its own session), so a chaos fault
that stops the rank's group does not stop the meter that measures it. The rank
kills it on close; a rank that dies closes its end of a pipe the meter polls, so
the meter reads end-of-file and exits (and it exits if its parent changes). A
rank killed outright on a host whose init does not reap orphans leaves the meter
a zombie: no CPU, one process table entry.
"""

from __future__ import annotations

import contextlib
import logging
import mmap
import os
import struct
import subprocess
import sys
import weakref
from typing import Final

__all__ = ["HOT_S", "IDLE_PERIOD_S", "PERIOD_S", "StolenTime"]

logger = logging.getLogger(__name__)

# A stop is counted to a period: at 10 ms a rank stopped 30 % of every 100 ms read
# 20-40 % per sample, and the 3-rank CI test's confirmation took 11-18 steps
# (bound 20); at 5 ms, 10-14 (2026-12-04).
PERIOD_S: Final = 0.005
# While nothing was stolen for HOT_S, the meter looks only every IDLE_PERIOD_S:
# at 5 ms it cost ~10 ms of CPU a second, 2 % of a 2-core host running 4 ranks,
# and 800 wake-ups a second there, each taking a core from a rank. A stop or a
# late wake-up seen puts it back to PERIOD_S for HOT_S, so a stopped rank (the
# chaos "slow" fault stops one every 100 ms) is measured as finely as before.
IDLE_PERIOD_S: Final = 0.02
HOT_S: Final = 0.25
# How often the meter looks up the rank's CPU cgroup again (see _METER).
CGROUP_EVERY_S: Final = 0.05
# Late wake-ups below this are ordinary timer slack: they only make the meter look
# closely (every PERIOD_S) for HOT_S.
_SLACK_S: Final = 0.002
# Late wake-ups count as stolen only beyond this. On a host crowded with other
# work (load 10 on 2 cores) an idle meter woke 2-19 ms late, 4 % of the time
# summed, and unevenly: healthy ranks read 1.3-2x their peers' time in single
# 100 ms samples and were confirmed stragglers (5 times in 1,000 clean steps). A
# throttle is counted from the cgroup's own account instead, a stop from the
# rank's state; what lateness still counts is a starvation of 10 ms or more.
_LATE_S: Final = 0.01
_TOTAL: Final = struct.Struct("<q")

# The meter's program (stdlib only: it runs with -I -S, ~15 ms to start). argv:
# shared-memory fd, the rank's pid, the pipe's read end, periods, hot span, slack.
# A look that finds the rank stopped counts the time since the last look whole,
# or half of it when the last look found it running (the stop began somewhere in
# between); a look that finds it running again counts half the time since a look
# that found it stopped. So a stop is counted without bias whatever the period.
# A look that finds it running counts the larger of its own lateness and the time
# the rank's CPU cgroup was throttled since the last look (its cpu.stat), never
# both: the meter shares that cgroup, so a throttle delays it too, but only a
# throttle that spans one of its wake-ups. Short throttles of a rank a little over
# its quota (a slow-cpu fault of 0.7) fell between 20 ms looks: a third of the
# samples of such a rank read nothing stolen, and confirming it took up to 24
# steps. A rank's cgroup is looked up again every CGROUP_EVERY_S (it may be
# moved into one while it runs); the root cgroup has no quota and reads 0.
_METER = r"""
import mmap, os, select, struct, sys, time
fd, pid, pipe = int(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
fast, idle, hot, slack, every, late = (float(a) for a in sys.argv[4:10])
total = mmap.mmap(fd, 8)
try:
    stat = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
except OSError as exc:
    sys.exit(f"resilient stolen-time meter of pid {pid}: {exc}; no stall signal")
def cpu_stat():
    # The cpu.stat of the rank's CPU cgroup (v1's cpu hierarchy, else v2), and the
    # scale of its throttled field to seconds; None where it has none.
    try:
        with open(f"/proc/{pid}/cgroup") as f:
            lines = [line.rstrip("\n").split(":", 2) for line in f]
    except OSError:
        return None
    found = []
    for _, ctrls, path in lines:
        if "cpu" in ctrls.split(","):
            found += [(f"/sys/fs/cgroup/{d}{path}/cpu.stat", b"throttled_time", 1e-9)
                      for d in ("cpu", ctrls)]
        elif ctrls == "":
            found.append((f"/sys/fs/cgroup{path}/cpu.stat", b"throttled_usec", 1e-6))
    for name, key, scale in found:
        try:
            f = open(name, "rb", buffering=0)
        except OSError:
            continue
        if key in f.read(4096):
            return f, key, scale
        f.close()
    return None
def throttled(cg):
    try:
        raw = os.pread(cg[0].fileno(), 4096, 0)
        at = raw.index(cg[1] + b" ") + len(cg[1]) + 1
        return int(raw[at : raw.index(b"\n", at)]) * cg[2]
    except (OSError, ValueError):
        return None
poller = select.poll()
poller.register(pipe, select.POLLIN)
before, stolen, was_stopped, period, hot_until = time.monotonic(), 0.0, False, idle, 0.0
cg, cg_at, cg_path, was_throttled = None, -1.0, None, None
while not poller.poll(period * 1000) and os.getppid() == pid:
    now = time.monotonic()
    try:
        raw = os.pread(stat, 512, 0)
    except OSError:
        break
    at = raw.rindex(b")") + 2  # the state follows the command name, which may hold ")"
    stopped = raw[at : at + 1] in (b"T", b"t")
    if now - cg_at >= every:
        cg_at, new = now, cpu_stat()
        if (new and new[0].name) != cg_path:  # moved: a new cgroup, a new count
            if cg:
                cg[0].close()
            cg, cg_path = new, new and new[0].name
            was_throttled = throttled(cg) if cg else None
        elif new:
            new[0].close()
    lost = 0.0
    if cg:
        now_throttled = throttled(cg)
        if now_throttled is not None and was_throttled is not None:
            lost = min(max(now_throttled - was_throttled, 0.0), now - before)
        was_throttled = now_throttled
    if stopped or was_stopped:
        stolen += max((now - before) * (1.0 if stopped and was_stopped else 0.5), lost)
        hot_until = now + hot
    elif now - before - period > slack or lost > 0.0:
        lateness = now - before - period
        stolen += max(lateness if lateness > late else 0.0, lost)
        hot_until = now + hot
    was_stopped, before = stopped, now
    period = fast if now < hot_until else idle
    struct.pack_into("<q", total, 0, int(stolen * 1e6))
"""


class StolenTime:
    """Running total, in microseconds, of time the process was not running.

    If the meter process cannot start (no ``memfd_create``, no ``/proc``, no
    processes left), the total stays 0 and a warning says so: straggler detection
    then has no stall signal, and nothing else changes. The meter costs ~9 MB of
    memory and, looking every 5 ms, ~10 ms of CPU a second (measured 2026-12-04;
    the thread cost ~6 ms a second, taken from the rank's GIL); see IDLE_PERIOD_S.
    """

    def __init__(self, name: str) -> None:
        self.name = name
        self._shared: mmap.mmap | None = None
        self._proc: subprocess.Popen[bytes] | None = None
        self._pipe = -1
        self._last = 0
        self._finalizer: weakref.finalize[[int], StolenTime] | None = None
        try:
            self._start()
        except (OSError, ValueError, subprocess.SubprocessError) as exc:
            logger.warning("pid %d: %s: stolen-time meter not started (%s)", os.getpid(), name, exc)
            self.close()

    def _start(self) -> None:
        """Start the meter process.

        Raises:
            OSError: no ``memfd_create`` here, or the process could not start.
        """
        if not hasattr(os, "memfd_create"):  # Linux only
            raise OSError("memfd_create is not available on this platform")
        fd = os.memfd_create(self.name)
        try:
            os.ftruncate(fd, _TOTAL.size)
            self._shared = mmap.mmap(fd, _TOTAL.size)
            read, self._pipe = os.pipe()
            _PIPES.add(self._pipe)
            self._finalizer = weakref.finalize(self, _close_pipe, self._pipe)
            try:
                self._proc = subprocess.Popen(
                    [sys.executable, "-I", "-S", "-c", _METER, str(fd), str(os.getpid()),
                     str(read), str(PERIOD_S), str(IDLE_PERIOD_S), str(HOT_S), str(_SLACK_S),
                     str(CGROUP_EVERY_S), str(_LATE_S)],
                    pass_fds=(fd, read), start_new_session=True, stdin=subprocess.DEVNULL,
                )  # fmt: skip
            finally:
                os.close(read)
        finally:
            os.close(fd)

    @property
    def pid(self) -> int | None:
        """The meter process's pid (None when it did not start)."""
        return self._proc.pid if self._proc is not None else None

    @property
    def total_us(self) -> int:
        shared = self._shared
        if shared is not None:
            # try/except rather than contextlib.suppress: this runs for every row.
            try:  # noqa: SIM105
                self._last = _TOTAL.unpack_from(shared)[0]
            except ValueError:  # closed by another thread meanwhile
                pass
        return self._last

    def close(self) -> None:
        """End the meter (idempotent); the total keeps its last value."""
        self._last = self.total_us
        if self._finalizer is not None:
            self._finalizer()
        proc, self._proc = self._proc, None
        if proc is not None:
            # Killed rather than waited for: it holds nothing to flush, and a pipe
            # end some other process still holds would keep it reading. Not
            # reaped yet, so its pid cannot have been reused.
            proc.kill()
            try:
                proc.wait(timeout=1.0)
            except subprocess.TimeoutExpired:
                logger.warning("pid %d: %s: stolen-time meter %d did not end", os.getpid(),
                               self.name, proc.pid)  # fmt: skip
        shared, self._shared = self._shared, None
        if shared is not None:
            with contextlib.suppress(BufferError):  # being read this instant: GC closes it
                shared.close()


# The rank's ends of its meters' pipes. A child forked from the rank (a data
# loader's worker) must not hold one: the meter would outlive the rank.
_PIPES: set[int] = set()


def _close_pipe(fd: int) -> None:
    """Close a meter's pipe: it reads end-of-file and exits (also when a meter is
    dropped unclosed). Only while it is still this process's: in a forked child
    the number may name another file by now."""
    if fd in _PIPES:
        _PIPES.discard(fd)
        with contextlib.suppress(OSError):
            os.close(fd)


def _forked() -> None:
    for fd in list(_PIPES):
        with contextlib.suppress(OSError):
            os.close(fd)
    _PIPES.clear()


os.register_at_fork(after_in_child=_forked)
