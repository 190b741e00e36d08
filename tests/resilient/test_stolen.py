"""StolenTime measures real stops: a child process SIGSTOPped for a while reports it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

_CHILD = """
import sys, time
from resilient._stolen import StolenTime
meter = StolenTime("test-stolen")
print("ready", flush=True)
time.sleep(float(sys.argv[1]))
print(meter.total_us, flush=True)
meter.close()
"""


def _run(stop_s: float) -> int:
    """Stolen microseconds of a child living 1.5 s, stopped ``stop_s`` in the middle."""
    proc = subprocess.Popen(
        [sys.executable, "-c", _CHILD, "1.5"], stdout=subprocess.PIPE, text=True
    )
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "ready"
        time.sleep(0.3)
        if stop_s:
            os.kill(proc.pid, signal.SIGSTOP)
            time.sleep(stop_s)
            os.kill(proc.pid, signal.SIGCONT)
        out, _ = proc.communicate(timeout=20)
        return int(out.strip())
    finally:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGCONT)
            proc.kill()
            proc.wait(timeout=5)


@pytest.mark.timeout(60)
def test_a_stopped_process_counts_its_stop_and_a_running_one_little() -> None:
    stopped_us = _run(0.5)
    running_us = _run(0.0)
    assert 400_000 <= stopped_us <= 800_000, stopped_us
    assert running_us < 200_000, running_us
