"""Network faults on the loopback testbed become fault-hook records (no root needed)."""

from __future__ import annotations

import json
import time
from collections.abc import Mapping
from typing import Any

import pytest

from chaos.injector_kinds import make_injector
from chaos.injectors import InjectionContext
from chaos.scenario import Fault
from chaos.testbed import LoopbackTestbed
from resilient.errors import ChaosError
from resilient.links.fault_hook import LinkFault


def _ctx(log: list[tuple[str, dict[str, Any] | None]]) -> InjectionContext:
    def control(fault_id: str, record: Mapping[str, Any] | None) -> None:
        log.append((fault_id, None if record is None else dict(record)))

    return InjectionContext(testbed=LoopbackTestbed(3, 2).up(), pid_of=lambda r: 0, control=control)


@pytest.mark.timeout(10)
def test_nic_down_then_up_writes_and_removes_one_record() -> None:
    log: list[tuple[str, dict[str, Any] | None]] = []
    down = make_injector(Fault(kind="nic-down", at_s=0.0, params={"rank": 1, "rail": 1}), _ctx(log))
    down.start()
    up = make_injector(Fault(kind="nic-up", at_s=0.0, params={"rank": 1, "rail": 1}), _ctx(log))
    up.start()
    (fid, rec), (fid2, rec2) = log
    assert fid == fid2 and rec2 is None  # nic-up clears what nic-down set
    assert rec is not None and LinkFault.from_json(json.dumps(rec)).affects(0, 1, 1)


@pytest.mark.timeout(10)
def test_partition_and_throttle_records_carry_their_parameters() -> None:
    log: list[tuple[str, dict[str, Any] | None]] = []
    ctx = _ctx(log)
    part = {"rank": 0, "peer": 2, "rail": 0}
    make_injector(Fault(kind="partition", at_s=0.0, params=part), ctx).start()
    slow = {"rank": 2, "rail": 1, "rate_mbit": 50.0}
    make_injector(Fault(kind="throttle", at_s=0.0, params=slow), ctx).start()
    assert log[0][1] == {"kind": "fail", "rank": 0, "rail": 0, "peer": 2}
    assert log[1][1] == {"kind": "throttle", "rank": 2, "rail": 1, "rate_mbit": 50.0}
    bad = {"rank": 0, "rail": 5, "percent": 1.0}  # rail 5 does not exist
    with pytest.raises(ChaosError):
        make_injector(Fault(kind="drop", at_s=0.0, params=bad), ctx).start()


@pytest.mark.timeout(10)
def test_flap_alternates_records_and_ends_up() -> None:
    log: list[tuple[str, dict[str, Any] | None]] = []
    flap = make_injector(
        Fault(kind="flap", at_s=0.0, params={"rank": 1, "rail": 0, "period_s": 0.04, "count": 3}),
        _ctx(log),
    )
    flap.start()
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline and len(log) < 6:
        time.sleep(0.01)
    flap.stop()
    states = [rec is None for _, rec in log]
    assert states[:6] == [False, True] * 3 and states[-1] is True
    assert flap.flaps == 3
