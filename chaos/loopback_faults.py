"""Network faults on the loopback testbed: records for the ranks' in-process fault hook.

Without namespaces there is no NIC to take down, so each network fault becomes a
record under the job's ``chaos-faults/`` prefix in etcd that every rank applies
to its own links (see :mod:`resilient.links.fault_hook`): a NIC down or a partition fails
the matching links, a throttle stretches ops to the given rate, a drop delays
some ops by a TCP retransmission timeout. The effect is emulated, not real: the
report says which testbed ran.
"""

from __future__ import annotations

from typing import Any, Final

from chaos.injectors import Flap, InjectionContext, Injector
from chaos.scenario import Fault
from resilient.errors import ChaosError

__all__ = ["LOOPBACK_KINDS"]


class _Record(Injector):
    """Puts one record on start and deletes it on stop."""

    def __init__(self, fault: Fault, ctx: InjectionContext) -> None:
        super().__init__(fault, ctx)
        self.fault_id = f"{fault.kind}-r{fault.param('rank')}-rail{fault.param('rail')}"

    def _write(self, record: dict[str, Any] | None, fault_id: str | None = None) -> None:
        if self.ctx.control is None:
            raise ChaosError(f"{self.description}: this run has no fault control")
        self.ctx.control(fault_id or self.fault_id, record)

    def _check(self) -> None:
        n_hosts, n_rails = len(self.ctx.testbed.hosts), self.ctx.testbed.n_rails
        self._index("rank", n_hosts, "host(s) up")
        self._index("rail", n_rails, "rail(s)")

    def record(self) -> dict[str, Any]:
        raise NotImplementedError

    def _start(self) -> None:
        self._write(self.record())

    def _stop(self) -> None:
        self._write(None)


def _base(fault: Fault, kind: str) -> dict[str, Any]:
    return {"kind": kind, "rank": int(fault.param("rank")), "rail": int(fault.param("rail"))}


class _NicDownRecord(_Record):
    def __init__(self, fault: Fault, ctx: InjectionContext) -> None:
        super().__init__(fault, ctx)
        # The id nic-up deletes: the two are one NIC.
        self.fault_id = f"nic-r{fault.param('rank')}-rail{fault.param('rail')}"

    def record(self) -> dict[str, Any]:
        return _base(self.fault, "fail")


class _NicUpRecord(_NicDownRecord):
    def _start(self) -> None:
        self._write(None)
        self.active = False


class _ThrottleRecord(_Record):
    def record(self) -> dict[str, Any]:
        rate = float(self.fault.param("rate_mbit"))
        if rate <= 0:
            raise ChaosError("throttle: rate_mbit must be > 0")
        return {**_base(self.fault, "throttle"), "rate_mbit": rate}


class _DropRecord(_Record):
    def record(self) -> dict[str, Any]:
        return {**_base(self.fault, "drop"), "percent": float(self.fault.param("percent"))}


class _PartitionRecord(_Record):
    def _check(self) -> None:
        super()._check()
        self._index("peer", len(self.ctx.testbed.hosts), "host(s) up")
        if self.fault.param("peer") == self.fault.param("rank"):
            raise ChaosError(f"{self.description}: peer must differ from rank")

    def record(self) -> dict[str, Any]:
        return {**_base(self.fault, "fail"), "peer": int(self.fault.param("peer"))}


class _FlapRecord(Flap):
    """Puts and deletes a link-fail record instead of taking a NIC down."""

    def __init__(self, fault: Fault, ctx: InjectionContext) -> None:
        super().__init__(fault, ctx)
        self._rec = _NicDownRecord(fault, ctx)

    def _check(self) -> None:
        self._rec._check()
        if float(self.fault.param("period_s")) <= 0:
            raise ChaosError("flap: period_s must be > 0")

    def _set(self, *, up: bool) -> None:
        self._rec._write(None if up else self._rec.record())


LOOPBACK_KINDS: Final[dict[str, type[Injector]]] = {
    "nic-down": _NicDownRecord,
    "nic-up": _NicUpRecord,
    "flap": _FlapRecord,
    "throttle": _ThrottleRecord,
    "drop": _DropRecord,
    "partition": _PartitionRecord,
}
