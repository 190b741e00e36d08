"""GPU health from NVML: one more health source beside the NICs and the links.

What NVML can tell before a collective fails or slows down:

* **Xid errors** (``nvmlEventTypeXidCriticalError``): the driver's report of a
  GPU fault (ECC, fallen off the bus, a kernel that faulted);
* **throttling** (``nvmlDeviceGetCurrentClocksThrottleReasons``): hardware or
  thermal slowdowns and the power brake, which make this rank a compute straggler;
* **NVLink** state per link (``nvmlDeviceGetNvLinkState``): a link that was active
  and is not any more.

Each change becomes an event (``gpu.error``, ``gpu.degraded``, ``gpu.recovered``)
and a warning. Where NVML is absent (no driver, no GPU, as on CPU-only hosts)
:meth:`GpuHealth.open` returns None: there is simply no GPU source. A poll that
fails is logged at debug level and retried next period; it never raises into the
training process.
"""

from __future__ import annotations

import importlib
import logging
import threading
from dataclasses import dataclass
from typing import Any, Final

from resilient import events
from resilient.failures import FailureSite

__all__ = ["GpuHealth", "GpuState"]

logger = logging.getLogger(__name__)

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


class GpuHealth:
    """Watches one GPU through NVML; see the module docstring."""

    def __init__(self, nvml: Any, index: int, *, rank: int, epoch: int = 0) -> None:
        self.nvml, self.index, self.rank, self.epoch = nvml, index, rank, epoch
        self.handle = nvml.nvmlDeviceGetHandleByIndex(index)
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
    def open(cls, index: int, *, rank: int, epoch: int = 0, nvml: Any = None) -> GpuHealth | None:
        """A monitor of GPU ``index``, or None when NVML cannot be used here."""
        try:
            if nvml is None:
                nvml = importlib.import_module("pynvml")
            nvml.nvmlInit()
            return cls(nvml, index, rank=rank, epoch=epoch)
        except Exception as exc:  # no library, no driver, no such GPU: no source
            logger.debug("rank %d (epoch %d): no GPU health source: %s", rank, epoch, exc)
            return None

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
        """Record and report Xid error ``code``."""
        self.xids.append(code)
        logger.warning("rank %d (epoch %d): GPU %d Xid error %d", self.rank, self.epoch,
                       self.index, code)  # fmt: skip
        events.emit("gpu.error", epoch=self.epoch, reason=f"GPU {self.index}: Xid {code}",
                    action="reported", gpu=self.index, xid=code)  # fmt: skip

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
