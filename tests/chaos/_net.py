"""Helpers for the chaos tests: tiny Python servers and clients run inside a host's
network namespace, a throughput measure, interface state, and process cleanup.

Every helper starts ``sys.executable -c SNIPPET`` through :meth:`Host.wrap`, so the
same code runs in the root namespace (``host=None``) or in a testbed host. Every
wait has a timeout: a broken network must fail a test, never hang it.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

import pytest

from chaos import _sh
from chaos.testbed import Host

_F = TypeVar("_F", bound=Callable[..., object])


def requires_root(test: _F) -> _F:
    """Mark ``test`` as needing root, and skip it (saying why) when not root."""
    skip = pytest.mark.skipif(
        os.geteuid() != 0, reason="needs root (network namespaces, tc, iptables)"
    )
    return pytest.mark.root(skip(test))  # type: ignore[no-any-return]


requires_iptables = pytest.mark.skipif(
    shutil.which("iptables") is None, reason="iptables is not installed"
)

# Fixed ports are fine: every testbed host is a fresh, private network namespace.
TCP_PORT = 5201
SINK_PORT = 5202
UDP_PORT = 5203

# Accepts and closes connections forever on every address of the namespace.
_ACCEPT = """
import socket, sys
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(64)
print("ready", flush=True)
while True:
    c, _ = s.accept(); c.close()
"""

# Prints how a TCP connect went: ok, timeout, refused or unreachable.
_CONNECT = """
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
    print("ok")
except TimeoutError:
    print("timeout")
except ConnectionRefusedError:
    print("refused")
except OSError:
    print("unreachable")
"""

# Receives one connection until EOF; prints bytes and seconds from first byte to EOF,
# so that neither connection setup nor the sender's buffers count.
_SINK = """
import json, socket, sys, time
s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1)
print("ready", flush=True)
c, _ = s.accept()
n, first = 0, None
while True:
    b = c.recv(1 << 20)
    if not b:
        break
    if first is None:
        first = time.monotonic()
    n += len(b)
print(json.dumps({"bytes": n, "seconds": time.monotonic() - (first or 0.0)}), flush=True)
"""

_SEND = """
import socket, sys
c = socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=10.0)
c.sendall(b"x" * int(sys.argv[3])); c.shutdown(socket.SHUT_WR)
c.recv(1)
"""

# Counts datagrams until none came for idle_s (after the first) or deadline_s passed.
# A large receive buffer keeps the socket itself from dropping any.
_UDP_COUNT = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.setsockopt(socket.SOL_SOCKET, 33, 8 << 20)  # SO_RCVBUFFORCE (root)
s.bind((sys.argv[1], int(sys.argv[2])))
idle, deadline = float(sys.argv[3]), time.monotonic() + float(sys.argv[4])
print("ready", flush=True)
n = 0
s.settimeout(idle * 4)
while time.monotonic() < deadline:
    try:
        s.recv(2048)
    except TimeoutError:
        break
    n += 1
    s.settimeout(idle)
print(n, flush=True)
"""

# Paced, so that no queue on the way overflows: only an injected drop loses a datagram.
_UDP_SEND = """
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range(int(sys.argv[3])):
    s.sendto(i.to_bytes(4, "big") * 16, (sys.argv[1], int(sys.argv[2])))
    time.sleep(0.0005)
"""

# Polls an interface's operstate every 2 ms and prints each change, until SIGTERM (or
# at most max_s); then prints "end".
_WATCH = """
import signal, sys, time
signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
path, until = f"/sys/class/net/{sys.argv[1]}/operstate", time.monotonic() + float(sys.argv[2])
last = None
print("ready", flush=True)
try:
    while time.monotonic() < until:
        with open(path) as f:
            state = f.read().strip()
        if state != last:
            print(state, flush=True)
            last = state
        time.sleep(0.002)
finally:
    print("end", flush=True)
"""


# A tick every ~1 ms, its count written to a file: progress the tests can read.
_TICKER = """
import os, sys, time
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
n = 0
while True:
    n += 1
    os.pwrite(fd, n.to_bytes(8, "little"), 0)
    time.sleep(0.001)
"""


class Procs:
    """Processes a test started; :meth:`close` kills whatever still runs."""

    def __init__(self) -> None:
        self._procs: list[subprocess.Popen[str]] = []

    def python(
        self, host: Host | None, code: str, *args: str, new_session: bool = False
    ) -> subprocess.Popen[str]:
        """Start ``code`` on ``host`` (None: the root namespace), stdout piped."""
        argv = [sys.executable, "-c", code, *args]
        return self.spawn(host.wrap(argv) if host else argv, new_session=new_session)

    def spawn(self, argv: list[str], *, new_session: bool = False) -> subprocess.Popen[str]:
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            text=True,
            start_new_session=new_session,
        )
        self._procs.append(proc)
        return proc

    def close(self) -> None:
        for proc in self._procs:
            if proc.poll() is None:
                # SIGKILL also ends a stopped process (a hang test that failed midway).
                with contextlib.suppress(ProcessLookupError):
                    proc.kill()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(5.0)
            if proc.stdout is not None:
                proc.stdout.close()
        self._procs.clear()


def read_line(proc: subprocess.Popen[str], timeout_s: float) -> str:
    """The next stdout line of ``proc``; raises AssertionError after ``timeout_s``."""
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], timeout_s)
    assert ready, f"no output from {proc.args!r} within {timeout_s} s"
    line = proc.stdout.readline()
    assert line, f"{proc.args!r} exited (code {proc.poll()}) without output"
    return line.strip()


def start_server(
    procs: Procs, host: Host | None, code: str, *args: str, timeout_s: float = 10.0
) -> subprocess.Popen[str]:
    proc = procs.python(host, code, *args)
    assert read_line(proc, timeout_s) == "ready"
    return proc


def accept_server(procs: Procs, host: Host | None, addr: str = "0.0.0.0") -> None:
    """A server that accepts TCP connections on ``addr``:TCP_PORT until the test ends."""
    start_server(procs, host, _ACCEPT, addr, str(TCP_PORT))


def run_python(host: Host | None, code: str, *args: str, timeout_s: float = 15.0) -> str:
    """Run ``code`` on ``host`` to completion; its stdout. Fails on a non-zero exit."""
    argv = [sys.executable, "-c", code, *args]
    done = subprocess.run(
        host.wrap(argv) if host else argv,
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    assert done.returncode == 0, f"{code[:40]!r}... exit {done.returncode}: {done.stderr}"
    return done.stdout.strip()


def tcp_connect(src: Host | None, addr: str, timeout_s: float = 1.0) -> str:
    """How a TCP connect from ``src`` to ``addr``:TCP_PORT went (ok, timeout, ...)."""
    return run_python(src, _CONNECT, addr, str(TCP_PORT), str(timeout_s))


def throughput_mbit(procs: Procs, src: Host, dst: Host, rail: int, nbytes: int) -> float:
    """Mbit/s of one TCP transfer of ``nbytes`` from ``src`` to ``dst`` on ``rail``,
    as measured by the receiver."""
    addr = dst.rails[rail]
    sink = start_server(procs, dst, _SINK, addr, str(SINK_PORT))
    run_python(src, _SEND, addr, str(SINK_PORT), str(nbytes), timeout_s=30.0)
    result = json.loads(read_line(sink, 30.0))
    assert result["bytes"] == nbytes
    sink.wait(5.0)
    return float(result["bytes"]) * 8 / 1e6 / max(float(result["seconds"]), 1e-6)


def udp_delivered(procs: Procs, src: Host, dst: Host, rail: int, count: int) -> int:
    """How many of ``count`` paced UDP datagrams from ``src`` reach ``dst`` on ``rail``."""
    addr = dst.rails[rail]
    counter = start_server(procs, dst, _UDP_COUNT, addr, str(UDP_PORT), "0.5", "20")
    run_python(src, _UDP_SEND, addr, str(UDP_PORT), str(count))
    return int(read_line(counter, 30.0))


def operstate(netns: str, iface: str) -> str:
    """The operstate of ``iface`` in ``netns`` (up, down, lowerlayerdown, ...)."""
    argv = _sh.in_netns(netns, ["cat", f"/sys/class/net/{iface}/operstate"])
    return _sh.run(argv).strip()


def watch_operstate(
    procs: Procs, host: Host, iface: str, max_s: float = 30.0
) -> subprocess.Popen[str]:
    """Start recording every operstate change of ``iface`` on ``host``; get them with
    :func:`operstate_changes`."""
    return start_server(procs, host, _WATCH, iface, str(max_s))


def operstate_changes(watch: subprocess.Popen[str], timeout_s: float = 10.0) -> list[str]:
    """Stop ``watch`` and return the states it saw, in order, one per change."""
    watch.terminate()
    states: list[str] = []
    while (line := read_line(watch, timeout_s)) != "end":
        states.append(line)
    return states


def start_ticker(procs: Procs, counter: Path) -> tuple[subprocess.Popen[str], Callable[[], int]]:
    """A process in its own session (pid == pgid, as ranks run) that ticks ~1000 times
    a second; returns it and a reader of its tick count."""
    proc = procs.python(None, _TICKER, str(counter), new_session=True)

    def ticks() -> int:
        data = counter.read_bytes() if counter.exists() else b""
        return int.from_bytes(data[:8], "little") if len(data) >= 8 else 0

    assert wait_for(lambda: ticks() > 0, 10.0), "the ticker never started"
    return proc, ticks


def tick_rate(ticks: Callable[[], int], seconds: float) -> float:
    """Ticks per second over ``seconds``."""
    t0, n0 = time.monotonic(), ticks()
    time.sleep(seconds)
    return (ticks() - n0) / (time.monotonic() - t0)


def wait_for(predicate: Callable[[], bool], timeout_s: float, interval_s: float = 0.02) -> bool:
    """Poll ``predicate`` until it holds or ``timeout_s`` passes; its last value."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval_s)
    return True


def netns_names() -> list[str]:
    out = _sh.run(["ip", "netns", "list"], check=False)
    return [line.split()[0] for line in out.splitlines() if line.strip()]


def link_names() -> list[str]:
    """Interface names of the root namespace."""
    out = _sh.run(["ip", "-o", "link", "show"], check=False)
    return [line.split(":")[1].strip().split("@")[0] for line in out.splitlines() if ":" in line]


def dead_pid() -> int:
    """A pid that belonged to a process that has exited (and been reaped)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait(10.0)
    return proc.pid


def sigkill(proc: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(proc.pid, signal.SIGKILL)
    proc.wait(10.0)
