"""The prepared device check of the CUDA path (issue 44): one command, at most 8
minutes on a one-GPU machine (``make gpu-check`` or ``scripts/gpu_check.sh``).

Steps, each under its own timeout; any that does not hold makes the exit status 1:

1. torch sees CUDA (else exit 2 at once: nothing else can be checked);
2. the CUDA-marked tests pass, and the one-GPU ones ran (were not skipped);
3. four ranks share GPU 0 over socket links (``RESILIENT_CUDA_TRANSPORT=socket``,
   each rank's device chosen by ``resilient.init()`` from LOCAL_RANK): every
   collective's result on CUDA tensors equals, bit for bit, the same job's on CPU
   tensors; a 4 MiB all_reduce is timed both ways;
4. every rank's group watches, through NVML, the GPU torch uses (NVML's UUID of
   the handle equals torch's), and one reading succeeds; with two GPUs or more, also
   under ``CUDA_VISIBLE_DEVICES=1`` (torch's cuda:0 is then NVML's GPU 1).

The last line printed is one JSON object of figures (``"ok"`` says whether all held).
``--rank-job cpu|cuda`` is the rank side of step 3 (started by this script).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
RANKS = 4
TESTS = (
    "tests/resilient/group/test_cuda_staging.py",
    "tests/resilient/group/test_cuda.py",
    "tests/resilient/group/test_cuda_device.py",
    "tests/resilient/detect/test_gpu.py",
    "tests/resilient/detect/test_gpu_device.py",
)
# Tests that need one GPU only: skipped here means the CUDA path did not run.
ONE_GPU_TESTS = ("test_cuda_round_trip", "test_ranks_sharing_one_gpu")
TEST_TIMEOUT_S = 240
JOB_TIMEOUT_S = 75
NVML_TIMEOUT_S = 30


# -- the rank side of step 3 -------------------------------------------------------------
def _digest(t: Any) -> str:
    import torch

    raw = t.detach().cpu().contiguous().view(-1).view(torch.uint8)  # bfloat16 too
    return hashlib.sha256(raw.numpy().tobytes()).hexdigest()


def _collectives(dev: Any, rank: int, world: int) -> dict[str, str]:
    """Every collective on seeded inputs; each result's SHA-256."""
    import torch
    import torch.distributed as dist

    gen = torch.Generator().manual_seed(1000 + rank)
    out: dict[str, str] = {}
    x = torch.randn(1 << 18, generator=gen).to(dev)
    dist.all_reduce(x)
    out["all_reduce_f32"] = _digest(x)
    h = torch.randn(4099, generator=gen).to(torch.bfloat16).to(dev)
    dist.all_reduce(h, op=dist.ReduceOp.MAX)
    out["all_reduce_bf16_max"] = _digest(h)
    i = torch.arange(777, dtype=torch.int64).mul(rank + 1).to(dev)
    dist.all_reduce(i)
    out["all_reduce_i64"] = _digest(i)
    g = torch.empty(world * 1000, device=dev)
    dist.all_gather_into_tensor(g, torch.randn(1000, generator=gen).to(dev))
    out["all_gather"] = _digest(g)
    r = torch.empty(1000, device=dev)
    dist.reduce_scatter_tensor(r, torch.randn(world * 1000, generator=gen).to(dev))
    out["reduce_scatter"] = _digest(r)
    b = torch.randn(5000, generator=gen).to(dev)
    dist.broadcast(b, src=1)
    out["broadcast"] = _digest(b)
    a = torch.empty(world * 256, device=dev)
    dist.all_to_all_single(a, torch.randn(world * 256, generator=gen).to(dev))
    out["all_to_all_single"] = _digest(a)
    return out


def _timed_all_reduce(dev: Any) -> float:
    """Median ms of a 4 MiB float32 all_reduce (10 after 3 warm-ups)."""
    import torch
    import torch.distributed as dist

    x = torch.ones(1 << 20, device=dev)
    times = []
    for n in range(13):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        dist.all_reduce(x)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if n >= 3:
            times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def _nvml_view(pg: Any) -> dict[str, Any]:
    """What the group's GPU watch sees, against torch's own idea of the device."""
    import torch

    gpu = pg.gpu
    if gpu is None:
        return {"watching": False}
    index = torch.cuda.current_device()
    props = torch.cuda.get_device_properties(index)
    nvml_uuid = gpu.nvml.nvmlDeviceGetUUID(gpu.handle)
    nvml_uuid = nvml_uuid.decode() if isinstance(nvml_uuid, bytes) else str(nvml_uuid)
    torch_uuid = str(getattr(props, "uuid", ""))
    state = gpu.poll()
    return {
        "watching": True,
        "cuda_index": index,
        "found_by": gpu.found_by,
        "nvml_uuid": nvml_uuid,
        "torch_uuid": torch_uuid,
        "uuid_match": bool(torch_uuid) and nvml_uuid.removeprefix("GPU-") == torch_uuid,
        "slowdowns": list(state.slowdowns),
    }


def rank_job(device: str) -> None:
    """One rank of step 3: its results as one JSON line on stdout."""
    import torch
    import torch.distributed as dist

    from resilient.backend import init

    pg = init()
    rank, world = dist.get_rank(), dist.get_world_size()
    dev = (
        torch.device("cuda", torch.cuda.current_device())
        if device == "cuda"
        else torch.device("cpu")
    )
    result = {
        "rank": rank,
        "device": str(dev),
        "digests": _collectives(dev, rank, world),
        "all_reduce_4MiB_ms": _timed_all_reduce(dev),
        "nvml": _nvml_view(pg),
    }
    dist.destroy_process_group()
    print("RESULT " + json.dumps(result), flush=True)


# -- the steps --------------------------------------------------------------------------
def _env(**extra: str) -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT), env.get("PYTHONPATH")]))
    env.update(extra)
    return env


def preflight() -> dict[str, Any]:
    import torch

    if not torch.cuda.is_available():
        print("gpu_check: torch sees no CUDA device; nothing to check", file=sys.stderr)
        print(json.dumps({"check": "gpu", "ok": False, "failures": ["no CUDA device"]}))
        sys.exit(2)
    return {
        "gpu": torch.cuda.get_device_name(0),
        "gpus": torch.cuda.device_count(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
    }


def run_tests(out: Path, failures: list[str]) -> dict[str, Any]:
    """Step 2: the CUDA-marked tests, counted from pytest's JUnit XML."""
    xml = out / "junit.xml"
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "-q",
        "-p",
        "no:cacheprovider",
        "-rs",
        f"--junitxml={xml}",
        *TESTS,
    ]
    try:
        proc = subprocess.run(
            cmd, cwd=ROOT, env=_env(), timeout=TEST_TIMEOUT_S, capture_output=True, text=True
        )
    except subprocess.TimeoutExpired:
        failures.append(f"tests: not done within {TEST_TIMEOUT_S} s")
        return {}
    print(proc.stdout[-4000:], proc.stderr[-2000:], sep="\n", file=sys.stderr)
    if not xml.exists():
        failures.append(f"tests: pytest exited {proc.returncode} without a report")
        return {}
    cases = ET.parse(xml).getroot().iter("testcase")
    counts = {"passed": 0, "failed": 0, "skipped": 0}
    skipped_one_gpu = []
    for case in cases:
        kinds = {child.tag for child in case}
        if kinds & {"failure", "error"}:
            counts["failed"] += 1
        elif "skipped" in kinds:
            counts["skipped"] += 1
            if case.get("name", "").startswith(ONE_GPU_TESTS):
                skipped_one_gpu.append(case.get("name", ""))
        else:
            counts["passed"] += 1
    if proc.returncode != 0 or counts["failed"]:
        failures.append(f"tests: pytest exited {proc.returncode}, {counts['failed']} failed")
    if skipped_one_gpu:
        failures.append(f"tests: one-GPU tests skipped: {skipped_one_gpu}")
    return counts


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def run_job(device: str, failures: list[str]) -> list[dict[str, Any]]:
    """Start the four ranks of one job; their results by rank ([] if it failed)."""
    port, procs = _free_port(), []
    for rank in range(RANKS):
        env = _env(
            RANK=str(rank), WORLD_SIZE=str(RANKS), LOCAL_RANK=str(rank),
            LOCAL_WORLD_SIZE=str(RANKS), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
            RESILIENT_CUDA_TRANSPORT="socket",
        )  # fmt: skip
        cmd = [sys.executable, str(Path(__file__).resolve()), "--rank-job", device]
        procs.append(subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True))
    deadline, results = time.monotonic() + JOB_TIMEOUT_S, []
    for rank, proc in enumerate(procs):
        try:
            stdout, _ = proc.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            failures.append(f"{device} job: rank {rank} not done within {JOB_TIMEOUT_S} s")
            break
        lines = [ln for ln in stdout.splitlines() if ln.startswith("RESULT ")]
        if proc.returncode != 0 or not lines:
            failures.append(f"{device} job: rank {rank} exited {proc.returncode} without a result")
            break
        results.append(json.loads(lines[-1].removeprefix("RESULT ")))
    for proc in procs:
        if proc.poll() is None:
            proc.kill()
            proc.wait(5)
    return results if len(results) == RANKS else []


def shared_gpu(failures: list[str]) -> dict[str, Any]:
    """Step 3 and, from its ranks, step 4."""
    cuda, cpu = run_job("cuda", failures), run_job("cpu", failures)
    if not cuda or not cpu:
        return {"ranks": RANKS, "equal_to_cpu": False}
    differ = [
        f"rank {a['rank']} {op}"
        for a, b in zip(cuda, cpu, strict=True)
        for op in sorted(set(a["digests"]) | set(b["digests"]))
        if a["digests"].get(op) != b["digests"].get(op)
    ]
    if differ:
        failures.append(f"shared GPU: CUDA results differ from CPU: {differ}")
    devices = sorted({r["device"] for r in cuda})
    if devices != ["cuda:0"]:
        failures.append(f"shared GPU: ranks on {devices}, expected all on cuda:0")
    nvml = [r["nvml"] for r in cuda]
    if not all(v.get("watching") and v.get("uuid_match") for v in nvml):
        failures.append(f"NVML: a rank does not watch torch's GPU: {nvml}")
    return {
        "ranks": RANKS,
        "equal_to_cpu": not differ,
        "ops": sorted(cuda[0]["digests"]),
        "all_reduce_4MiB_ms": {
            "cuda_socket": round(statistics.median(r["all_reduce_4MiB_ms"] for r in cuda), 3),
            "cpu_socket": round(statistics.median(r["all_reduce_4MiB_ms"] for r in cpu), 3),
        },
        "nvml": {
            "found_by": sorted({str(v.get("found_by")) for v in nvml}),
            "uuid_match": all(v.get("uuid_match") for v in nvml),
        },
    }


_VISIBLE_PROBE = """
import json, torch, pynvml
from resilient.detect.gpu import GpuHealth
torch.cuda.set_device(0)
gpu = GpuHealth.watch_current(rank=0)
pynvml.nvmlInit()
want = pynvml.nvmlDeviceGetUUID(pynvml.nvmlDeviceGetHandleByIndex(1))
got = gpu.nvml.nvmlDeviceGetUUID(gpu.handle) if gpu else None
print(json.dumps({"found_by": gpu.found_by if gpu else None, "match": got == want}))
"""


def visible_devices(gpus: int, failures: list[str]) -> dict[str, Any] | None:
    """Step 4 with two GPUs or more: under CUDA_VISIBLE_DEVICES=1 the watch is NVML's GPU 1."""
    if gpus < 2:
        return None
    try:
        proc = subprocess.run(
            [sys.executable, "-c", _VISIBLE_PROBE], cwd=ROOT, env=_env(CUDA_VISIBLE_DEVICES="1"),
            timeout=NVML_TIMEOUT_S, capture_output=True, text=True,
        )  # fmt: skip
        seen = json.loads(proc.stdout.strip().splitlines()[-1])
    except (subprocess.TimeoutExpired, ValueError, IndexError) as exc:
        failures.append(f"NVML under CUDA_VISIBLE_DEVICES=1: no answer ({exc})")
        return {"match": False}
    if not seen.get("match"):
        failures.append(f"NVML under CUDA_VISIBLE_DEVICES=1: watches the wrong GPU ({seen})")
    return dict(seen)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rank-job", choices=("cpu", "cuda"))
    args = parser.parse_args()
    if args.rank_job:
        rank_job(args.rank_job)
        return 0
    start, failures = time.monotonic(), list[str]()
    figures: dict[str, Any] = {"check": "gpu", **preflight()}
    with tempfile.TemporaryDirectory(prefix="gpu-check-") as tmp:
        figures["tests"] = run_tests(Path(tmp), failures)
    figures["shared_gpu"] = shared_gpu(failures)
    figures["visible_devices"] = visible_devices(figures["gpus"], failures)
    figures.update(ok=not failures, failures=failures, wall_s=round(time.monotonic() - start, 1))
    for failure in failures:
        print(f"gpu_check: FAILED: {failure}", file=sys.stderr)
    print(json.dumps(figures))
    return 0 if not failures else 1


if __name__ == "__main__":
    sys.exit(main())
