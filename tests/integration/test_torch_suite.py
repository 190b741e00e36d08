"""A CI-sized part of PyTorch's own distributed test suite on the resilient backend.

``tools/torch_suite.py`` runs torch's ``distributed_test`` (spawned ranks calling
``init_process_group`` on a file store) with ``--as-gloo``: the suite believes it
runs gloo, so its gloo-only tests run too, while every group is a resilient one
(the runner checks that at init). The full comparison with gloo and its figures
are in docs/BENCHMARKS.md; this part covers each family of calls once.
"""

from __future__ import annotations

import functools
import importlib.util
import json
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

pytest.importorskip("expecttest")

RUNNER = Path(__file__).resolve().parents[2] / "tools" / "torch_suite.py"
# One or two tests per family that the suite runs on 2 CPU ranks: p2p, rooted
# calls, coalesced, objects, barrier, DDP. (Its all_to_all tests run for MPI only,
# and a few others need 4 ranks or are skipped upstream.)
TESTS = (
    "test_send_recv",
    "test_isend",
    "test_batch_isend_irecv_gloo_tags",
    "test_gather",
    "test_scatter",
    "test_reduce_sum",
    "test_all_gather_coalesced_simple",
    "test_all_gather_object_default_pg",
    "test_barrier",
    # init_process_group's timeout= bounds a wait (a rank never enters this barrier).
    "test_barrier_timeout_full_group",
    "test_DistributedDataParallelCPU",
)


@pytest.mark.timeout(900)
def test_a_part_of_torchs_distributed_suite_passes_on_resilient(tmp_path: Path) -> None:
    out = tmp_path / "suite.json"
    args = [sys.executable, str(RUNNER), "--backend", "resilient", "--as-gloo"]
    args += ["--json-out", str(out)]
    for name in TESTS:
        args += ["--name", name]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=850)
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert json.loads(out.read_text())["outcomes"].keys() == set(TESTS)
    assert summary["backend"] == "resilient" and summary["as_gloo"] is True
    assert summary["not_passed"] == [], proc.stdout[-4000:]
    assert summary["passed"] == len(TESTS), summary


def _runner_module() -> Any:
    spec = importlib.util.spec_from_file_location("torch_suite_runner", RUNNER)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.skipif(torch.cuda.is_available(), reason="reads a CPU-only host's GPU count")
def test_the_runner_reads_the_skips_of_a_test_from_its_decorators() -> None:
    from torch.testing._internal.common_distributed import (
        skip_if_lt_x_gpu,
        skip_if_no_gpu,
        skip_if_odd_worldsize,
        skip_if_small_worldsize,
    )

    runner = _runner_module()

    def body(self: Any) -> None: ...

    assert runner.known_skip(body) == ""
    two = skip_if_lt_x_gpu(2)(body)  # type: ignore[no-untyped-call]
    assert runner.known_skip(two) == "Need at least 2 CUDA devices (not spawned)"
    # Under another wrapper too (the suite stacks decorators).
    stacked = functools.wraps(two)(lambda self: two(self))
    assert runner.known_skip(stacked) == "Need at least 2 CUDA devices (not spawned)"
    cpu_too = skip_if_lt_x_gpu(2, allow_cpu=True)(body)  # type: ignore[no-untyped-call]
    assert runner.known_skip(cpu_too) == ""
    no_gpu = skip_if_no_gpu(body)  # type: ignore[no-untyped-call]
    assert runner.known_skip(no_gpu) == "CUDA is not available. (not spawned)"
    # The world size the ranks would see: under 8, or odd (MPI runs them all).
    small = skip_if_small_worldsize(body)  # type: ignore[no-untyped-call]
    assert runner.known_skip(small, 4, "gloo") == "Skipped due to small world size. (not spawned)"
    assert runner.known_skip(small, 8, "gloo") == ""
    assert runner.known_skip(small, 4, "mpi") == ""
    odd = skip_if_odd_worldsize(body)  # type: ignore[no-untyped-call]
    assert runner.known_skip(odd, 3, "gloo") == "Skipped due to odd world size. (not spawned)"
    assert runner.known_skip(odd, 4, "gloo") == ""


@pytest.mark.skipif(torch.cuda.is_available(), reason="needs a CPU-only host")
@pytest.mark.timeout(300)
def test_tests_that_would_only_skip_are_recorded_without_spawning_ranks(tmp_path: Path) -> None:
    out = tmp_path / "suite.json"
    name = "test_ddp_apply_optim_in_backward"  # @skip_if_lt_x_gpu(2)
    args = [sys.executable, str(RUNNER), "--backend", "resilient", "--as-gloo"]
    args += ["--json-out", str(out), "--name", name, "--name", "test_barrier_group"]
    proc = subprocess.run(args, capture_output=True, text=True, timeout=280)
    outcomes = json.loads(out.read_text())["outcomes"]
    assert outcomes[name] == ["skip", "Need at least 2 CUDA devices (not spawned)"], proc.stdout
    # @skip_if_small_worldsize: 8 ranks or more (the test of the module's first runs
    # the tests without these decorators).
    small = ["skip", "Skipped due to small world size. (not spawned)"]
    assert outcomes["test_barrier_group"] == small, proc.stdout
    assert json.loads(proc.stdout.strip().splitlines()[-1])["skipped"] == 2
