"""The rate limits of ``benchmarks/allreduce.py --rail-rate-mbit`` (``_common.TcShaper``):
its qdisc is ours by handle and owner record, goes on remove() and on SIGTERM, a
killed run's qdisc is removed by the next run, and a qdisc someone else put on the
device is never replaced.

On a test veth of the root namespace, not on ``lo``: the machine is shared.
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from chaos.cleanup import owner_dir
from tests.chaos import _kernel, _net

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))

from _common import TcShaper

pytestmark = pytest.mark.timeout(60)

REPO = Path(__file__).resolve().parents[2]
RATES = {"127.0.1.1": 100.0, "127.0.1.2": 50.0}


@pytest.fixture
def dev() -> Iterator[str]:
    objs = _kernel.Objects()
    try:
        yield objs.veth(f"{objs.tag}s")
    finally:
        objs.close()
        (owner_dir() / f"qdisc-{objs.tag}s.json").unlink(missing_ok=True)


def _record(dev: str) -> Path:
    return owner_dir() / f"qdisc-{dev}.json"


@_net.requires_root
def test_install_and_remove_leave_the_device_as_it_was(dev: str) -> None:
    shaper = TcShaper(dev)
    try:
        shaper.install(RATES)
        assert _kernel.ours(dev)
        assert json.loads(_record(dev).read_text())["pid"] > 0
    finally:
        shaper.remove()
    assert not _kernel.ours(dev) and not _record(dev).exists()
    shaper.remove()  # a second remove() is harmless


@_net.requires_root
def test_a_foreign_qdisc_is_neither_replaced_nor_deleted(dev: str) -> None:
    _kernel.add_qdisc(dev, "1:")
    shaper = TcShaper(dev)
    with pytest.raises(SystemExit, match="someone else"):
        shaper.install(RATES)
    shaper.remove()
    assert _kernel.root_qdisc(dev) == "htb 1:" and not _record(dev).exists()


# Shapes the device, says so, and waits for a signal.
_SHAPE_AND_WAIT = """
import sys, time
sys.path.insert(0, "benchmarks")
from _common import TcShaper
shaper = TcShaper(sys.argv[1])
shaper.remove_on_exit()
shaper.install({"127.0.1.1": 100.0})
print("shaped", flush=True)
time.sleep(60)
"""


def _shape_in_child(dev: str) -> subprocess.Popen[str]:
    child = subprocess.Popen(
        [sys.executable, "-c", _SHAPE_AND_WAIT, dev], cwd=REPO, stdout=subprocess.PIPE, text=True
    )
    assert _net.read_line(child, 30.0) == "shaped"
    assert _kernel.ours(dev)
    return child


@_net.requires_root
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP])
def test_a_signal_removes_the_qdisc(dev: str, sig: signal.Signals) -> None:
    child = _shape_in_child(dev)
    try:
        child.send_signal(sig)
        assert child.wait(30.0) == 128 + sig
        assert not _kernel.ours(dev) and not _record(dev).exists()
    finally:
        _net.sigkill(child)
        assert child.stdout is not None
        child.stdout.close()


@_net.requires_root
def test_a_killed_runs_qdisc_is_removed_by_the_next_run(dev: str) -> None:
    child = _shape_in_child(dev)
    _net.sigkill(child)
    assert child.stdout is not None
    child.stdout.close()
    assert _kernel.ours(dev) and _record(dev).exists()  # left behind ...
    shaper = TcShaper(dev)
    try:
        shaper.install(RATES)  # ... until the next run sweeps it and shapes anew
        assert json.loads(_record(dev).read_text())["pid"] != child.pid
    finally:
        shaper.remove()
    assert not _kernel.ours(dev)
