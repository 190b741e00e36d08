"""GPU health: NVML readings become events; no NVML means no source, never an error."""

from __future__ import annotations

from typing import Any

import pytest

from resilient.detect.gpu import GpuHealth

pytestmark = pytest.mark.timeout(30)


class _Nvml:
    """NVML's answers for one GPU, set by the test (the logic under test is ours)."""

    NVML_NVLINK_MAX_LINKS = 4

    def __init__(self) -> None:
        self.mask = 0
        self.links = {0: 1, 1: 1}  # links 2 and 3 do not exist on this GPU
        self.inited = self.shut = 0

    def nvmlInit(self) -> None:
        self.inited += 1

    def nvmlShutdown(self) -> None:
        self.shut += 1

    def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
        return f"gpu{index}"

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: str) -> int:
        return self.mask

    def nvmlDeviceGetNvLinkState(self, handle: str, link: int) -> int:
        if link not in self.links:
            raise RuntimeError("NVML_ERROR_INVALID_ARGUMENT")
        return self.links[link]


@pytest.fixture
def emitted(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, Any]]]:
    seen: list[tuple[str, dict[str, Any]]] = []
    monkeypatch.setattr("resilient.events.emit", lambda kind, **f: seen.append((kind, f)))
    return seen


def test_throttling_and_nvlink_changes_are_reported_once(emitted: list[Any]) -> None:
    nvml = _Nvml()
    gpu = GpuHealth.open(0, rank=3, nvml=nvml)
    assert gpu is not None and nvml.inited == 1
    assert gpu.poll().slowdowns == () and emitted == []
    nvml.mask = 0x4 | 0x40  # a power cap is normal; the thermal slowdown is not
    nvml.links[1] = 0
    state = gpu.poll()
    assert state.slowdowns == ("hardware thermal slowdown",) and state.nvlinks_down == (1,)
    gpu.poll()  # nothing new: no second report
    nvml.mask, nvml.links[1] = 0, 1
    gpu.poll()
    kinds = [k for k, _ in emitted]
    assert kinds == ["gpu.degraded", "gpu.recovered"]
    assert "NVLink 1 inactive" in emitted[0][1]["reason"]
    assert "thermal" in emitted[1][1]["reason"]


def test_an_xid_error_is_an_event(emitted: list[Any]) -> None:
    gpu = GpuHealth.open(1, rank=0, nvml=_Nvml())
    assert gpu is not None
    gpu.xid(31)  # a memory page fault: the application's, not the GPU's (not fatal)
    assert emitted == [
        ("gpu.error", {"epoch": 0, "reason": "GPU 1: Xid 31", "action": "reported",
                       "gpu": 1, "xid": 31}),
    ]  # fmt: skip


@pytest.mark.timeout(30)
def test_real_nvml_either_opens_or_is_simply_absent() -> None:
    import pynvml

    try:
        pynvml.nvmlInit()
        pynvml.nvmlShutdown()
        present = True
    except pynvml.NVMLError:
        present = False
    gpu = GpuHealth.open(0, rank=0)
    if not present:
        assert gpu is None  # CPU-only host: no source, no error
        return
    assert gpu is not None
    try:
        gpu.start()
        state = gpu.poll()
        assert isinstance(state.slowdowns, tuple)
    finally:
        gpu.close()


class _FailingNvml(_Nvml):
    """An NVML whose event wait fails at once (not a timeout) and whose readings
    fail until ``failing`` is cleared."""

    class NVMLError_Timeout(Exception):  # pynvml's name
        value = 10

    def __init__(self) -> None:
        super().__init__()
        self.failing = True
        self.waits = 0

    def nvmlEventSetCreate(self) -> object:
        return object()

    def nvmlDeviceRegisterEvents(self, handle: str, kinds: int, events: object) -> None:
        pass

    def nvmlEventSetFree(self, events: object) -> None:
        pass

    def nvmlEventSetWait_v2(self, events: object, timeout_ms: int) -> object:
        self.waits += 1
        if self.failing:
            raise RuntimeError("NVML_ERROR_UNKNOWN")
        raise self.NVMLError_Timeout()  # no Xid error this period

    def nvmlDeviceGetCurrentClocksThrottleReasons(self, handle: str) -> int:
        if self.failing:
            raise RuntimeError("NVML_ERROR_GPU_IS_LOST")
        return 0


def test_failing_nvml_reads_are_reported_and_a_failing_wait_keeps_the_period(
    emitted: list[tuple[str, dict[str, Any]]],
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    import time

    from resilient.procs import wait_until

    monkeypatch.setattr("resilient.detect.gpu.PERIOD_S", 0.02)
    nvml = _FailingNvml()
    gpu = GpuHealth.open(0, rank=5, epoch=1, nvml=nvml)
    assert gpu is not None
    gpu.start()
    try:
        time.sleep(0.5)
        # A wait that fails at once used to loop without a pause (thousands of
        # calls here); now it keeps the period.
        assert 5 <= nvml.waits <= 40, nvml.waits
        sites = {f["site"] for k, f in emitted if k == "monitor.failing"}
        assert sites == {"GPU 0 NVML reading", "GPU 0 NVML Xid wait"}
        warned = [r.getMessage() for r in caplog.records if r.levelno >= 30]
        assert any(m.startswith("rank 5: GPU 0 NVML reading failed (1 in a row") for m in warned)
        assert len(warned) == 2  # one per site, rate-limited
        nvml.failing = False  # the waits now time out: the normal case
        assert wait_until(
            lambda: [k for k, _ in emitted].count("monitor.recovered") == 2, timeout_s=5
        )
        assert gpu.poll_failures.consecutive == gpu.xid_failures.consecutive == 0
    finally:
        gpu.close()
    assert not any(k == "gpu.error" for k, _ in emitted)  # a failed wait is no Xid
