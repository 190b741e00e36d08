"""The slow-cpu fault on real processes: a cgroup CPU quota that slows a busy
process without stopping it, follows the rank to a replacement, goes on stop, and
is swept up when its owner died (chaos.cpu_throttle, chaos.cleanup); it counts as
fired once the rank is under the quota, after measuring its CPUs."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from chaos import cleanup
from chaos.cpu_throttle import CpuQuota, cpu_root
from chaos.injector_kinds import make_injector
from chaos.injectors import InjectionContext
from chaos.scenario import Fault
from chaos.testbed import LoopbackTestbed
from resilient.errors import ChaosError
from tests.chaos import _net

pytestmark = pytest.mark.timeout(60)

# Counts loop turns into an 8-byte file: busy on one CPU, as a computing rank is.
_SPINNER = """
import mmap, os, struct, sys
fd = os.open(sys.argv[1], os.O_RDWR | os.O_CREAT)
os.ftruncate(fd, 8)
m = mmap.mmap(fd, 8)
n = 0
while True:
    n += 1
    if n % 1000 == 0:
        struct.pack_into("<q", m, 0, n)
"""


def _controller() -> Path:
    if os.geteuid() != 0:
        pytest.skip("cgroups need root")
    try:
        return cpu_root()[0]
    except ChaosError as exc:
        pytest.skip(str(exc))


@pytest.fixture
def spinners(tmp_path: Path) -> Iterator[Callable[[str], tuple[int, Callable[[], int]]]]:
    procs: list[subprocess.Popen[bytes]] = []

    def start(name: str) -> tuple[int, Callable[[], int]]:
        counter = tmp_path / name
        proc = subprocess.Popen(
            [sys.executable, "-c", _SPINNER, str(counter)], start_new_session=True
        )
        procs.append(proc)

        def turns() -> int:
            data = counter.read_bytes() if counter.exists() else b""
            return int.from_bytes(data[:8], "little") if len(data) >= 8 else 0

        assert _net.wait_for(lambda: turns() > 0, 10.0), "the spinner never started"
        return proc.pid, turns

    yield start
    for proc in procs:
        proc.kill()
        proc.wait(10.0)


def _cgroup_of(pid: int) -> str:
    return Path(f"/proc/{pid}/cgroup").read_text()


def _injector(params: dict[str, object], pid_of: Callable[[int], int]) -> object:
    ctx = InjectionContext(testbed=LoopbackTestbed(1, 1).up(), pid_of=pid_of)
    return make_injector(Fault(kind="slow-cpu", at_s=0.0, params=params), ctx)


def _cpu_share(pid: int, seconds: float) -> float:
    """The CPUs ``pid``'s main thread ran on over ``seconds`` (schedstat's run time)."""

    def ran() -> int:
        return int(Path(f"/proc/{pid}/schedstat").read_text().split()[0])

    t0, r0 = time.monotonic(), ran()
    time.sleep(seconds)
    return (ran() - r0) / 1e9 / (time.monotonic() - t0)


def test_a_quota_slows_a_busy_process_that_keeps_running_until_stopped(
    spinners: Callable[[str], tuple[int, Callable[[], int]]],
) -> None:
    _controller()
    pid, turns = spinners("busy")
    slow = _injector({"rank": 0, "factor": 0.2, "cpus": 1.0}, lambda rank: pid)
    began = time.time()
    slow.start()  # type: ignore[attr-defined]
    try:
        assert began <= slow.fired_at <= time.time()  # type: ignore[attr-defined]
        assert "rsl-" in _cgroup_of(pid)
        # The quota caps it at 0.2 of a CPU whatever else runs (a loaded host only
        # lowers it), and it keeps running: a slow node, not a frozen one.
        share = _cpu_share(pid, 1.5)
        before = turns()
        assert 0.005 < share < 0.3, share
        assert _net.wait_for(lambda: turns() > before, 5.0)
    finally:
        slow.stop()  # type: ignore[attr-defined]
    assert "rsl-" not in _cgroup_of(pid)
    assert not any(p.name.startswith(f"rsl-{os.getpid()}-") for p in cpu_root()[0].iterdir())


def test_the_quota_follows_the_rank_to_its_replacement_unless_pinned(
    spinners: Callable[[str], tuple[int, Callable[[], int]]],
) -> None:
    _controller()
    first, _ = spinners("first")
    second, _ = spinners("second")
    now = {"pid": first}
    slow = _injector({"rank": 0, "factor": 0.5}, lambda rank: now["pid"])  # measured CPUs
    began = time.time()
    slow.start()  # type: ignore[attr-defined]
    try:
        # Fired once capped: after the 0.2 s measurement of what the rank used.
        assert began + 0.19 <= slow.fired_at <= time.time()  # type: ignore[attr-defined]
        now["pid"] = second  # the rank was replaced in place: the slow node slows it too
        assert _net.wait_for(lambda: "rsl-" in _cgroup_of(second), 5.0)
    finally:
        slow.stop()  # type: ignore[attr-defined]
    assert "rsl-" not in _cgroup_of(second)
    pinned = _injector({"rank": 0, "factor": 0.5, "pin": True}, lambda rank: now["pid"])
    pinned.start()  # type: ignore[attr-defined]
    try:
        now["pid"] = first
        time.sleep(0.5)
        assert "rsl-" in _cgroup_of(second) and "rsl-" not in _cgroup_of(first)
    finally:
        pinned.stop()  # type: ignore[attr-defined]


def test_a_dead_owners_cgroup_is_swept_and_a_foreign_one_kept(
    spinners: Callable[[str], tuple[int, Callable[[], int]]],
) -> None:
    root = _controller()
    pid, _ = spinners("left")
    dead = _net.dead_pid()
    ours, foreign = root / f"rsl-{dead}-slow-r0", root / f"zzt{os.getpid()}-cg"
    try:
        for path in (ours, foreign):
            path.mkdir()
        (ours / "cgroup.procs").write_text(str(pid))
        removed = cleanup.remove_leftovers()
        assert cleanup.Leftover("cgroup", str(ours), dead) in removed
        assert not ours.exists() and foreign.exists()
        assert "rsl-" not in _cgroup_of(pid)  # back at full speed, not killed
    finally:
        for path in (ours, foreign):
            if path.exists():
                path.rmdir()


def test_bad_quotas_and_factors_are_refused() -> None:
    _controller()
    with pytest.raises(ChaosError, match="not positive"):
        CpuQuota("bad", 0.0)
    slow = _injector({"rank": 0, "factor": 1.5}, lambda rank: os.getpid())
    with pytest.raises(ChaosError, match="factor"):
        slow.start()  # type: ignore[attr-defined]
