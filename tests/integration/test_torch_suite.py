"""A CI-sized part of PyTorch's own distributed test suite on the resilient backend.

``tools/torch_suite.py`` runs torch's ``distributed_test`` (spawned ranks calling
``init_process_group`` on a file store) with ``--as-gloo``: the suite believes it
runs gloo, so its gloo-only tests run too, while every group is a resilient one
(the runner checks that at init). The full comparison with gloo and its figures
are in docs/BENCHMARKS.md; this part covers each family of calls once.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

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
