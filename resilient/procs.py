"""Process helpers shared by the launcher, the embedded etcd and the chaos tools.

Children are started in their own session (so a terminal's Ctrl-C reaches only the
supervisor, which then stops them in order) and, on Linux, with a parent-death
signal so that they cannot outlive a supervisor that was SIGKILLed.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import random
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from datetime import timedelta
from typing import IO, TYPE_CHECKING, Any

if TYPE_CHECKING:
    from torch._C._distributed_c10d import TCPStore

__all__ = ["free_port", "host_store", "pid_alive", "spawn", "stop_process"]

logger = logging.getLogger(__name__)

_PR_SET_PDEATHSIG = 1


def _pdeathsig_preexec() -> Callable[[], None] | None:
    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None

    def _set() -> None:
        # Tied to the spawning *thread*: callers spawn from long-lived threads only.
        libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)

    return _set


def host_store(host: str, *, timeout_s: float = 60.0) -> TCPStore:
    """A TCPStore server on a free port, on every interface (``host`` only names it
    in errors); ranks started with ``TORCHELASTIC_USE_AGENT_STORE=True`` connect to it
    as clients, as under torchrun's agent. ``timeout_s`` bounds this object's own calls.

    Raises:
        LauncherError: the server could not be started.
    """
    from torch._C._distributed_c10d import TCPStore

    from resilient.errors import LauncherError

    try:
        return TCPStore(
            host, 0, None, True, timeout=timedelta(seconds=timeout_s), wait_for_workers=False
        )
    except (RuntimeError, OSError) as exc:
        raise LauncherError(f"could not host the rendezvous store for {host}: {exc}") from exc


def free_port(host: str = "127.0.0.1") -> int:
    """Return a TCP port that was free on ``host`` a moment ago (callers retry on a race).

    Chosen below the kernel's ephemeral range: a port from ``bind(0)`` is one the
    kernel may hand the next outgoing connection or listener (every link makes
    some), and a server that binds it a moment later then fails with EADDRINUSE
    (seen in a test's TCPStore). Ports outside that range only an explicit bind
    takes.
    """
    return free_ports(1, host)[0]


def free_ports(count: int, host: str = "127.0.0.1") -> tuple[int, ...]:
    """Return ``count`` distinct ports free on ``host`` a moment ago (see :func:`free_port`).

    One call for ports one server needs together: picked one at a time, two of
    them were the same random port once (an etcd member's client and peer URL,
    so it failed with EADDRINUSE against itself).
    """
    low = _ephemeral_low()
    chosen: list[int] = []
    for _ in range(64 * count):
        if len(chosen) == count:
            break
        port = random.randrange(max(1024, low - 16384), low)
        if port not in chosen and _bindable(host, port):
            chosen.append(port)
    while len(chosen) < count:
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = int(s.getsockname()[1])
        if port not in chosen:
            chosen.append(port)
    return tuple(chosen)


def _bindable(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        try:
            s.bind((host, port))
        except OSError:
            return False
    return True


def _ephemeral_low() -> int:
    """The lowest port of the kernel's ephemeral range (Linux; 32768 elsewhere)."""
    try:
        with open("/proc/sys/net/ipv4/ip_local_port_range") as f:
            return max(2048, int(f.read().split()[0]))
    except (OSError, ValueError, IndexError):
        return 32768


def spawn(
    argv: Sequence[str],
    *,
    env: Mapping[str, str] | None = None,
    cwd: str | None = None,
    stdout: IO[Any] | int | None = None,
    stderr: IO[Any] | int | None = None,
    new_session: bool = True,
    stdin: IO[Any] | int | None = subprocess.DEVNULL,
    pass_fds: Sequence[int] = (),
) -> subprocess.Popen[bytes]:
    """Start ``argv`` in its own session, killed if this process dies; ``pass_fds``
    stay open in the child (every other descriptor is closed)."""
    return subprocess.Popen(
        list(argv),
        env=dict(env) if env is not None else None,
        cwd=cwd,
        stdin=stdin,
        stdout=stdout,
        stderr=stderr,
        start_new_session=new_session,
        preexec_fn=_pdeathsig_preexec(),
        pass_fds=tuple(pass_fds),
    )


def pid_alive(pid: int) -> bool:
    """Whether process ``pid`` exists (one of another user counts: it is not ours to
    clean up after)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def stop_process(proc: subprocess.Popen[Any], *, grace_s: float = 5.0) -> int | None:
    """SIGTERM ``proc`` (its whole session), wait ``grace_s``, then SIGKILL. Returns its code."""
    if proc.poll() is not None:
        return proc.returncode
    _signal_group(proc, signal.SIGTERM)
    try:
        return proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        logger.warning("pid %s ignored SIGTERM for %.1f s; sending SIGKILL", proc.pid, grace_s)
    _signal_group(proc, signal.SIGKILL)
    try:
        return proc.wait(timeout=5.0)
    except subprocess.TimeoutExpired:
        logger.error("pid %s survived SIGKILL for 5 s", proc.pid)
        return None


def _signal_group(proc: subprocess.Popen[Any], sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, sig)
        return
    with contextlib.suppress(ProcessLookupError):
        proc.send_signal(sig)


def wait_until(
    predicate: Callable[[], bool], *, timeout_s: float, interval_s: float = 0.05
) -> bool:
    """Poll ``predicate`` until it is true or ``timeout_s`` passes; return its last value."""
    deadline = time.monotonic() + timeout_s
    while True:
        if predicate():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)
