"""One warm spare as the launcher sees it: the process, and whether it stands ready.

The spare (:mod:`resilient.launch.standby`) writes one byte on a pipe when it reaches
``wait_for_go``: it has imported torch, built the model and DDP and run the
warm-up passes. Until then a loss of its rank would wait for all of that, which
is why the chaos runner holds a kill of a rank whose spare is still warming up.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence

from resilient.launch.handover import handover_line
from resilient.launch.rank_procs import reap
from resilient.procs import spawn

__all__ = ["PrimedRanks", "Spare"]


class Spare:
    """A standby process started with a ready pipe; see the module docstring."""

    def __init__(self, proc: subprocess.Popen[bytes], ready_fd: int) -> None:
        self.proc = proc
        self.started_at = time.monotonic()
        self.ready_after_s: float | None = None  # seconds from start to ready
        self._ready_fd: int | None = ready_fd

    @classmethod
    def start(cls, argv: Sequence[str], env: Mapping[str, str], wrap: Sequence[str]) -> Spare:
        """Start ``python -m resilient.launch.standby`` for ``argv`` (script and its
        arguments), inside ``wrap`` (a namespace's command prefix, may be empty).

        Raises:
            OSError: the process could not be started.
        """
        read_fd, write_fd = os.pipe()
        os.set_blocking(read_fd, False)
        cmd = [*wrap, sys.executable, "-u", "-m", "resilient.launch.standby"]
        cmd += ["--ready-fd", str(write_fd), *argv]
        try:
            proc = spawn(
                cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                stderr=subprocess.PIPE, pass_fds=(write_fd,),
            )  # fmt: skip
        except OSError:
            os.close(read_fd)
            raise
        finally:
            os.close(write_fd)
        return cls(proc, read_fd)

    def poll_ready(self) -> bool:
        """Whether the spare said it stands ready (read without blocking); True once
        it did, until it is handed over or closed."""
        fd = self._ready_fd
        if self.ready_after_s is not None or fd is None:
            return self.ready_after_s is not None
        try:
            said = os.read(fd, 1)
        except BlockingIOError:
            return False
        except OSError:
            said = b""
        if said:
            self.ready_after_s = time.monotonic() - self.started_at
        self._close_pipe()  # said it, or exited without saying it
        return bool(said)

    def exit_code(self) -> int | None:
        """The spare's exit code, None while it runs (reaps it once it ended)."""
        return reap(self.proc)

    def hand_over(self) -> bool:
        """Write ``go``: the spare takes its rank. False if it is gone."""
        self._close_pipe()
        stdin = self.proc.stdin
        if self.exit_code() is not None or stdin is None:
            return False
        try:
            stdin.write(b"go\n")
            stdin.close()
        except OSError:
            return False
        return True

    def close(self) -> None:
        """Forget the ready pipe (the process itself is the caller's to stop)."""
        self._close_pipe()

    def _close_pipe(self) -> None:
        fd, self._ready_fd = self._ready_fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)


class PrimedRanks:
    """Primed ranks (:mod:`resilient.launch.primed`): processes past ``import torch``,
    each handed a rank's environment and script when it is to run one. A spare
    node keeps one per rank it would run; the launcher keeps one per rank slot for
    the slot's next cold restart (``LaunchConfig.primed_restarts``)."""

    def __init__(self, count: int, env: Mapping[str, str], wrap: Sequence[str] = ()) -> None:
        """Start ``count`` of them with the node's environment ``env``, inside
        ``wrap`` (a command prefix, such as a network namespace's; may be empty).

        Raises:
            OSError: a process could not be started (those started are stopped).
        """
        self._procs: list[subprocess.Popen[bytes]] = []
        self._closed: list[subprocess.Popen[bytes]] = []  # told to exit, not reaped yet
        cmd = [*wrap, sys.executable, "-u", "-m", "resilient.launch.primed"]
        try:
            for _ in range(count):
                pipe = subprocess.PIPE
                proc = spawn(cmd, env=env, stdin=pipe, stdout=pipe, stderr=pipe)
                self._procs.append(proc)
        except OSError:
            self.close()
            raise

    @property
    def procs(self) -> list[subprocess.Popen[bytes]]:
        """Those not handed a rank, closed ones included (to stop with the ranks)."""
        return [*self._procs, *self._closed]

    def exited(self) -> tuple[subprocess.Popen[bytes], int] | None:
        """One that exited while it waited (the OOM killer, a failed import), with
        its exit code; None while every one not handed a rank is alive."""
        for proc in self._procs:
            code = reap(proc)
            if code is not None:
                return proc, code
        return None

    def take(self, env: Mapping[str, str], argv: Sequence[str]) -> subprocess.Popen[bytes] | None:
        """A primed process now running ``argv`` (script and arguments) in ``env``;
        None when none is left alive (the caller starts the rank cold)."""
        while self._procs:
            proc = self._procs.pop(0)
            if reap(proc) is not None or proc.stdin is None:
                continue
            try:
                proc.stdin.write(handover_line(dict(env), list(argv)))
                proc.stdin.close()
            except OSError:
                continue
            return proc
        return None

    def start(
        self, env: Mapping[str, str], script: Sequence[str], argv: Sequence[str]
    ) -> tuple[subprocess.Popen[bytes], bool]:
        """A rank's process, and whether it was primed: one of these running
        ``script`` (the script and its arguments) in ``env`` while one is left,
        else ``argv`` (the whole command) started cold.

        Raises:
            OSError: the cold process could not be started.
        """
        proc = self.take(env, script)
        if proc is not None:
            return proc, True
        pipe = subprocess.PIPE
        return spawn(argv, env=env, stdout=pipe, stderr=pipe), False

    def close(self) -> None:
        """End those not handed a rank: end of file, so each exits 0 (a parent-death
        signal ends them anyway if this process dies first)."""
        procs, self._procs = self._procs, []
        self._closed += procs
        for proc in procs:
            with contextlib.suppress(OSError):
                if proc.stdin is not None:
                    proc.stdin.close()
