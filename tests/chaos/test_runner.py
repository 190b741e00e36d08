"""The fault controller's hold for warm spares, as pure logic (the launcher and the
display are stand-ins; tests/integration/test_chaos_cli.py runs it for real)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, cast

import pytest

from chaos.runner import _Controller
from chaos.scenario import Fault


@dataclass
class _Launcher:
    warming: set[int]
    config: Any = field(default_factory=lambda: type("Cfg", (), {"nproc": 3})())

    def spare_warming(self, rank: int) -> bool:
        return rank in self.warming


class _Display:
    def __init__(self) -> None:
        self.notices: list[str] = []

    def notice(self, message: str) -> None:
        self.notices.append(message)


def _controller(faults: tuple[Fault, ...], launcher: _Launcher) -> tuple[_Controller, _Display]:
    display = _Display()
    ctl = _Controller(
        faults, cast(Any, None), cast(Any, launcher), cast(Any, None), cast(Any, display),
        timeout_s=60.0, events=cast(Any, None),
    )  # fmt: skip
    return ctl, display


@pytest.mark.timeout(10)
def test_no_fault_fires_before_every_first_spare_stands_ready() -> None:
    nic = Fault(kind="nic-down", at_step=5, params={"rank": 1, "rail": 0})
    launcher = _Launcher(warming={2})
    ctl, display = _controller((nic,), launcher)
    rec = ctl.records[0]
    assert ctl._held(rec, nic) is True
    assert ctl._held(rec, nic) is True
    assert display.notices == [
        "nic-down is due; it waits for the warm spares of ranks [2] to stand ready"
    ]
    launcher.warming.clear()
    assert ctl._held(rec, nic) is False
    assert rec.detail["held_for_spare_s"] >= 0 and "spare" not in rec.detail


@pytest.mark.timeout(10)
def test_after_the_first_spares_only_a_kill_waits_and_only_for_its_own_rank() -> None:
    kill1 = Fault(kind="kill", at_step=50, params={"rank": 1})
    kill2 = Fault(kind="kill", at_step=60, params={"rank": 2})
    nic = Fault(kind="nic-down", at_step=70, params={"rank": 1, "rail": 0})
    launcher = _Launcher(warming=set())
    ctl, _ = _controller((kill1, kill2, nic), launcher)
    assert ctl._held(ctl.records[0], kill1) is False  # all spares were ready: the gate opens
    launcher.warming.add(1)  # rank 1's next spare warms up after its takeover
    assert ctl._held(ctl.records[1], kill2) is False
    assert ctl._held(ctl.records[2], nic) is False
    assert ctl._held(ctl.records[0], kill1) is True


@pytest.mark.timeout(10)
def test_a_spare_that_never_stands_ready_holds_a_fault_only_so_long(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    kill = Fault(kind="kill", at_step=5, params={"rank": 0})
    ctl, _ = _controller((kill,), _Launcher(warming={0}))
    clock = [10.0]
    monkeypatch.setattr(ctl, "_now", lambda: clock[0])
    assert ctl._held(ctl.records[0], kill) is True
    clock[0] += 121.0
    assert ctl._held(ctl.records[0], kill) is False
    assert ctl.records[0].detail == {"held_for_spare_s": 121.0, "spare": "not ready"}
