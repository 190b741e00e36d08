"""GPU health from NVML: one more health source beside the NICs and the links.

What NVML can tell before a collective fails or slows down:

* **Xid errors** (``nvmlEventTypeXidCriticalError``): the driver's report of a
  GPU fault (ECC, fallen off the bus, a kernel that faulted);
* **throttling** (``nvmlDeviceGetCurrentClocksThrottleReasons``): hardware or
  thermal slowdowns and the power brake, which make this rank a compute straggler;
* **NVLink** state per link (``nvmlDeviceGetNvLinkState``): a link that was active
  and is not any more.

Each change becomes an event (``gpu.error``, ``gpu.degraded``, ``gpu.recovered``)
and a warning. A poll that fails is counted and retried next period; it never
raises into the training process.

Which GPU: :meth:`GpuHealth.watch_current` watches torch's current CUDA device,
found in NVML by its UUID or PCI bus id (NVML numbers the GPUs of the host, CUDA
those it sees, in its own order and under ``CUDA_VISIBLE_DEVICES``); the CUDA index
is the NVML index only as a last resort, with a debug line saying so. The process
group opens it in its constructor, after ``resilient.init()`` set the device.

No source: where CUDA is absent (a CPU-only host) there is simply no GPU to watch.
Where CUDA is present but NVML cannot be used (no ``pynvml``, no driver library, no
handle for the device) the process logs one WARNING and emits one
``gpu.health_unavailable`` event, then runs without GPU health.

A fatal Xid (:data:`FATAL_XIDS`: the GPU, its memory or its links failed) means this
rank's GPU cannot go on: the rank logs it, emits ``gpu.error`` and exits with
:data:`EXIT_GPU_LOST`, like a crashed rank, so that the survivors recover from a lost
rank and the launcher starts a replacement (``resilient run`` restarts failed ranks).
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

import torch

from resilient import events
from resilient.failures import FailureSite

__all__ = ["EXIT_GPU_LOST", "FATAL_XIDS", "GpuHealth", "GpuState", "exit_gpu_lost", "nvml_handle"]

logger = logging.getLogger(__name__)

# Exit status of a rank whose GPU reported a fatal Xid (EX_IOERR: a device failed);
# the launcher replaces it like any failed rank.
EXIT_GPU_LOST: Final = 74
# Xid errors after which the rank's GPU cannot go on (NVIDIA's Xid catalogue: the
# ones whose immediate action is a GPU reset or a drain): 48 double-bit ECC error,
# 62 internal micro-controller halt, 64 ECC page retirement / row remapping failure,
# 74 NVLink error, 79 fallen off the bus, 94 contained and 95 uncontained ECC error.
# Not 63 (a row remapping recorded) nor 92 (a high single-bit ECC rate): warnings.
FATAL_XIDS: Final = frozenset({48, 62, 64, 74, 79, 94, 95})
# One warning and one event per process when CUDA is here but NVML cannot watch it.
_unavailable_told = False

PERIOD_S: Final = 1.0
_NVML_ERROR_TIMEOUT: Final = 10  # pynvml.NVML_ERROR_TIMEOUT, for an NVML without it
# Throttle reasons that slow the GPU down against the job's will (power caps and
# idle clocks are normal operation).
_SLOWDOWNS: Final = {
    0x8: "hardware slowdown",
    0x20: "software thermal slowdown",
    0x40: "hardware thermal slowdown",
    0x80: "hardware power brake",
}
_XID_EVENT: Final = 0x8  # nvmlEventTypeXidCriticalError


@dataclass(frozen=True, slots=True)
class GpuState:
    """One reading: active slowdown reasons and NVLinks that went inactive."""

    slowdowns: tuple[str, ...] = ()
    nvlinks_down: tuple[int, ...] = ()


def exit_gpu_lost(code: int) -> None:
    """Leave the job at once with :data:`EXIT_GPU_LOST` (the event log flushed first).

    ``os._exit``, as a crashed rank: the script's own clean-up would run collectives on
    a GPU that cannot run them, and the survivors' recovery from a lost rank is the
    proven path.
    """
    events.exit_now(EXIT_GPU_LOST)


def _pci_bus_id(props: Any) -> str | None:
    """NVML's form of the device's PCI address (domain:bus:device.0), or None."""
    bus = getattr(props, "pci_bus_id", None)
    if isinstance(bus, str):
        return bus or None
    device, domain = getattr(props, "pci_device_id", None), getattr(props, "pci_domain_id", 0)
    if not isinstance(bus, int) or not isinstance(device, int):
        return None
    return f"{int(domain or 0):08x}:{bus:02x}:{device:02x}.0"


def _nvml_uuid(props: Any) -> str | None:
    """The device's UUID as NVML spells it (``GPU-...`` or ``MIG-...``), or None."""
    uuid = str(getattr(props, "uuid", "") or "").strip()
    if not uuid:
        return None
    return uuid if uuid.startswith(("GPU-", "MIG-")) else f"GPU-{uuid}"


def nvml_handle(nvml: Any, index: int, props: Any = None) -> tuple[Any, str]:
    """NVML's handle of the CUDA device ``index`` whose torch properties are ``props``,
    and how it was found: ``"uuid"``, ``"pci"`` or ``"index"`` (the CUDA index taken
    as NVML's, right only without CUDA_VISIBLE_DEVICES and with CUDA's PCI order).

    Raises:
        Exception: NVML's own error when not even the index names a GPU.
    """
    tried: list[str] = []
    for how, key, lookup in (
        ("uuid", _nvml_uuid(props), "nvmlDeviceGetHandleByUUID"),
        ("pci", _pci_bus_id(props), "nvmlDeviceGetHandleByPciBusId"),
    ):
        if key is None:
            continue
        try:
            return getattr(nvml, lookup)(key), how
        except Exception as exc:  # an NVML or a torch too old for the key: try the next
            tried.append(f"{how} {key}: {exc}")
    logger.debug(
        "CUDA device %d: no NVML handle by UUID or PCI bus id (%s); using the index, "
        "which is NVML's only without CUDA_VISIBLE_DEVICES",
        index, "; ".join(tried) or "torch gave neither",
    )  # fmt: skip
    return nvml.nvmlDeviceGetHandleByIndex(index), "index"


def _no_source(cuda: bool, rank: int, epoch: int, index: int, why: str) -> None:
    """Say there is no GPU health source: told (a warning, an event) when CUDA is
    there, a debug line when it is not."""
    if cuda:
        _tell_unavailable(rank, epoch, index, why)
    else:
        logger.debug("rank %d (epoch %d): no GPU health source: %s", rank, epoch, why)


def _tell_unavailable(rank: int, epoch: int, index: int, why: str) -> None:
    """CUDA is here but NVML cannot watch it: one warning and one event per process."""
    global _unavailable_told
    if _unavailable_told:
        logger.debug("rank %d (epoch %d): no GPU health for GPU %d: %s", rank, epoch, index, why)
        return
    _unavailable_told = True
    logger.warning(
        "rank %d (epoch %d): CUDA is present but GPU %d has no health source (%s): Xid "
        "errors, throttling and NVLink state go unseen; install nvidia-ml-py for them",
        rank, epoch, index, why,
    )  # fmt: skip
    events.emit(
        "gpu.health_unavailable", epoch=epoch, reason=f"GPU {index}: {why}",
        action="run without GPU health", gpu=index,
    )  # fmt: skip


class GpuHealth:
    """Watches one GPU through NVML; see the module docstring.

    ``index`` is the CUDA device index (for messages); ``handle`` NVML's handle of that
    device (default: NVML's GPU ``index``); ``found_by`` how the handle was found;
    ``on_fatal(xid)`` runs after a fatal Xid was reported (default
    :func:`exit_gpu_lost`).
    """

    def __init__(
        self,
        nvml: Any,
        index: int,
        *,
        rank: int,
        epoch: int = 0,
        handle: Any = None,
        found_by: str = "index",
        on_fatal: Callable[[int], None] | None = None,
    ) -> None:
        self.nvml, self.index, self.rank, self.epoch = nvml, index, rank, epoch
        self.handle = handle if handle is not None else nvml.nvmlDeviceGetHandleByIndex(index)
        self.found_by = found_by
        self.on_fatal = on_fatal if on_fatal is not None else exit_gpu_lost
        self.state = GpuState()
        self.xids: list[int] = []
        self._nvlinks_seen: set[int] = set()
        self._halt = threading.Event()
        self._events: Any = None
        self._thread: threading.Thread | None = None
        # Failed readings are retried every period; these say so when they keep
        # failing (health is then blind) instead of a debug line per period.
        self.poll_failures = FailureSite(
            f"GPU {index} NVML reading", rank=rank, epoch=epoch,
            action=f"reading again every {PERIOD_S} s", log=logger,
        )  # fmt: skip
        self.xid_failures = FailureSite(
            f"GPU {index} NVML Xid wait", rank=rank, epoch=epoch,
            action=f"waiting again after {PERIOD_S} s", log=logger,
        )  # fmt: skip

    @classmethod
    def open(
        cls,
        index: int,
        *,
        rank: int,
        epoch: int = 0,
        nvml: Any = None,
        props: Any = None,
        cuda: bool = False,
        on_fatal: Callable[[int], None] | None = None,
    ) -> GpuHealth | None:
        """A monitor of CUDA device ``index`` (found by ``props``' UUID or PCI bus id,
        see :func:`nvml_handle`), or None when NVML cannot be used here. With ``cuda``
        (CUDA is present) that None is told: one warning and one
        ``gpu.health_unavailable`` event per process; without, a debug line. Never raises.
        """
        try:
            if nvml is None:
                nvml = importlib.import_module("pynvml")
            nvml.nvmlInit()
        except Exception as exc:  # no library, no driver: no source
            _no_source(
                cuda, rank, epoch, index, f"NVML cannot be used: {type(exc).__name__}: {exc}"
            )
            return None
        try:
            handle, how = nvml_handle(nvml, index, props)
            gpu = cls(nvml, index, rank=rank, epoch=epoch, handle=handle, found_by=how,
                      on_fatal=on_fatal)  # fmt: skip
        except Exception as exc:  # NVML has no such GPU
            with contextlib.suppress(Exception):
                nvml.nvmlShutdown()
            _no_source(cuda, rank, epoch, index, f"no NVML handle: {type(exc).__name__}: {exc}")
            return None
        logger.debug("rank %d (epoch %d): watching GPU %d, found in NVML by %s",
                     rank, epoch, index, how)  # fmt: skip
        return gpu

    @classmethod
    def watch_current(cls, *, rank: int, epoch: int = 0, nvml: Any = None) -> GpuHealth | None:
        """A monitor of torch's current CUDA device, or None without CUDA (nothing to
        watch) or without NVML (told once, see :meth:`open`). Never raises."""
        try:
            if not torch.cuda.is_available():
                return None
            index = torch.cuda.current_device()
            props = torch.cuda.get_device_properties(index)
        except Exception as exc:  # a broken CUDA: the first collective will say so
            logger.debug("rank %d (epoch %d): no CUDA device to watch: %s", rank, epoch, exc)
            return None
        return cls.open(index, rank=rank, epoch=epoch, nvml=nvml, props=props, cuda=True)

    def start(self) -> None:
        try:
            self._events = self.nvml.nvmlEventSetCreate()
            self.nvml.nvmlDeviceRegisterEvents(self.handle, _XID_EVENT, self._events)
        except Exception as exc:  # some GPUs and drivers have no events
            logger.debug("rank %d: no NVML Xid events: %s", self.rank, exc)
            self._events = None
        self._thread = threading.Thread(target=self._run, name="gpu-health", daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._halt.set()
        if self._thread is not None:
            self._thread.join(timeout=2 * PERIOD_S + 1)
        try:
            if self._events is not None:
                self.nvml.nvmlEventSetFree(self._events)
            self.nvml.nvmlShutdown()
        except Exception:  # shutting down: nothing left to report to
            logger.debug("rank %d: NVML shutdown failed", self.rank, exc_info=True)

    def _run(self) -> None:
        while not self._halt.is_set():
            if self._events is None:
                self._halt.wait(PERIOD_S)
            else:
                self._wait_xid()
            try:
                self.poll()
            except Exception as exc:  # a failed read is retried next period
                self.poll_failures.failed(exc, epoch=self.epoch)
                continue
            self.poll_failures.succeeded()

    def _wait_xid(self) -> None:
        """Wait up to PERIOD_S for an Xid error (the period of the other readings)."""
        try:
            data = self.nvml.nvmlEventSetWait_v2(self._events, int(PERIOD_S * 1000))
        except Exception as exc:
            if not self._timed_out(exc):
                # A wait that fails at once (not NVML's timeout) would make this
                # loop spin: keep the period instead.
                self.xid_failures.failed(exc, epoch=self.epoch)
                self._halt.wait(PERIOD_S)
                return
        else:
            self.xid(int(getattr(data, "eventData", 0)))
        self.xid_failures.succeeded()

    def _timed_out(self, exc: Exception) -> bool:
        """Whether ``exc`` is NVML's timeout: no Xid error this period."""
        timeout = getattr(self.nvml, "NVMLError_Timeout", None)
        if isinstance(timeout, type) and isinstance(exc, timeout):
            return True
        code = getattr(self.nvml, "NVML_ERROR_TIMEOUT", _NVML_ERROR_TIMEOUT)
        return getattr(exc, "value", None) == code

    def xid(self, code: int) -> None:
        """Record and report Xid error ``code``; a fatal one (:data:`FATAL_XIDS`) then
        runs ``on_fatal(code)`` (by default the rank exits with :data:`EXIT_GPU_LOST`)."""
        self.xids.append(code)
        fatal = code in FATAL_XIDS
        if not fatal:
            logger.warning("rank %d (epoch %d): GPU %d Xid error %d", self.rank, self.epoch,
                           self.index, code)  # fmt: skip
            events.emit("gpu.error", epoch=self.epoch, reason=f"GPU {self.index}: Xid {code}",
                        action="reported", gpu=self.index, xid=code)  # fmt: skip
            return
        logger.error(
            "rank %d (epoch %d): GPU %d fatal Xid error %d: this rank cannot go on; it "
            "leaves the job (exit code %d) so that a replacement takes its place",
            self.rank, self.epoch, self.index, code, EXIT_GPU_LOST,
        )  # fmt: skip
        events.emit(
            "gpu.error", epoch=self.epoch, reason=f"GPU {self.index}: fatal Xid {code}",
            action=f"rank lost: exit with code {EXIT_GPU_LOST}; the launcher replaces it",
            gpu=self.index, xid=code, fatal=True,
        )  # fmt: skip
        self.on_fatal(code)

    def read(self) -> GpuState:
        """Read the throttle reasons and the NVLinks' state now."""
        mask = int(self.nvml.nvmlDeviceGetCurrentClocksThrottleReasons(self.handle))
        slowdowns = tuple(name for bit, name in _SLOWDOWNS.items() if mask & bit)
        down = []
        for link in range(int(getattr(self.nvml, "NVML_NVLINK_MAX_LINKS", 18))):
            try:
                active = self.nvml.nvmlDeviceGetNvLinkState(self.handle, link) == 1
            except Exception:  # no such link on this GPU
                continue
            if active:
                self._nvlinks_seen.add(link)
            elif link in self._nvlinks_seen:
                down.append(link)  # only links seen active can go down
        return GpuState(slowdowns=slowdowns, nvlinks_down=tuple(down))

    def poll(self) -> GpuState:
        """Read, report what changed since the last reading, and return the reading."""
        new, old = self.read(), self.state
        self.state = new
        worse = [
            *(s for s in new.slowdowns if s not in old.slowdowns),
            *(f"NVLink {n} inactive" for n in new.nvlinks_down if n not in old.nvlinks_down),
        ]
        better = [
            *(s for s in old.slowdowns if s not in new.slowdowns),
            *(f"NVLink {n} active" for n in old.nvlinks_down if n not in new.nvlinks_down),
        ]
        for kind, what in (("gpu.degraded", worse), ("gpu.recovered", better)):
            if what:
                logger.warning("rank %d (epoch %d): GPU %d %s: %s", self.rank, self.epoch,
                               self.index, kind, ", ".join(what))  # fmt: skip
                events.emit(kind, epoch=self.epoch, reason=f"GPU {self.index}: {', '.join(what)}",
                            action="reported", gpu=self.index)  # fmt: skip
        return new
