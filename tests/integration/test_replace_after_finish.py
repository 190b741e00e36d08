"""A rank hung at the job's very last step, after its part of that step's calls
(issue 43), under the real launcher, etcd and gloo: its three peers commit the
step, finish the job and leave; the launcher kills the hung rank once its lease
expires and starts its replacement, which finds nobody to admit it. It must see
that the job finished without it and exit 0 at once (not fail the job after
RESILIENT_REPLACE_TIMEOUT_S), and the survivors' parameters must equal a
fault-free run's.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from resilient.procs import spawn, stop_process

ROOT = Path(__file__).resolve().parents[2]
NPROC = 4
STEPS = 6
VICTIM = 2
# From the replacement's warm-up to its verdict: 0.16-0.55 s measured with the
# machine's 2 cores at load 12-25 (another test run and a soak); without the fix
# it is the 60 s replace timeout, then a failed job.
VERDICT_S = 15.0
# From its verdict to the launcher's "all finished" (its exit, the group's
# shutdown at exit, the launcher's 1 s drain of its output): 6-12 s at that load.
EXIT_S = 30.0
# The replacement's start before its warm-up (python and torch imported: 30-50 s
# at that load) is not the fix's to bound, only the job's.
JOB_TIMEOUT_S = 200.0
# The hung rank is found once its lease expires; 3 s leases expired on healthy
# ranks at load 25 (etcd's keep-alive answers late), so longer ones, and the
# fault-free run's longer still.
LEASE_TTL_S = {"none": 60, "hang": 10}

SCRIPT = """
import functools, gc, hashlib, os, signal, sys
import torch, torch.distributed as dist
from torch import nn
import resilient
from recovery.session import Session, TrainState

steps, victim, hang = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "hang"
torch.set_num_threads(1)
resilient.init()
rank, inc = dist.get_rank(), int(os.environ.get("RESILIENT_INCARNATION", "0"))
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
ddp = nn.parallel.DistributedDataParallel(model)
opt = torch.optim.SGD(ddp.parameters(), lr=0.05)

def train_step(step):
    gen = torch.Generator().manual_seed(rank * 1000 + step)
    loss = ddp(torch.randn(16, 64, generator=gen)).square().mean()
    opt.zero_grad(set_to_none=True)
    loss.backward()
    return loss.detach()

session = Session(dist.group.WORLD, TrainState(model, opt),
                  warmup=functools.partial(train_step, 0), ddp=ddp)
for step in session.steps(steps):
    with session.step(step):
        loss = train_step(step)
        dist.all_reduce(loss)
        if hang and rank == victim and inc == 0 and step == steps - 1:
            # After its part of the last step's calls: its peers finish the job.
            os.kill(os.getpid(), signal.SIGSTOP)
h = hashlib.sha256()
for p in model.parameters():
    h.update(p.detach().numpy().tobytes())
print(f"rank {rank} inc {inc}: done, params sha256 {h.hexdigest()}", flush=True)
del session, ddp, opt
gc.collect()
dist.destroy_process_group()
"""


def _launch(tmp: Path, how: str) -> tuple[int, list[tuple[float, str]]]:
    """Run the job under ``resilient run``; its exit code and every output line
    with when it came (wall clock, as events are stamped). The launcher's whole
    session is killed at the end, so no rank outlives the test, also when it fails."""
    script = tmp / "train.py"
    script.write_text(SCRIPT)
    argv = [
        sys.executable, "-m", "resilient", "run", "--nproc", str(NPROC), "--rails", "2",
        "--max-restarts", "1", "--lease-ttl", str(LEASE_TTL_S[how]),
        "--run-dir", str(tmp / f"run-{how}"),
        str(script), str(STEPS), str(VICTIM), how,
    ]  # fmt: skip
    env = {**os.environ, "RESILIENT_REPLACE_TIMEOUT_S": "60"}
    proc = spawn(argv, env=env, cwd=str(ROOT), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    lines: list[tuple[float, str]] = []

    def read() -> None:
        assert proc.stdout is not None
        for raw in proc.stdout:
            lines.append((time.time(), raw.decode(errors="replace").rstrip()))

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        code = proc.wait(timeout=JOB_TIMEOUT_S)
        ended = time.time()
    except subprocess.TimeoutExpired:
        code, ended = -1, time.time()  # the assertions show the output
    finally:
        stop_process(proc, grace_s=2.0)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)  # any rank left in the session
        reader.join(5)
    return code, [*lines, (ended, "<exit>")]


def _text(lines: list[tuple[float, str]]) -> str:
    return "\n".join(line for _, line in lines)[-6000:]


def _digests(lines: list[tuple[float, str]]) -> dict[tuple[int, int], str]:
    found = (re.search(r"rank (\d+) inc (\d+): done, params sha256 (\w+)", ln) for _, ln in lines)
    return {(int(m[1]), int(m[2])): m[3] for m in found if m}


@pytest.mark.timeout(450)
def test_a_replacement_after_the_job_finished_exits_0_promptly(tmp_path: Path) -> None:
    code, clean = _launch(tmp_path, "none")
    assert code == 0, _text(clean)
    reference = set(_digests(clean).values())
    assert len(_digests(clean)) == NPROC and len(reference) == 1, _text(clean)

    code, lines = _launch(tmp_path, "hang")
    text = _text(lines)
    assert code == 0, text
    assert f"rank {VICTIM} hung (its lease expired) and was killed; restarting" in text, text
    # Every survivor finished with the fault-free parameters; the replacement
    # trained nothing and printed nothing.
    digests = _digests(lines)
    assert sorted(digests) == [(r, 0) for r in range(NPROC) if r != VICTIM], text
    assert set(digests.values()) == reference, text
    events = [
        json.loads(row)
        for log in (tmp_path / "run-hang" / "events").glob("rank-*.jsonl")
        for row in log.read_text().splitlines()
    ]
    finished = [e for e in events if e["kind"] == "recovery.job_finished"]
    assert [(e["rank"], e["incarnation"]) for e in finished] == [(VICTIM, 1)], events
    verdict_s = finished[0]["duration_ms"] / 1e3
    assert verdict_s < VERDICT_S, f"{verdict_s:.1f} s from warm-up to verdict:\n{text}"
    done = [t for t, ln in lines if f"all {NPROC} rank(s) finished" in ln]
    assert done, text
    exit_s = done[0] - finished[0]["ts"]
    assert exit_s < EXIT_S, f"{exit_s:.1f} s from verdict to the job's end:\n{text}"
