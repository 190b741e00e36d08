"""Run PyTorch's own distributed test suite on a backend, as every c10d backend does.

    python tools/torch_suite.py --backend resilient --world-size 2
    python tools/torch_suite.py --backend gloo --world-size 2 --json-out gloo.json
    python tools/torch_suite.py --backend resilient -k test_all_reduce_sum -k test_send_recv

The suite is ``torch.testing._internal.distributed.distributed_test`` (needs the
``expecttest`` package): each test spawns ``--world-size`` processes that call
``init_process_group(backend=...)`` on a file store and run one scenario
(collectives on the world group and on subgroups, p2p, object collectives, DDP ...).
It reads BACKEND, WORLD_SIZE and TEMP_DIR from the environment at import, so this
script sets them before importing it.

``-k SUBSTRING`` (repeatable) keeps the tests whose name contains one of them,
``--exclude SUBSTRING`` drops them, ``--name NAME`` keeps exactly the tests named;
``--compare-json FILE`` (the ``--json-out`` of another backend's run) lists the
tests that passed there and did not pass here. Prints one line per test, a count,
then one JSON line (passed, failed, errors, skipped by reason).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import unittest
from collections import Counter
from typing import Any

_MARK = "RESILIENT_TORCH_SUITE_RANK"
_AS = "RESILIENT_TORCH_SUITE_AS_GLOO"


def _swap_gloo(backend: str) -> None:
    """Make every group the suite asks of gloo a ``backend`` one: many tests run only
    for backends the suite names (gloo, nccl, ucc), though they use nothing of gloo's."""
    import functools

    import torch.distributed as dist
    import torch.distributed.distributed_c10d as c10d

    def swapped(fn: Any, position: int) -> Any:
        @functools.wraps(fn)
        def call(*args: Any, **kwargs: Any) -> Any:
            if len(args) > position and str(args[position]).lower() == "gloo":
                args = (*args[:position], backend, *args[position + 1 :])
            if str(kwargs.get("backend", "")).lower() == "gloo":
                kwargs["backend"] = backend
            return fn(*args, **kwargs)

        return call

    for name, position in (("init_process_group", 0), ("new_group", 2), ("new_subgroups", 3)):
        wrapped = swapped(getattr(c10d, name), position)
        setattr(c10d, name, wrapped)
        setattr(dist, name, wrapped)
    init = c10d.init_process_group

    @functools.wraps(init)
    def checked_init(*args: Any, **kwargs: Any) -> Any:
        out = init(*args, **kwargs)
        if c10d.get_backend() != backend:  # the swap must hold, or the run proves nothing
            raise RuntimeError(f"--as-gloo: the world group is {c10d.get_backend()}")
        return out

    c10d.init_process_group = dist.init_process_group = checked_init


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", default="resilient", help="backend name (default resilient)")
    p.add_argument("--world-size", type=int, default=2, help="processes per test (default 2)")
    p.add_argument("-k", dest="keep", action="append", default=[], help="name substring")
    p.add_argument("--exclude", action="append", default=[], help="drop names with this")
    p.add_argument("--name", action="append", default=[], help="keep this exact test name")
    p.add_argument("--json-out", default=None, help="write every test's outcome here")
    p.add_argument("--compare-json", default=None, help="another run's --json-out")
    p.add_argument("--list", action="store_true", help="list the selected tests, run nothing")
    p.add_argument(
        "--as-gloo",
        action="store_true",
        help="tell the suite the backend is gloo (its gloo-only tests then run) while every "
        "group it makes is a --backend one",
    )
    args = p.parse_args(argv)
    if args.world_size < 2:
        p.error("--world-size must be at least 2")
    return args


class _Outcomes(unittest.TextTestResult):
    """Records each test's outcome (and a skip's reason) by test name."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.outcomes: dict[str, tuple[str, str]] = {}
        self._started = 0.0

    def startTest(self, test: unittest.TestCase) -> None:
        self._started = time.monotonic()
        super().startTest(test)

    def _record(self, test: unittest.TestCase, outcome: str, detail: str = "") -> None:
        name = test.id().rsplit(".", 1)[-1]
        self.outcomes[name] = (outcome, detail)
        took = time.monotonic() - self._started
        print(f"{outcome:7s} {name} ({took:.1f} s) {detail[:160]}", flush=True)

    def addSuccess(self, test: unittest.TestCase) -> None:
        super().addSuccess(test)
        self._record(test, "pass")

    def addFailure(self, test: unittest.TestCase, err: Any) -> None:
        super().addFailure(test, err)
        self._record(test, "fail", _last_line(self.failures[-1][1]))

    def addError(self, test: unittest.TestCase, err: Any) -> None:
        super().addError(test, err)
        self._record(test, "error", _last_line(self.errors[-1][1]))

    def addSkip(self, test: unittest.TestCase, reason: str) -> None:
        super().addSkip(test, reason)
        self._record(test, "skip", reason)


def _last_line(tb: str) -> str:
    """The line that names the error (torch's spawn wrapper adds repro hints after it)."""
    lines = [line.strip() for line in tb.strip().splitlines() if line.strip()]
    named = [line for line in lines if "Error" in line.split(":")[0] or "Exception" in line]
    return (named or lines or [""])[-1]


def known_skip(test: Any, world_size: int | None = None, backend: str | None = None) -> str:
    """Why a test's ranks would skip here before they run anything ("" when they would
    not): torch's ``skip_if_lt_x_gpu(x)`` and ``skip_if_no_gpu`` (GPUs missing),
    ``skip_if_small_worldsize`` (fewer than 8 ranks) and ``skip_if_odd_worldsize``
    decorators, read from the test's chain of wrappers. A spawned rank would only
    import the suite and exit with that skip (tens of seconds a test on a loaded host);
    the runner records it unspawned, with the decorator's message and " (not spawned)".
    ``world_size`` and ``backend`` default to the WORLD_SIZE and BACKEND the ranks see."""
    import torch
    from torch.testing._internal import common_utils
    from torch.testing._internal.common_distributed import TEST_SKIPS

    # HPU and XPU devices are counted by their own APIs: left to the ranks.
    accelerators = common_utils.TEST_HPU or common_utils.TEST_XPU
    devices = torch.cuda.device_count() if common_utils.TEST_CUDA else 0
    if world_size is None:
        world_size = int(os.environ.get("WORLD_SIZE", "2"))
    if backend is None:
        backend = os.environ.get("BACKEND", "")
    fn = test
    while fn is not None:
        code = getattr(fn, "__code__", None)
        qualname = getattr(code, "co_qualname", "")
        cells = dict(zip(getattr(code, "co_freevars", ()), fn.__closure__ or (), strict=True))
        needs = None
        if qualname == "skip_if_lt_x_gpu.<locals>.decorator.<locals>.wrapper" and not accelerators:
            x = cells["x"].cell_contents
            allow_cpu = "allow_cpu" in cells and cells["allow_cpu"].cell_contents
            if devices < x and not (allow_cpu and devices == 0):
                needs = f"multi-gpu-{x}"
        elif qualname == "skip_if_no_gpu.<locals>.wrapper" and not accelerators:
            needs = "no_cuda" if devices == 0 else None
            if devices and devices < world_size:
                needs = f"multi-gpu-{world_size}"
        elif qualname == "skip_if_small_worldsize.<locals>.wrapper":
            needs = "small_worldsize" if backend != "mpi" and world_size < 8 else None
        elif qualname == "skip_if_odd_worldsize.<locals>.wrapper":
            needs = "odd_worldsize" if backend != "mpi" and world_size % 2 == 1 else None
        if needs is not None:
            return f"{TEST_SKIPS[needs].message} (not spawned)"
        fn = getattr(fn, "__wrapped__", None)
    return ""


def _suite_class() -> type[unittest.TestCase]:
    """The spawn-based test class, as torch's test_distributed_spawn.py builds it."""
    from torch.testing._internal.distributed.distributed_test import (
        DistributedTest,
        TestDistBackend,
    )

    class TestDistBackendWithSpawn(TestDistBackend, DistributedTest._DistTestBase):  # type: ignore[misc,name-defined]
        def setUp(self) -> None:
            # Spawned ranks would only exit with this skip: say it without them.
            known = known_skip(getattr(type(self), self._testMethodName))
            if known:
                self.skipTest(known)
            super().setUp()  # type: ignore[no-untyped-call]
            self._spawn_processes()

    # Spawned ranks unpickle the class by its module and name: the module defines it
    # at import there too (see the end of this file).
    TestDistBackendWithSpawn.__qualname__ = "TestDistBackendWithSpawn"
    TestDistBackendWithSpawn.__module__ = __name__
    globals()["TestDistBackendWithSpawn"] = TestDistBackendWithSpawn
    return TestDistBackendWithSpawn


def _selected(cls: type[unittest.TestCase], args: argparse.Namespace) -> list[str]:
    names = unittest.TestLoader().getTestCaseNames(cls)
    if args.name:
        unknown = sorted(set(args.name) - set(names))
        if unknown:
            raise SystemExit(f"no such test in the suite: {', '.join(unknown)}")
        return [n for n in names if n in args.name]
    keep, exclude = args.keep, args.exclude
    return [
        n
        for n in names
        if (not keep or any(k in n for k in keep)) and not any(x in n for x in exclude)
    ]


def _report(outcomes: dict[str, tuple[str, str]], args: argparse.Namespace) -> dict[str, Any]:
    counts = Counter(o for o, _ in outcomes.values())
    skipped = Counter(d.split(".")[0][:80] for o, d in outcomes.values() if o == "skip")
    summary: dict[str, Any] = {
        "suite": "torch distributed_test",
        "backend": args.backend,
        "as_gloo": args.as_gloo,
        "world_size": args.world_size,
        "tests": len(outcomes),
        "passed": counts["pass"],
        "failed": counts["fail"],
        "errors": counts["error"],
        "skipped": counts["skip"],
        "skip_reasons": dict(skipped.most_common()),
        "not_passed": sorted(n for n, (o, _) in outcomes.items() if o in ("fail", "error")),
    }
    if args.compare_json:
        with open(args.compare_json) as f:
            other = json.load(f)["outcomes"]
        summary["passed_there_not_here"] = sorted(
            n for n, (o, _) in other.items() if o == "pass" and outcomes.get(n, ("",))[0] != "pass"
        )
    return summary


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    os.environ["BACKEND"] = "gloo" if args.as_gloo else args.backend
    if args.as_gloo:
        os.environ[_AS] = args.backend
    os.environ["WORLD_SIZE"] = str(args.world_size)
    if "TEMP_DIR" in os.environ:  # the caller's, kept
        return _run(args)
    # The suite's file stores and barrier files; the ranks inherit TEMP_DIR.
    with tempfile.TemporaryDirectory(prefix="torch-suite-") as temp:
        os.environ["TEMP_DIR"] = temp
        return _run(args)


def _run(args: argparse.Namespace) -> int:
    os.environ[_MARK] = "1"
    cls = _suite_class()
    names = _selected(cls, args)
    if args.list:
        print("\n".join(names))
        return 0
    suite = unittest.TestSuite(cls(n) for n in names)
    runner = unittest.TextTestRunner(resultclass=_Outcomes, verbosity=0, stream=sys.stderr)
    result = runner.run(suite)
    assert isinstance(result, _Outcomes)
    summary = _report(result.outcomes, args)
    if args.json_out:
        with open(args.json_out, "w") as f:
            json.dump({**summary, "outcomes": result.outcomes}, f, indent=1)
    print(json.dumps(summary))
    return 0 if not summary["not_passed"] else 1


if __name__ == "__main__":
    sys.exit(main())
elif os.environ.get(_MARK):  # a rank spawned by a test of main()'s run
    if os.environ.get(_AS):
        _swap_gloo(os.environ[_AS])
    _suite_class()
