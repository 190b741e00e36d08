"""Sampling a rank's threads with Linux ``perf``: which code each thread's CPU goes to.

Used by ``ddp_threads.py --perf``. A thread's CPU time (from ``/proc``) says how much
it costs; its samples, grouped by the shared object they fell in, say whether that
went to the Python interpreter, the kernel (system calls, copies), torch's kernels
or the C library. The interpreter's share is what Python code of the library
costs and what a C++ collective such as gloo's does not pay.

Needs ``perf`` (Debian: ``linux-perf``) and the right to sample the rank's own
process (root, or ``kernel.perf_event_paranoid`` <= 1).
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import time
from collections.abc import Mapping

__all__ = ["CLASSES", "PerfSampler", "classify", "perf_missing", "samples_by_thread"]

# In the order the tables print them.
CLASSES = ("interpreter", "kernel", "torch", "libc", "other")
_START_S = 10.0
_STOP_S = 60.0


def perf_missing() -> str | None:
    """Why ``perf record`` cannot run here, or None."""
    if shutil.which("perf") is None:
        return "--perf needs Linux perf on PATH (Debian: apt install linux-perf)"
    try:
        with open("/proc/sys/kernel/perf_event_paranoid") as f:
            paranoid = int(f.read())
    except (OSError, ValueError):
        return None
    if paranoid > 1 and os.geteuid() != 0:
        return f"--perf needs root or kernel.perf_event_paranoid <= 1 (it is {paranoid})"
    return None


def classify(dso: str) -> str:
    """The class of a shared object's name as ``perf report`` prints it."""
    if dso.startswith("[kernel") or dso.startswith("[vdso"):
        return "kernel"
    if dso.startswith("libpython") or ".cpython-" in dso:
        return "interpreter"  # the interpreter and the stdlib's C modules (_socket, select)
    if dso.startswith(("libtorch_cpu", "libtorch_python", "libc10", "libgomp", "libiomp")):
        return "torch"
    if dso.startswith(("libc.so", "libc-", "libstdc++", "libm.so", "libpthread", "ld-linux")):
        return "libc"
    return "other"


class PerfSampler:
    """``perf record`` of this process, every thread, between :meth:`start` and :meth:`stop`."""

    def __init__(self, freq_hz: int) -> None:
        self.freq_hz = freq_hz
        self._proc: subprocess.Popen[bytes] | None = None

    def start(self, path: str) -> None:
        """Start sampling into ``path``; returns once perf has written its header.

        Raises:
            RuntimeError: perf exited or wrote nothing within 10 s.
        """
        self._proc = subprocess.Popen(
            ["perf", "record", "-q", "-F", str(self.freq_hz), "-p", str(os.getpid()), "-o", path],
            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
        )  # fmt: skip
        end = time.monotonic() + _START_S
        while not (os.path.exists(path) and os.path.getsize(path) > 0):
            if self._proc.poll() is not None or time.monotonic() > end:
                err = self._proc.stderr.read().decode() if self._proc.stderr else ""
                self.stop()
                raise RuntimeError(f"perf record did not start: {err.strip() or 'no output'}")
            time.sleep(0.02)

    def stop(self) -> None:
        """Stop sampling (perf finishes its file on SIGINT); kills it if it hangs."""
        proc, self._proc = self._proc, None
        if proc is None:
            return
        if proc.poll() is None:
            proc.send_signal(signal.SIGINT)
        try:
            proc.wait(_STOP_S)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
        if proc.stderr is not None:
            proc.stderr.close()


def samples_by_thread(path: str, names: Mapping[int, str]) -> dict[str, dict[str, int]]:
    """Samples in ``path`` per thread name (``names``: thread id to name; other threads
    go by perf's command name) and class of shared object.

    Raises:
        RuntimeError: ``perf report`` failed.
    """
    out = subprocess.run(
        ["perf", "report", "-i", path, "--stdio", "-s", "pid,dso", "-F", "sample,pid,dso"],
        capture_output=True, text=True, timeout=_STOP_S, check=False,
    )  # fmt: skip
    if out.returncode != 0:
        raise RuntimeError(f"perf report of {path} failed: {out.stderr.strip()[-500:]}")
    counts: dict[str, dict[str, int]] = {}
    for line in out.stdout.splitlines():
        parts = line.split(None, 2)
        if len(parts) < 3 or line.startswith("#") or not parts[0].isdigit():
            continue
        tid_s, _, comm = parts[1].partition(":")
        dso = parts[2].strip()
        if not tid_s.isdigit():
            continue
        name = names.get(int(tid_s), comm)
        per = counts.setdefault(name, dict.fromkeys(CLASSES, 0))
        per[classify(dso)] += int(parts[0])
    return counts
