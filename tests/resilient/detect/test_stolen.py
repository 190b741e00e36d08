"""StolenTime measures real stops: a child process SIGSTOPped for a while reports it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from resilient.detect.stolen_time import StolenTime
from tests._procs import gone, wait_until

_CHILD = """
import sys, time
from resilient.detect.stolen_time import StolenTime
meter = StolenTime("test-stolen")
print(meter.pid, flush=True)
time.sleep(float(sys.argv[1]))
print(meter.total_us, flush=True)
meter.close()
"""


def _start(live_s: float) -> tuple[subprocess.Popen[str], int]:
    """A child in a process group of its own (as a launched rank is) running a
    meter for ``live_s``; the child and its meter's pid."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, str(live_s)],
        stdout=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )
    assert proc.stdout is not None
    return proc, int(proc.stdout.readline())


def _end(proc: subprocess.Popen[str]) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGCONT)
        proc.kill()
        proc.wait(timeout=5)


def _run(stop_s: float) -> int:
    """Stolen microseconds of a child living 1.5 s, its process group stopped
    ``stop_s`` in the middle (as chaos stops a rank)."""
    proc, _ = _start(1.5)
    try:
        time.sleep(0.3)
        if stop_s:
            os.killpg(proc.pid, signal.SIGSTOP)
            time.sleep(stop_s)
            os.killpg(proc.pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=20)
        return int(out.strip())
    finally:
        _end(proc)


@pytest.mark.timeout(60)
def test_a_stopped_process_counts_its_stop_and_a_running_one_little() -> None:
    stopped_us = _run(0.5)
    running_us = _run(0.0)
    # The meter is outside the stopped group, so the whole stop counts (to a period).
    assert 450_000 <= stopped_us <= 800_000, stopped_us
    assert running_us < 200_000, running_us


@pytest.mark.timeout(60)
def test_the_meter_ends_with_its_process_even_when_killed() -> None:
    proc, meter = _start(30.0)
    try:
        assert not wait_until(lambda: gone(meter), 0.2)  # it runs while its process does
        os.killpg(proc.pid, signal.SIGKILL)
        assert wait_until(lambda: gone(meter), 5.0)
    finally:
        _end(proc)


@pytest.mark.timeout(30)
def test_close_ends_the_meter_and_keeps_the_total() -> None:
    meter = StolenTime("test-close")
    pid = meter.pid
    assert pid is not None
    meter.close()
    assert wait_until(lambda: gone(pid), 2.0)
    meter.close()  # twice is fine
    assert meter.total_us >= 0


_FORKS = """
import os, sys
from resilient.detect.stolen_time import StolenTime
meter = StolenTime("test-fork")
mine = os.readlink(f"/proc/self/fd/{meter._pipe}")  # pipe:[inode]
read, write = os.pipe()
pid = os.fork()
if pid == 0:  # a data loader's worker, say
    held = [os.readlink(f"/proc/self/fd/{fd}") for fd in os.listdir("/proc/self/fd")
            if os.path.exists(f"/proc/self/fd/{fd}")]
    # The meter's end is closed here, so its number may be another file's now;
    # the copy of the meter must not close that when it is dropped.
    other = os.open("/dev/null", os.O_RDONLY)
    meter._finalizer()
    os.fstat(other)  # raises if it was closed
    os.write(write, str(mine in held).encode())
    os._exit(0)
os.close(write)  # a child that failed leaves the read below empty, not blocked
os.waitpid(pid, 0)
print(os.read(read, 16).decode() or "failed", mine.startswith("pipe:"), flush=True)
meter.close()
"""


@pytest.mark.timeout(30)
def test_a_forked_child_does_not_hold_the_meters_pipe() -> None:
    out = subprocess.run(
        [sys.executable, "-c", _FORKS], capture_output=True, text=True, timeout=20, check=True
    )
    assert out.stdout.split() == ["False", "True"], out


@pytest.mark.timeout(30)
def test_a_meter_that_cannot_start_reads_zero_and_says_so(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def refuse(*args: object, **kwargs: object) -> None:
        raise OSError(11, "Resource temporarily unavailable")

    monkeypatch.setattr(subprocess, "Popen", refuse)
    with caplog.at_level("WARNING", logger="resilient.detect.stolen_time"):
        meter = StolenTime("test-refused")
    assert meter.pid is None and meter.total_us == 0
    warned = [
        r
        for r in caplog.records
        if r.name == "resilient.detect.stolen_time" and r.levelname == "WARNING"
    ]
    assert len(warned) == 1, caplog.records
    meter.close()
    assert meter.total_us == 0


_BUSY = """
import sys, time
from resilient.detect.stolen_time import StolenTime
meter = StolenTime("test-quota")
print(meter.pid, flush=True)
sys.stdin.readline()
t0, s0 = time.monotonic(), meter.total_us
while time.monotonic() - t0 < float(sys.argv[1]):
    pass
time.sleep(0.05)  # the meter's next look
print(int((time.monotonic() - t0) * 1e6), meter.total_us - s0, flush=True)
meter.close()
"""


@pytest.mark.timeout(60)
def test_a_process_throttled_by_its_cgroup_counts_the_throttle() -> None:
    # A CPU quota slows a process that keeps running (a throttled node, the chaos
    # slow-cpu fault): the meter counts the time its cgroup was throttled, whether
    # or not one of its own wake-ups fell in a throttled stretch.
    if os.geteuid() != 0:
        pytest.skip("cgroups need root")
    from chaos.cpu_throttle import CpuQuota
    from resilient.errors import ChaosError

    try:
        quota = CpuQuota("test-stolen", 0.05)
    except ChaosError as exc:
        pytest.skip(str(exc))
    proc = subprocess.Popen(
        [sys.executable, "-c", _BUSY, "1.0"], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
        text=True, start_new_session=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None and proc.stdin is not None
        meter = int(proc.stdout.readline())
        assert quota.add(proc.pid) and meter in quota.pids()
        time.sleep(0.25)  # the meter looks its cgroup up again every CGROUP_EVERY_S
        proc.stdin.write("go\n")
        proc.stdin.flush()
        elapsed_us, stolen_us = (int(x) for x in proc.stdout.readline().split())
    finally:
        _end(proc)
        quota.remove()
    # At 0.05 of a CPU it is throttled most of the time; 40 % leaves room for a
    # crowded host, where it would not have had a whole CPU anyway.
    assert stolen_us >= 0.4 * elapsed_us, (stolen_us, elapsed_us)
    # A throttle delays the meter too: it is counted once, not as lateness as well.
    assert stolen_us <= 1.05 * elapsed_us, (stolen_us, elapsed_us)
