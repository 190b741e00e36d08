"""The rank processes of the local launcher: output relaying, signals, exits and reaping.

Kept apart from :mod:`resilient.launch.launcher` so that the supervisor reads as policy
(when to restart, when to stop) while this module holds the process mechanics.
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
from pathlib import Path
from types import FrameType, TracebackType
from typing import IO, Any, TextIO

__all__ = [
    "RankOutput",
    "SignalTrap",
    "describe_exit",
    "reap",
    "shell_exit_code",
    "signal_group",
    "stop_all",
]

logger = logging.getLogger(__name__)

# Bounded so that a rank printing without newlines cannot grow our memory without limit;
# longer lines are relayed as several prefixed pieces.
_MAX_LINE = 64 * 1024


def describe_exit(code: int) -> str:
    """``"code 3"`` or ``"code -9 (SIGKILL)"`` for a Popen return code."""
    if code < 0:
        try:
            return f"code {code} ({signal.Signals(-code).name})"
        except ValueError:
            return f"code {code} (signal {-code})"
    return f"code {code}"


def shell_exit_code(code: int) -> int:
    """Map a Popen return code to what a shell reports: death by signal N becomes 128+N."""
    return 128 - code if code < 0 else code


def signal_group(proc: subprocess.Popen[Any], sig: int) -> None:
    """Send ``sig`` to the session ``proc`` leads (it was spawned as a session leader)."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(sig)


def reap(proc: subprocess.Popen[Any]) -> int | None:
    """Return ``proc``'s exit code once it has exited (else None), killing its leftovers.

    Whatever the rank left running in its session (workers it forked) is SIGKILLed
    *before* the rank is reaped: until then its zombie holds the pid, so the
    process-group id cannot have been reused by an unrelated process.
    """
    if proc.returncode is not None:
        return proc.returncode
    if hasattr(os, "waitid"):
        try:
            info = os.waitid(os.P_PID, proc.pid, os.WEXITED | os.WNOHANG | os.WNOWAIT)
        except ChildProcessError:
            return proc.poll()
        if info is None:
            return None
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(proc.pid, signal.SIGKILL)
    return proc.poll()


def stop_all(procs: list[subprocess.Popen[Any]], *, grace_s: float) -> None:
    """SIGTERM every live process of ``procs`` (its whole session) at once; SIGKILL
    those still running when the shared ``grace_s`` is over. Waits 5 s at most
    for each SIGKILLed one."""
    live = [p for p in procs if reap(p) is None]
    for proc in live:
        signal_group(proc, signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    while time.monotonic() < deadline and any(reap(p) is None for p in live):
        time.sleep(0.02)
    for proc in live:
        if reap(proc) is not None:
            continue
        logger.warning("pid %d ignored SIGTERM for %.1f s; sending SIGKILL", proc.pid, grace_s)
        signal_group(proc, signal.SIGKILL)
        try:
            proc.wait(timeout=5.0)
        except subprocess.TimeoutExpired:
            logger.error("pid %d survived SIGKILL for 5 s", proc.pid)


class SignalTrap:
    """Records SIGINT/SIGTERM instead of raising, while the ``with`` block runs.

    The handler only stores the signal number: the supervisor polls it, so no lock
    is ever taken inside a handler (an ``Event.set`` there can deadlock). Handlers
    are installed only in the main thread (Python allows no other) and the previous
    ones are restored on exit.
    """

    _SIGNALS = (signal.SIGINT, signal.SIGTERM)

    def __init__(self) -> None:
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def _handle(self, signum: int, frame: FrameType | None) -> None:
        if self.received is None:
            self.received = signum

    def __enter__(self) -> SignalTrap:
        if threading.current_thread() is threading.main_thread():
            for sig in self._SIGNALS:
                self._previous[sig] = signal.signal(sig, self._handle)
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()


class RankOutput:
    """Relays each rank's stdout/stderr to ours as whole lines prefixed ``[rank N]``.

    One lock serialises every write (console and log files), so lines of different
    ranks never interleave mid-line. With ``log_dir`` each rank's lines are also
    appended, unprefixed, to ``log_dir/rank<N>.log`` (one file across restarts).
    With ``echo=False`` ranks' lines go only to the log files (the chaos CLI draws
    a progress display instead); launcher notices are always printed.
    """

    def __init__(self, log_dir: str | None, *, echo: bool = True) -> None:
        self._echo = echo
        self._lock = threading.Lock()
        self._log_dir = Path(log_dir) if log_dir is not None else None
        self._logs: dict[int, TextIO] = {}
        self._threads: dict[int, list[threading.Thread]] = {}

    def attach(self, rank: int, incarnation: int, proc: subprocess.Popen[bytes]) -> None:
        """Start relaying ``proc``'s pipes.

        Raises:
            OSError: the rank's log file could not be opened.
        """
        with self._lock:
            log = self._log_file(rank)
            if log is not None:
                log.write(f"--- incarnation {incarnation}, pid {proc.pid} ---\n")
        threads = [
            threading.Thread(
                target=self._pump,
                args=(rank, pipe, console),
                name=f"rank{rank}-{console}",
                daemon=True,
            )
            for pipe, console in ((proc.stdout, "stdout"), (proc.stderr, "stderr"))
            if pipe is not None
        ]
        # Appended, not replaced: close() must also join a previous incarnation's
        # readers if a process it left behind kept its pipe open for a while.
        self._threads.setdefault(rank, []).extend(threads)
        for t in threads:
            t.start()

    def drain(self, rank: int, timeout_s: float) -> None:
        """Wait (bounded) until ``rank``'s pipes reach EOF, so its last lines come first."""
        for t in self._threads.get(rank, []):
            t.join(timeout_s)

    def notice(self, message: str) -> None:
        """Print one launcher line to our stderr."""
        self._write_console("stderr", f"[launcher] {message}\n")

    def close(self, timeout_s: float = 2.0) -> None:
        """Drain every rank's pipes (bounded) and close the log files."""
        for rank in list(self._threads):
            self.drain(rank, timeout_s)
        with self._lock:
            for log in self._logs.values():
                with contextlib.suppress(OSError):
                    log.close()
            self._logs.clear()

    def _log_file(self, rank: int) -> TextIO | None:
        if self._log_dir is None:
            return None
        if rank not in self._logs:
            self._log_dir.mkdir(parents=True, exist_ok=True)
            path = self._log_dir / f"rank{rank}.log"
            self._logs[rank] = open(path, "a", encoding="utf-8", buffering=1)  # noqa: SIM115
        return self._logs[rank]

    def _pump(self, rank: int, pipe: IO[bytes], console: str) -> None:
        prefix = f"[rank {rank}] "
        try:
            while chunk := pipe.readline(_MAX_LINE):
                line = chunk.decode("utf-8", "replace").rstrip("\r\n") + "\n"
                self._write_console(console, prefix + line, rank=rank, log_line=line)
        except (OSError, ValueError) as exc:
            logger.debug("rank %d %s relay stopped: %s", rank, console, exc)
        finally:
            with contextlib.suppress(OSError):
                pipe.close()

    def _write_console(
        self, console: str, text: str, *, rank: int | None = None, log_line: str = ""
    ) -> None:
        with self._lock:
            if rank is not None and rank in self._logs:
                # A full disk must not stop the console relay, nor the rank (its pipe
                # would fill up and block it).
                with contextlib.suppress(OSError, ValueError):
                    self._logs[rank].write(log_line)
            stream = getattr(sys, console, None) if self._echo or rank is None else None
            if stream is None:
                return
            # A closed console (``resilient run ... | head``) must not block the rank.
            with contextlib.suppress(OSError, ValueError):
                stream.write(text)
                stream.flush()
