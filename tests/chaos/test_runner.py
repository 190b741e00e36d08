"""The fault controller's hold for warm spares and the time it dates a slow-cpu
fault from, as pure logic (the launcher, the display, the cgroup and the clock are
stand-ins; tests/integration/test_chaos_cli.py runs it for real), and the
fault-free reference's cache key on a stand-in source tree."""

from __future__ import annotations

import os
import sys
from dataclasses import dataclass, field
from pathlib import Path
from types import SimpleNamespace
from typing import Any, cast

import pytest

from chaos import injectors
from chaos.injectors import InjectionContext
from chaos.reference_key import reference_key, torch_version
from chaos.runner import _Controller
from chaos.scenario import Fault, Scenario, parse
from chaos.testbed import LoopbackTestbed


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


class _Quota:
    """A CpuQuota stand-in: moving a process in takes 10 ms of the fake clock."""

    def __init__(self, clock: list[float], capped_at: list[float]) -> None:
        self.clock, self.capped_at, self.cpus = clock, capped_at, 0.5

    def add(self, pid: int) -> bool:
        self.clock[0] += 0.01
        self.capped_at.append(self.clock[0])
        return True

    def pids(self) -> list[int]:
        return []

    def remove(self) -> None:
        return None


@pytest.mark.timeout(10)
def test_a_slow_cpu_fault_fired_when_the_quota_was_in_force_not_before_measuring(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Detection times count from ``fired_s``: it is when the rank was moved under
    the quota, not when the controller began the 0.2 s measurement of its CPUs; and
    ``fired_step`` is the rank's step then."""
    clock: list[float] = [1000.0]
    capped_at: list[float] = []
    emitted: list[dict[str, Any]] = []

    def measure(pid: int) -> float:
        clock[0] += 0.2
        return 1.0

    monkeypatch.setattr(injectors, "measure_cpus", measure)
    monkeypatch.setattr(injectors, "CpuQuota", lambda what, cpus: _Quota(clock, capped_at))
    monkeypatch.setattr(injectors, "cpu_root", lambda: (Path("/nonexistent"), 2))
    # raising=False: an injectors module without its own clock fails on the dates below
    clock_ns = SimpleNamespace(time=lambda: clock[0])
    monkeypatch.setattr(injectors, "time", clock_ns, raising=False)
    fault = Fault(kind="slow-cpu", at_step=5, params={"rank": 0, "factor": 0.5, "pin": True})
    ctx = InjectionContext(testbed=LoopbackTestbed(1, 1).up(), pid_of=lambda rank: os.getpgrp())
    ctl = _Controller(
        (fault,), ctx, cast(Any, _Launcher(warming=set())),
        # A step every 0.1 s: the rank is two steps further once it was measured.
        cast(Any, SimpleNamespace(step_of=lambda rank: 5 + int((clock[0] - 1000.0) / 0.1))),
        cast(Any, SimpleNamespace(fault=lambda rec, what: None)), timeout_s=60.0,
        events=cast(Any, SimpleNamespace(emit=lambda kind, **kw: emitted.append(kw))),
    )  # fmt: skip
    ctl.t0 = 1000.0
    monkeypatch.setattr(ctl, "_now", lambda: clock[0] - ctl.t0)
    rec = ctl.records[0]
    ctl._fire(rec, fault)
    try:
        (capped,) = capped_at
        assert rec.error is None and capped > 1000.2  # measured first, then capped
        assert rec.fired_s == pytest.approx(capped - 1000.0)
        assert emitted[0]["ts"] == pytest.approx(capped)  # fault.injected: the same
        assert rec.fired_step == 7  # detect_steps count from the capped rank's step
    finally:
        ctl._injectors[0].stop()  # type: ignore[union-attr]


def _tree(root: Path) -> None:
    """A stand-in source tree: one module per code package and a built extension."""
    for pkg in ("resilient/links", "membership", "recovery"):
        (root / pkg).mkdir(parents=True)
        (root / pkg / "__init__.py").write_text(f"# {pkg}\n")
    (root / "resilient/links/_stepio.cpython-311-x86_64-linux-gnu.so").write_bytes(b"\x7fELF1")
    (root / "train.py").write_text("print('train')\n")


_BODY = """
[job]
script = "train.py"
nproc = 4
rails = 2
steps = 100
[[fault]]
kind = "kill"
rank = 1
at_step = 10
[expect]
params_equal_fault_free = true
"""


@pytest.mark.timeout(10)
def test_the_reference_key_changes_with_the_extension_torch_and_the_job(tmp_path: Path) -> None:
    _tree(tmp_path)
    script = str(tmp_path / "train.py")
    base = parse(_BODY)

    def key(scenario: Scenario = base, torch: str = "2.5.1+cpu") -> str:
        args = ("--steps", str(scenario.job.steps), "--seed", str(scenario.job.seed))
        return reference_key(scenario, script, args, root=tmp_path, torch=torch)

    first = key()
    assert key() == first  # stable
    assert key(torch="2.6.0+cpu") != first
    assert key(parse(_BODY.replace("rails = 2", "rails = 1"))) != first
    assert key(parse(_BODY.replace("steps = 100", "steps = 101"))) != first
    assert key(parse(_BODY.replace('script = "train.py"', 'script = "t.py"'))) != first
    # What the fault-free run never sees leaves the key as it is.
    assert key(parse(_BODY.replace("at_step = 10", "at_step = 20"))) == first
    assert key(parse(_BODY.replace("[job]", "[job]\nwarm_spares = true"))) == first
    so = tmp_path / "resilient/links/_stepio.cpython-311-x86_64-linux-gnu.so"
    so.write_bytes(b"\x7fELF2")
    rebuilt = key()
    assert rebuilt != first
    so.unlink()  # not built: a key of its own too
    assert key() not in (first, rebuilt)
    (tmp_path / "recovery/__init__.py").write_text("# changed\n")
    (tmp_path / "train.py").write_text("print('changed')\n")
    assert len({first, rebuilt, key()}) == 3


@pytest.mark.timeout(10)
def test_the_reference_key_reads_torch_version_without_importing_torch() -> None:
    imported = "torch" in sys.modules
    version = torch_version()
    assert imported or "torch" not in sys.modules  # read from its metadata
    assert version == "absent" or version[0].isdigit()
