"""GPU health watches the right device (by UUID or PCI bus id), says once when it cannot,
and a fatal Xid makes the rank leave the job; all against a fake NVML (pynvml's names)."""

from __future__ import annotations

import logging
import subprocess
import sys
import textwrap
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from resilient.detect import gpu as gpu_mod
from resilient.detect.gpu import EXIT_GPU_LOST, FATAL_XIDS, GpuHealth, nvml_handle
from tests.resilient.detect.test_gpu import _Nvml

pytestmark = pytest.mark.timeout(30)

# What torch reports for the CUDA device the rank uses: CUDA's index 0 under
# CUDA_VISIBLE_DEVICES=2, which is NVML's GPU 2.
_UUID = "6f1a0c2e-1111-2222-3333-444455556666"
_PROPS = SimpleNamespace(uuid=_UUID, pci_bus_id=0x65, pci_device_id=0, pci_domain_id=0)


class _HostNvml(_Nvml):
    """An NVML that knows three GPUs by index, UUID and PCI bus id (as pynvml names them)."""

    def __init__(self, *, by_uuid: bool = True, by_pci: bool = True) -> None:
        super().__init__()
        self.by_uuid, self.by_pci = by_uuid, by_pci
        self.asked: list[str] = []

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> str:
        self.asked.append(f"uuid {uuid}")
        if not self.by_uuid or uuid != f"GPU-{_UUID}":
            raise RuntimeError("NVML_ERROR_NOT_FOUND")
        return "gpu2"

    def nvmlDeviceGetHandleByPciBusId(self, bus: str) -> str:
        self.asked.append(f"pci {bus}")
        if not self.by_pci or bus != "00000000:65:00.0":
            raise RuntimeError("NVML_ERROR_NOT_FOUND")
        return "gpu2"


def test_the_handle_is_found_by_uuid_then_pci_bus_id_then_index(
    caplog: pytest.LogCaptureFixture,
) -> None:
    assert nvml_handle(_HostNvml(), 0, _PROPS) == ("gpu2", "uuid")
    nvml = _HostNvml(by_uuid=False)
    assert nvml_handle(nvml, 0, _PROPS) == ("gpu2", "pci")
    assert nvml.asked == [f"uuid GPU-{_UUID}", "pci 00000000:65:00.0"]
    # A bus id torch gives as a string is NVML's form already.
    as_text = SimpleNamespace(pci_bus_id="00000000:65:00.0")
    assert nvml_handle(_HostNvml(), 0, as_text) == ("gpu2", "pci")
    caplog.set_level(logging.DEBUG, logger="resilient.detect.gpu")
    # Neither known (an old torch): the CUDA index, said at debug level.
    assert nvml_handle(_HostNvml(), 0, SimpleNamespace()) == ("gpu0", "index")
    assert nvml_handle(_HostNvml(by_uuid=False, by_pci=False), 0, _PROPS) == ("gpu0", "index")
    said = [r.getMessage() for r in caplog.records if r.levelno == logging.DEBUG]
    assert any("using the index" in m and "torch gave neither" in m for m in said)
    assert any("NVML_ERROR_NOT_FOUND" in m for m in said)


def test_open_watches_the_device_the_properties_name(emitted: list[Any]) -> None:
    gpu = GpuHealth.open(0, rank=1, nvml=_HostNvml(), props=_PROPS, cuda=True)
    assert gpu is not None
    assert (gpu.handle, gpu.found_by, gpu.index) == ("gpu2", "uuid", 0)
    assert emitted == []


class _NoDriver(_Nvml):
    def nvmlInit(self) -> None:
        raise RuntimeError("NVML Shared Library Not Found")


def test_nvml_missing_beside_cuda_is_told_once(
    emitted: list[Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(gpu_mod, "_unavailable_told", False)
    caplog.set_level(logging.DEBUG, logger="resilient.detect.gpu")
    for _ in range(3):  # the world group and two subgroups, say
        assert GpuHealth.open(0, rank=2, nvml=_NoDriver(), props=_PROPS, cuda=True) is None
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and warned[0].startswith("rank 2 (epoch 0): CUDA is present")
    assert "NVML Shared Library Not Found" in warned[0]
    assert [k for k, _ in emitted] == ["gpu.health_unavailable"]
    assert emitted[0][1]["gpu"] == 0 and "NVML cannot be used" in emitted[0][1]["reason"]


def test_no_handle_for_the_device_is_told_and_nvml_shut_down(
    emitted: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(gpu_mod, "_unavailable_told", False)

    class _Empty(_HostNvml):
        def nvmlDeviceGetHandleByIndex(self, index: int) -> str:
            raise RuntimeError("NVML_ERROR_INVALID_ARGUMENT")

    nvml = _Empty(by_uuid=False, by_pci=False)
    assert GpuHealth.open(0, rank=0, nvml=nvml, props=_PROPS, cuda=True) is None
    assert nvml.shut == 1
    assert [k for k, _ in emitted] == ["gpu.health_unavailable"]
    assert "no NVML handle" in emitted[0][1]["reason"]


def test_without_cuda_a_missing_nvml_is_no_news(
    emitted: list[Any], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(gpu_mod, "_unavailable_told", False)
    assert GpuHealth.open(0, rank=0, nvml=_NoDriver()) is None
    assert emitted == [] and not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_watch_current_opens_torchs_current_device_after_it_was_set(
    emitted: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    seen: list[int] = []
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)

    def props(index: int) -> SimpleNamespace:
        seen.append(index)
        return _PROPS

    monkeypatch.setattr(torch.cuda, "get_device_properties", props)
    gpu = GpuHealth.watch_current(rank=3, nvml=_HostNvml())
    assert gpu is not None and seen == [1]
    assert (gpu.index, gpu.handle, gpu.found_by) == (1, "gpu2", "uuid")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert GpuHealth.watch_current(rank=3, nvml=_HostNvml()) is None


def test_a_fatal_xid_makes_the_rank_leave_and_others_are_reported(emitted: list[Any]) -> None:
    fatal: list[int] = []
    gpu = GpuHealth.open(0, rank=4, epoch=2, nvml=_HostNvml(), props=_PROPS)
    assert gpu is not None
    gpu.on_fatal = fatal.append
    gpu.xid(13)  # a graphics engine exception: the application's, reported
    gpu.xid(63)  # a row remapping recorded: a warning sign, reported
    assert fatal == [] and [f["action"] for _, f in emitted] == ["reported", "reported"]
    gpu.xid(79)  # fallen off the bus
    assert fatal == [79]
    kind, fields = emitted[-1]
    assert kind == "gpu.error" and fields["fatal"] is True and fields["xid"] == 79
    assert f"exit with code {EXIT_GPU_LOST}" in fields["action"]
    assert {48, 62, 64, 74, 79, 94, 95} == FATAL_XIDS


class _XidNvml(_HostNvml):
    """An NVML whose event wait reports Xid ``code`` once, then times out."""

    class NVMLError_Timeout(Exception):
        value = 10

    def __init__(self, code: int) -> None:
        super().__init__()
        self.code: int | None = code

    def nvmlEventSetCreate(self) -> object:
        return object()

    def nvmlDeviceRegisterEvents(self, handle: str, kinds: int, events: object) -> None:
        assert handle == "gpu2"  # the rank's device, not NVML's GPU 0

    def nvmlEventSetFree(self, events: object) -> None:
        pass

    def nvmlEventSetWait_v2(self, events: object, timeout_ms: int) -> object:
        code, self.code = self.code, None
        if code is None:
            raise self.NVMLError_Timeout()
        return SimpleNamespace(eventType=0x8, eventData=code)


def test_a_fatal_xid_from_the_watch_thread_runs_on_fatal(
    emitted: list[Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    from resilient.procs import wait_until

    monkeypatch.setattr("resilient.detect.gpu.PERIOD_S", 0.02)
    fatal: list[int] = []
    gpu = GpuHealth.open(0, rank=0, nvml=_XidNvml(95), props=_PROPS, on_fatal=fatal.append)
    assert gpu is not None
    gpu.start()
    try:
        assert wait_until(lambda: fatal == [95], timeout_s=5)
    finally:
        gpu.close()
    assert gpu.xids == [95]


@pytest.mark.timeout(60)
def test_the_default_on_fatal_exits_with_the_gpu_lost_code() -> None:
    code = textwrap.dedent(
        """
        import time
        from resilient.detect.gpu import GpuHealth
        from tests.resilient.detect.test_gpu_device import _HostNvml, _PROPS
        gpu = GpuHealth.open(0, rank=0, nvml=_HostNvml(), props=_PROPS)
        gpu.xid(79)
        time.sleep(5)
        """
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=50)
    assert proc.returncode == EXIT_GPU_LOST, proc.stderr
    assert "fatal Xid error 79" in proc.stderr
