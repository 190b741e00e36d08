"""GPU health: NVML readings become events; no NVML means no source, never an error."""

from __future__ import annotations

from typing import Any

import pytest

from resilient.detect.gpu import GpuHealth


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
    gpu.xid(79)  # fallen off the bus
    assert emitted == [
        ("gpu.error", {"epoch": 0, "reason": "GPU 1: Xid 79", "action": "reported",
                       "gpu": 1, "xid": 79}),
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
