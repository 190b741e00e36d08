"""The shipped examples end to end, through the real launcher, etcd and gloo."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from resilient.procs import free_port, spawn, stop_process

REPO = Path(__file__).resolve().parents[2]


def _run(argv: list[str], timeout: float, env: dict[str, str] | None = None) -> str:
    """Run ``argv`` in its own session; on timeout the whole session is killed, so
    no rank of a hung launcher (torchrun's included) outlives the test."""
    proc = spawn(
        argv,
        env={**os.environ, **(env or {})},
        cwd=str(REPO),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
    )
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_process(proc, grace_s=2.0)
        out, _ = proc.communicate()
        raise AssertionError(f"timed out after {timeout} s:\n{out.decode()[-3000:]}") from None
    finally:
        stop_process(proc, grace_s=2.0)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # any rank left in the session
    text = out.decode(errors="replace")
    assert proc.returncode == 0, f"exit {proc.returncode}\n{text[-4000:]}"
    return text


@pytest.mark.timeout(180)
def test_ddp_over_resilient_matches_ddp_over_gloo(tmp_path: Path) -> None:
    args = ["examples/train_ddp.py", "--steps", "8", "--width", "256"]
    res_json, gloo_json = tmp_path / "res.json", tmp_path / "gloo.json"
    out = _run(
        [
            sys.executable,
            "-m",
            "resilient",
            "run",
            "--nproc",
            "4",
            "--rails",
            "2",
            *args,
            "--json-out",
            str(res_json),
        ],
        timeout=150,
    )
    hashes = set(re.findall(r"final params sha256 ([0-9a-f]{64})", out))
    assert len(re.findall(r"final params sha256", out)) == 4, out
    assert len(hashes) == 1, f"ranks ended with different parameters: {hashes}"
    _run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nproc-per-node",
            "4",
            "--master-port",
            str(free_port()),
            *args,
            "--backend",
            "gloo",
            "--json-out",
            str(gloo_json),
        ],
        timeout=150,
        env={"TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"},
    )
    res, gloo = json.loads(res_json.read_text()), json.loads(gloo_json.read_text())
    assert len(res["losses"]) == len(gloo["losses"]) == 8
    assert res["losses"] == pytest.approx(gloo["losses"], rel=1e-4, abs=1e-6)
    assert res["losses"][-1] < res["losses"][0]  # it trains


@pytest.mark.timeout(150)
def test_membership_demo_restarts_one_rank_and_moves_the_one_epoch() -> None:
    out = _run(
        [
            sys.executable,
            "-m",
            "resilient",
            "run",
            "--nproc",
            "4",
            "--rails",
            "2",
            "--max-restarts",
            "1",
            "--lease-ttl",
            "3",
            "examples/membership_demo.py",
            "--steps",
            "10",
            "--step-s",
            "0.05",
        ],
        timeout=130,
    )
    assert "rank 2 exited with code -9 (SIGKILL); restarting as incarnation 1" in out, out
    assert "rank 2 inc 1: finished 10 steps at epoch 1" in out, out
    for r in (0, 1, 3):  # the survivors never restarted and replayed the lost step
        assert f"rank {r} inc 0: finished 10 steps at epoch 1 (replayed 1)" in out, out
    assert "rank 2: member as incarnation 1" in out, out
    # The recovery moved the job's one epoch in etcd, with its history record.
    # Under the launcher's run id (RESILIENT_RUN_ID): the world group's keys of this run.
    where = r"the job's epoch lives at /resilient/[\w.-]+/store/run-\w+/g0/epoch"
    assert re.search(where, out), out
    assert "epoch history (final epoch 1)" in out, out
    assert re.search(r"epoch 1: members \[0, 1, 2, 3\] of 4, joined \[2\], resumed after", out), out
