"""The local launcher with real processes: restarts, exit codes, env, output, signals.

The rank scripts are written into tmp_path and never import torch, so that each
test spends its time on process supervision, not on imports. Every rank records
``start``/``done`` files named ``<kind>-<rank>-<incarnation>.json`` with its pid.
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
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from collections.abc import Set as AbstractSet
from pathlib import Path
from typing import Any

import psutil
import pytest

from membership.server import EmbeddedEtcd
from resilient.config import RankEnv
from resilient.errors import ConfigError, LauncherError
from resilient.launch import spares as spares_module
from resilient.launch.launcher import RANK_VAR_HELP, LaunchConfig, Launcher, RankVar, loopback_rails
from resilient.launch.rank_procs import describe_exit, shell_exit_code
from tests._procs import gone, wait_until

REPO = Path(__file__).resolve().parents[3]

# Shared head of every rank script: argv[1] is the directory the records go to.
PRELUDE = """\
import json, os, signal, subprocess, sys, time
from pathlib import Path

OUT = Path(sys.argv[1])
RANK = int(os.environ["RANK"])
INC = int(os.environ["RESILIENT_INCARNATION"])


def record(kind, **extra):
    data = {"rank": RANK, "inc": INC, "pid": os.getpid(), "env_rank": os.environ["RANK"]}
    data.update(extra)
    tmp = OUT / f".{kind}-{RANK}-{INC}.tmp"
    tmp.write_text(json.dumps(data))
    tmp.rename(OUT / f"{kind}-{RANK}-{INC}.json")


def wait_for(*names, timeout=30.0):
    deadline = time.monotonic() + timeout
    while not all((OUT / n).exists() for n in names):
        if time.monotonic() > deadline:
            print(f"rank {RANK}: gave up waiting for {names}", file=sys.stderr)
            sys.exit(90)
        time.sleep(0.02)


record("start")
"""


def make_script(tmp_path: Path, body: str) -> tuple[str, Path]:
    """Write a rank script (PRELUDE + body); return its path and the records dir."""
    out = tmp_path / "out"
    out.mkdir(exist_ok=True)
    script = tmp_path / "rank_script.py"
    script.write_text(PRELUDE + body)
    return str(script), out


def read(out: Path, kind: str, rank: int, inc: int) -> dict[str, Any]:
    data: dict[str, Any] = json.loads((out / f"{kind}-{rank}-{inc}.json").read_text())
    return data


def records(out: Path, kind: str) -> list[str]:
    return sorted(p.name for p in out.glob(f"{kind}-*.json"))


@pytest.fixture
def etcd_url(etcd_server: EmbeddedEtcd) -> str:
    """The session's etcd (tests/conftest.py); rank scripts here never write to it."""
    return etcd_server.url


@pytest.fixture(autouse=True)
def no_leftovers() -> Iterator[None]:
    """Fail a test that leaves a process behind, and kill what it left."""
    me = psutil.Process()
    before = {p.pid for p in me.children(recursive=True)}
    yield
    new = [p for p in me.children(recursive=True) if p.pid not in before]
    _, alive = psutil.wait_procs(new, timeout=5.0)
    for p in alive:
        p.kill()
    assert not alive, f"processes left behind: {[p.pid for p in alive]}"


def config(script: str, out: Path, **kw: Any) -> LaunchConfig:
    kw.setdefault("grace_s", 2.0)
    # Off unless a test is about them: a primed process (past `import torch`) would
    # make a restart of these torch-free scripts slower, and when depends on timing.
    kw.setdefault("primed_restarts", False)
    return LaunchConfig(script=script, script_args=(str(out),), **kw)


@pytest.mark.timeout(60)
def test_restarts_only_the_killed_rank(
    tmp_path: Path, etcd_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    script, out = make_script(
        tmp_path,
        """
if RANK == 2 and INC == 0:
    wait_for("start-0-0.json", "start-1-0.json", "start-3-0.json")
    os.kill(os.getpid(), signal.SIGKILL)
wait_for("start-2-1.json")
record("done")
""",
    )
    cfg = config(script, out, nproc=4, etcd=etcd_url, max_restarts=2)

    assert Launcher(cfg).run() == 0

    assert records(out, "start") == sorted(
        [f"start-{r}-0.json" for r in range(4)] + ["start-2-1.json"]
    )
    assert records(out, "done") == [
        "done-0-0.json",
        "done-1-0.json",
        "done-2-1.json",
        "done-3-0.json",
    ]
    for rank in (0, 1, 3):
        # The same process that started before the kill finished after the restart.
        assert read(out, "start", rank, 0)["pid"] == read(out, "done", rank, 0)["pid"]
    first, second = read(out, "start", 2, 0), read(out, "start", 2, 1)
    assert first["pid"] != second["pid"]
    assert first["env_rank"] == second["env_rank"] == "2"
    err = capsys.readouterr().err
    assert (
        "rank 2 exited with code -9 (SIGKILL); restarting as incarnation 1 (1/2 restarts used)"
        in err
    )
    assert "all 4 rank(s) finished" in err


@pytest.mark.timeout(60)
def test_failure_without_budget_returns_its_code_and_stops_the_others(
    tmp_path: Path, etcd_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    script, out = make_script(
        tmp_path,
        """
if RANK == 1:
    wait_for("start-0-0.json", "start-2-0.json")
    sys.exit(3)
time.sleep(60)
""",
    )
    started = time.monotonic()

    code = Launcher(config(script, out, nproc=3, etcd=etcd_url)).run()

    assert code == 3
    assert time.monotonic() - started < 30
    for rank in (0, 2):
        assert gone(int(read(out, "start", rank, 0)["pid"]))
    assert records(out, "done") == []
    assert "rank 1 exited with code 3; no restarts left (0/0 used)" in capsys.readouterr().err


@pytest.mark.timeout(60)
def test_budget_is_job_wide_and_exhaustion_ends_the_job(
    tmp_path: Path, etcd_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    script, out = make_script(
        tmp_path,
        """
if RANK == 0:
    wait_for("start-1-0.json")
    sys.exit(5)
time.sleep(60)
""",
    )

    code = Launcher(config(script, out, nproc=2, etcd=etcd_url, max_restarts=2)).run()

    assert code == 5
    assert records(out, "start") == [
        "start-0-0.json",
        "start-0-1.json",
        "start-0-2.json",
        "start-1-0.json",
    ]
    err = capsys.readouterr().err
    assert "restarting as incarnation 2 (2/2 restarts used)" in err
    assert "rank 0 exited with code 5; no restarts left (2/2 used)" in err


@pytest.mark.timeout(60)
def test_death_by_signal_is_reported_like_a_shell(tmp_path: Path, etcd_url: str) -> None:
    script, out = make_script(tmp_path, "os.kill(os.getpid(), signal.SIGKILL)\n")
    assert Launcher(config(script, out, nproc=1, etcd=etcd_url)).run() == 128 + 9


@pytest.mark.timeout(60)
def test_rank_ignoring_sigterm_is_killed_after_grace(tmp_path: Path, etcd_url: str) -> None:
    script, out = make_script(
        tmp_path,
        """
if RANK == 0:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    record("ignoring")
    time.sleep(60)
wait_for("ignoring-0-0.json")
sys.exit(1)
""",
    )
    started = time.monotonic()

    code = Launcher(config(script, out, nproc=2, etcd=etcd_url, grace_s=0.5)).run()

    assert code == 1
    assert time.monotonic() - started < 20
    assert gone(int(read(out, "start", 0, 0)["pid"]))


@pytest.mark.timeout(60)
def test_processes_a_rank_leaves_behind_are_killed(tmp_path: Path, etcd_url: str) -> None:
    script, out = make_script(
        tmp_path,
        """
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
record("child", child=child.pid)
""",
    )

    assert Launcher(config(script, out, nproc=1, etcd=etcd_url)).run() == 0

    child = int(read(out, "child", 0, 0)["child"])
    assert wait_until(lambda: gone(child), 5.0)


@pytest.mark.timeout(60)
def test_env_of_each_rank_parses_and_embedded_etcd_lives_for_the_run(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Values an enclosing launch would have left must be replaced, others passed through.
    monkeypatch.setenv("RANK", "99")
    monkeypatch.setenv("RESILIENT_INCARNATION", "7")
    monkeypatch.setenv("RESILIENT_RUN_DIR", "/nonexistent")
    monkeypatch.setenv("RESILIENT_TEST_PASSTHROUGH", "kept")
    script, out = make_script(
        tmp_path,
        """
import urllib.request
url = os.environ["RESILIENT_ETCD"].split(",")[0] + "/health"
with urllib.request.urlopen(url, timeout=5) as resp:
    health = json.loads(resp.read())["health"]
record("env", env=dict(os.environ), health=health)
""",
    )
    cfg = config(
        script, out, nproc=2, rails=3, job="envtest", lease_ttl_s=3.0,
        rank_env=(("RESILIENT_PROGRESS_INTERVAL_S", "0.5"),),
    )  # fmt: skip

    assert Launcher(cfg).run() == 0

    envs = [read(out, "env", rank, 0) for rank in range(2)]
    ports = set()
    for rank, rec in enumerate(envs):
        env: dict[str, str] = rec["env"]
        assert rec["health"] == "true"
        # Set only when asked for.
        optional = {
            v.value
            for v in (
                RankVar.RUN_DIR,
                RankVar.FAULT_CONTROL,
                RankVar.MIN_RANKS,
                RankVar.SHRINK_AFTER_S,
                RankVar.EVICT_STRAGGLERS,
            )
        }
        assert {v.value for v in RankVar} - optional <= env.keys()
        assert not optional & env.keys()
        assert env["RESILIENT_TEST_PASSTHROUGH"] == "kept"
        assert env["RESILIENT_PROGRESS_INTERVAL_S"] == "0.5"
        assert env["PYTHONUNBUFFERED"] == env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] == "1"
        parsed = RankEnv.from_env(env)
        assert (parsed.rank, parsed.world_size) == (rank, 2)
        assert (parsed.local_rank, parsed.local_world_size) == (rank, 2)
        assert parsed.rails == tuple(f"127.0.{rail}.{rank + 1}" for rail in (1, 2, 3))
        assert (parsed.job, parsed.token, parsed.incarnation) == ("envtest", cfg.token, 0)
        assert (parsed.lease_ttl_s, parsed.run_dir, parsed.master_addr) == (3.0, None, "127.0.0.1")
        assert parsed.etcd is not None
        ports.add(parsed.master_port)
    assert len(ports) == 1
    url = envs[0]["env"]["RESILIENT_ETCD"]
    with pytest.raises(urllib.error.URLError):
        urllib.request.urlopen(f"{url}/health", timeout=2)


@pytest.mark.timeout(60)
def test_run_dir_is_created_and_passed(tmp_path: Path, etcd_url: str) -> None:
    script, out = make_script(tmp_path, 'record("env", run_dir=os.environ["RESILIENT_RUN_DIR"])\n')
    run_dir = tmp_path / "runs" / "r1"

    assert Launcher(config(script, out, nproc=1, etcd=etcd_url, run_dir=str(run_dir))).run() == 0

    assert run_dir.is_dir()
    assert read(out, "env", 0, 0)["run_dir"] == str(run_dir)


@pytest.mark.timeout(60)
def test_output_is_prefixed_whole_lines_and_logged(
    tmp_path: Path, etcd_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    script, out = make_script(
        tmp_path,
        """
pad = "x" * 3000
for i in range(150):
    print(f"r{RANK}-{i}-{pad}")
    print(f"e{RANK}-{i}-{pad}", file=sys.stderr)
sys.stdout.write("no newline at the end")
""",
    )
    logs = tmp_path / "logs"

    assert Launcher(config(script, out, nproc=3, etcd=etcd_url, log_dir=str(logs))).run() == 0

    captured = capsys.readouterr()
    for stream, letter in ((captured.out, "r"), (captured.err, "e")):
        rank_lines = [line for line in stream.splitlines() if not line.startswith("[launcher]")]
        pattern = re.compile(rf"\[rank (\d)\] {letter}\1-(\d+)-x{{3000}}")
        matched = [m for line in rank_lines if (m := pattern.fullmatch(line))]
        tails = [line for line in rank_lines if line.endswith("no newline at the end")]
        assert len(matched) + len(tails) == len(rank_lines), "a line was cut or interleaved"
        assert sorted(int(m.group(1)) for m in matched) == [r for r in range(3) for _ in range(150)]
    for rank in range(3):
        assert f"[rank {rank}] no newline at the end" in captured.out.splitlines()
    log = (logs / "rank1.log").read_text().splitlines()
    assert log[0].startswith("--- incarnation 0, pid ")
    assert f"r1-149-{'x' * 3000}" in log and f"e1-0-{'x' * 3000}" in log


@pytest.mark.timeout(60)
def test_sigint_in_process_stops_ranks_and_restores_handlers(tmp_path: Path, etcd_url: str) -> None:
    script, out = make_script(tmp_path, "time.sleep(60)\n")
    before = (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM))

    def interrupt() -> None:
        if wait_until(lambda: len(records(out, "start")) == 2, 30.0):
            os.kill(os.getpid(), signal.SIGINT)

    threading.Thread(target=interrupt, daemon=True).start()
    code = Launcher(config(script, out, nproc=2, etcd=etcd_url)).run()

    assert code == 130
    assert (signal.getsignal(signal.SIGINT), signal.getsignal(signal.SIGTERM)) == before
    for rank in range(2):
        assert gone(int(read(out, "start", rank, 0)["pid"]))


@pytest.mark.timeout(90)
@pytest.mark.parametrize(("sig", "expected"), [(signal.SIGTERM, 143), (signal.SIGINT, 130)])
def test_signal_to_launcher_process_leaves_nothing_behind(
    tmp_path: Path, sig: signal.Signals, expected: int
) -> None:
    script, out = make_script(tmp_path, "time.sleep(60)\n")
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]),
    }
    argv = [
        sys.executable,
        "-m",
        "resilient",
        "run",
        "--nproc",
        "3",
        "--grace",
        "2",
        script,
        str(out),
    ]
    with (tmp_path / "launcher.log").open("wb") as log:
        launcher = subprocess.Popen(argv, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT)
    descendants: list[psutil.Process] = []
    try:
        assert wait_until(lambda: len(records(out, "start")) == 3, 45.0), (
            tmp_path / "launcher.log"
        ).read_text()
        descendants = psutil.Process(launcher.pid).children(recursive=True)
        # Three ranks and the embedded etcd.
        assert len(descendants) >= 4
        launcher.send_signal(sig)
        assert launcher.wait(timeout=30) == expected
        _, alive = psutil.wait_procs(descendants, timeout=5.0)
        assert alive == []
        assert "stopping all ranks" in (tmp_path / "launcher.log").read_text()
    finally:
        if launcher.poll() is None:
            launcher.kill()
            launcher.wait(timeout=10)
        for proc in descendants:
            with contextlib.suppress(psutil.NoSuchProcess):
                proc.kill()


@pytest.mark.timeout(60)
def test_error_mid_launch_stops_the_ranks_already_started(
    tmp_path: Path, etcd_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    script, out = make_script(tmp_path, "time.sleep(60)\n")
    real_spawn = spares_module.spawn  # the launcher starts its ranks there
    calls = 0

    def flaky_spawn(*args: Any, **kwargs: Any) -> subprocess.Popen[bytes]:
        nonlocal calls
        calls += 1
        if calls == 2:
            assert wait_until(lambda: len(records(out, "start")) == 1, 30.0)
            raise OSError("no more processes")
        return real_spawn(*args, **kwargs)

    monkeypatch.setattr(spares_module, "spawn", flaky_spawn)
    with pytest.raises(LauncherError, match="could not start rank 1: no more processes"):
        Launcher(config(script, out, nproc=2, etcd=etcd_url)).run()
    assert gone(read(out, "start", 0, 0)["pid"])


@pytest.mark.timeout(30)
def test_unusable_run_dir_is_a_launcher_error(tmp_path: Path, etcd_url: str) -> None:
    script, out = make_script(tmp_path, "")
    blocker = tmp_path / "file"
    blocker.write_text("")
    cfg = config(script, out, nproc=1, etcd=etcd_url, run_dir=str(blocker / "run"))
    with pytest.raises(LauncherError, match="cannot create directory"):
        Launcher(cfg).run()
    assert records(out, "start") == []


# ---------------------------------------------------------------- config and helpers


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "override",
    [
        {"nproc": 0},
        {"nproc": 255},
        {"nproc": True},
        {"rails": 0},
        {"max_restarts": -1},
        {"evict_stragglers": True},  # nothing would replace nor leave out an evicted rank
        {"rank_env": (("PATH", "/x"),)},  # not ours to set
        {"rank_env": (("RESILIENT_RANK_NOT", "1"), ("RESILIENT_INCARNATION", "2"))},
        {"lease_ttl_s": 1.5},
        {"lease_ttl_s": float("nan")},
        {"grace_s": 0},
        {"job": "no spaces please"},
        {"token": ""},
        {"token": "a b"},
        {"etcd": "ftp://host:1"},
        {"etcd": "host-without-port"},
        {"script": "/nonexistent/train.py"},
    ],
)
def test_invalid_config_raises_config_error(tmp_path: Path, override: dict[str, Any]) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    kwargs: dict[str, Any] = {"nproc": 2, "script": str(script), **override}
    with pytest.raises(ConfigError):
        LaunchConfig(**kwargs)


@pytest.mark.timeout(10)
def test_config_defaults_and_normalisation(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    Path("train.py").write_text("")
    args: Any = ["a"]
    cfg = LaunchConfig(
        nproc=2, script="train.py", script_args=args, etcd="127.0.0.1:2379", log_dir="logs"
    )
    assert re.fullmatch(r"job-[0-9a-f]{8}", cfg.job)
    assert re.fullmatch(r"[0-9a-f]{32}", cfg.token)
    assert cfg.token not in repr(cfg)
    assert (cfg.rails, cfg.max_restarts, cfg.grace_s) == (1, 0, 5.0)
    assert cfg.script_args == ("a",)
    assert cfg.etcd == "http://127.0.0.1:2379"
    assert cfg.log_dir == str(tmp_path / "logs")
    assert LaunchConfig(nproc=1, script="train.py").job != cfg.job


@pytest.mark.timeout(10)
def test_loopback_rails_and_exit_helpers() -> None:
    assert loopback_rails(0, 2) == ("127.0.1.1", "127.0.2.1")
    assert loopback_rails(253, 1) == ("127.0.1.254",)
    assert set(RANK_VAR_HELP) == set(RankVar)
    assert (shell_exit_code(0), shell_exit_code(3), shell_exit_code(-9)) == (0, 3, 137)
    assert describe_exit(-15) == "code -15 (SIGTERM)"
    assert describe_exit(2) == "code 2"


def _primed_pids() -> set[int]:
    """The launcher's primed processes (resilient.launch.primed) running now."""
    found = set()
    for p in psutil.Process().children(recursive=True):
        with contextlib.suppress(psutil.Error):  # gone, or a zombie not reaped yet
            if "resilient.launch.primed" in " ".join(p.cmdline()):
                found.add(p.pid)
    return found


def _wait_for_primed(seen: set[int], besides: AbstractSet[int] = frozenset()) -> None:
    """Add to ``seen`` the primed processes running (not in ``besides``) until it
    holds two (one per rank)."""

    def two() -> bool:
        seen.update(_primed_pids() - besides)
        return len(seen) >= 2

    wait_until(two, 60.0)


def _run_watched(cfg: LaunchConfig, watch: Callable[[], None]) -> None:
    """Run the job with ``watch`` in a thread beside it; the job must succeed."""
    watcher = threading.Thread(target=watch, daemon=True)
    watcher.start()
    assert Launcher(cfg).run() == 0
    watcher.join(timeout=10.0)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("primed", [True, False])
def test_a_cold_restart_starts_from_the_ranks_primed_process(
    tmp_path: Path, etcd_url: str, capsys: pytest.CaptureFixture[str], primed: bool
) -> None:
    # Rank 1 fails once the test has seen a primed process per rank (or, with
    # primed restarts off, at once); its next incarnation must be one of them,
    # with torch imported before the script's first line.
    script, out = make_script(
        tmp_path,
        """
record("loaded", torch="torch" in sys.modules)
if RANK == 1 and INC == 0:
    wait_for("fail", timeout=60.0)
    sys.exit(3)
wait_for("start-1-1.json", timeout=60.0)
record("done")
""",
    )
    seen: set[int] = set()

    def watch() -> None:
        if primed:  # both ranks' primed processes stand waiting
            _wait_for_primed(seen)
        (out / "fail").write_text("")

    cfg = config(script, out, nproc=2, etcd=etcd_url, max_restarts=1, primed_restarts=primed)
    _run_watched(cfg, watch)

    assert records(out, "done") == ["done-0-0.json", "done-1-1.json"]
    assert read(out, "loaded", 1, 0)["torch"] is False
    again = read(out, "loaded", 1, 1)
    assert again["torch"] is primed
    assert (again["pid"] in seen) is primed
    err = capsys.readouterr().err
    assert ("restarting as incarnation 1 (primed)" in err) is primed
    assert not _primed_pids()  # the other rank's, unused, was stopped with the job


@pytest.mark.timeout(150)
def test_a_primed_process_killed_while_it_waits_is_reported_and_started_again(
    tmp_path: Path, etcd_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # Both ranks' primed processes are SIGKILLed (as the OOM killer would): the
    # launcher says so and starts others, and rank 1's restart is one of those.
    script, out = make_script(
        tmp_path,
        """
wait_for("fail", timeout=100.0)
if RANK == 1 and INC == 0:
    sys.exit(3)
record("done")
""",
    )
    first: set[int] = set()
    second: set[int] = set()

    def watch() -> None:
        _wait_for_primed(first)
        for pid in first:
            os.kill(pid, signal.SIGKILL)
        _wait_for_primed(second, besides=first)
        (out / "fail").write_text("")

    cfg = config(script, out, nproc=2, etcd=etcd_url, max_restarts=1, primed_restarts=True)
    _run_watched(cfg, watch)

    err = capsys.readouterr().err
    for rank in (0, 1):
        assert (
            f"rank {rank}'s primed process exited (code -9 (SIGKILL)) before it was needed; "
            f"its output follows in the rank's log; another starts in" in err
        )
    assert "restarting as incarnation 1 (primed)" in err
    assert read(out, "done", 1, 1)["pid"] in second
    assert not _primed_pids()


@pytest.mark.timeout(90)
def test_a_warm_spare_takes_over_a_failed_rank(
    tmp_path: Path, etcd_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # The spare runs the script ahead, up to the gate recovery.Session waits at
    # (here called directly): it records how far it got before it was handed the
    # rank, which it is only once rank 1's first incarnation failed.
    script, out = make_script(
        tmp_path,
        """
from resilient.launch import standby

if standby.standing_by():
    record("ready")
    standby.wait_for_go()
    record("go", first_gone=(OUT / "failing-1-0.json").exists())
if RANK == 1 and INC == 0:
    wait_for("ready-1-1.json")
    record("failing")
    sys.exit(3)
record("done")
""",
    )
    cfg = config(script, out, nproc=2, etcd=etcd_url, max_restarts=1, warm_spares=True)

    assert Launcher(cfg).run() == 0

    assert read(out, "go", 1, 1)["first_gone"] is True
    assert read(out, "done", 1, 1)["pid"] == read(out, "ready", 1, 1)["pid"]
    assert records(out, "done") == ["done-0-0.json", "done-1-1.json"]
    assert "restarting as incarnation 1 (warm spare)" in capsys.readouterr().err


@pytest.mark.timeout(90)
def test_the_launcher_knows_when_a_spare_stands_ready(
    tmp_path: Path, etcd_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # The spare holds before its gate until the test has seen it warming; the
    # launcher learns it is ready only from the spare reaching the gate.
    script, out = make_script(
        tmp_path,
        """
from resilient.launch import standby

if standby.standing_by():
    record("warming")
    wait_for("release.json")
    standby.wait_for_go()
    record("go")
if INC == 0:
    wait_for("fail.json")
    sys.exit(3)
record("done")
""",
    )
    cfg = config(script, out, nproc=1, etcd=etcd_url, max_restarts=1, warm_spares=True)
    launcher = Launcher(cfg)
    codes: list[int] = []
    runner = threading.Thread(target=lambda: codes.append(launcher.run()))
    runner.start()
    try:
        assert wait_until(lambda: bool(records(out, "warming")), 30.0)
        assert launcher.spare_warming(0) is True
        (out / "release.json").write_text("{}")
        assert wait_until(lambda: not launcher.spare_warming(0), 30.0)
    finally:
        (out / "release.json").write_text("{}")
        (out / "fail.json").write_text("{}")
        runner.join(60.0)
        if runner.is_alive():  # a launcher that did not end: stop its ranks too
            launcher.request_stop()
            runner.join(30.0)

    assert codes == [0]
    assert launcher.spare_warming(0) is False  # not running any more
    assert records(out, "done") == ["done-0-1.json"]
    assert read(out, "go", 0, 1)["pid"] == read(out, "warming", 0, 1)["pid"]
    err = capsys.readouterr().err
    assert re.search(r"rank 0's warm spare stands ready \([0-9.]+ s after it started\)", err)
    assert "restarting as incarnation 1 (warm spare)" in err


@pytest.mark.timeout(90)
def test_a_spare_that_exits_before_it_is_needed_is_reported_and_the_rank_starts_cold(
    tmp_path: Path, etcd_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # A script that never reaches the gate runs to its end in the spare: the
    # launcher says so, and the lost rank then gets a cold start.
    script, out = make_script(
        tmp_path,
        """
from resilient.launch import standby

record("ran", standby=standby.standing_by())
if RANK == 1 and INC == 0:
    wait_for("ran-1-1.json")
    spare = json.loads((OUT / "ran-1-1.json").read_text())["pid"]
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # until the launcher reaped the spare
        try:
            os.kill(spare, 0)
        except ProcessLookupError:
            break
        time.sleep(0.02)
    sys.exit(3)
""",
    )
    cfg = config(script, out, nproc=2, etcd=etcd_url, max_restarts=1, warm_spares=True)

    assert Launcher(cfg).run() == 0

    err = capsys.readouterr().err
    assert "rank 1's warm spare exited (code 0) before it was needed" in err
    assert "restarting as incarnation 1 (warm spare)" not in err
    # The cold start overwrote the spare's record: it was not a standby.
    assert read(out, "ran", 1, 1)["standby"] is False


@pytest.mark.timeout(90)
def test_a_spare_killed_before_it_is_needed_is_started_again_and_takes_over(
    tmp_path: Path, etcd_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # The first spare is SIGKILLed (as the OOM killer would); the launcher starts
    # another, and that one takes the rank when its first incarnation fails.
    script, out = make_script(
        tmp_path,
        """
from resilient.launch import standby

if standby.standing_by():
    record("ready")
    standby.wait_for_go()
    record("go")
if RANK == 1 and INC == 0:
    wait_for("ready-1-1.json")
    first = json.loads((OUT / "ready-1-1.json").read_text())["pid"]
    os.kill(first, signal.SIGKILL)
    deadline = time.monotonic() + 40
    while json.loads((OUT / "ready-1-1.json").read_text())["pid"] == first:
        if time.monotonic() > deadline:
            sys.exit(90)
        time.sleep(0.05)
    record("killed", first=first)
    sys.exit(3)
record("done")
""",
    )
    cfg = config(script, out, nproc=2, etcd=etcd_url, max_restarts=1, warm_spares=True)

    assert Launcher(cfg).run() == 0

    err = capsys.readouterr().err
    assert "rank 1's warm spare exited (code -9 (SIGKILL)) before it was needed" in err
    assert "another starts in" in err
    assert "restarting as incarnation 1 (warm spare)" in err
    second = read(out, "go", 1, 1)["pid"]
    assert second != read(out, "killed", 1, 0)["first"]
    assert read(out, "done", 1, 1)["pid"] == second


@pytest.mark.timeout(60)
def test_the_restart_budget_is_published_for_the_ranks(tmp_path: Path, etcd_url: str) -> None:
    # A straggler weighs leaving by what would replace it (recovery.policy).
    script, out = make_script(
        tmp_path,
        """
from membership.members import Membership
from resilient.launch import standby
from resilient.config import RankEnv

standby.wait_for_go()  # a spare reads the budget once it takes the rank, as a session would
env = RankEnv.from_env()
members = Membership(env.etcd, env.membership())
budget = members.supervisor()
if INC == 0:
    # Its warm spare stands ready soon after: the budget says so (the policy prices
    # an eviction as warm only then).
    deadline = time.monotonic() + 30
    while 0 not in budget.get("ready", []) and time.monotonic() < deadline:
        time.sleep(0.05)
        budget = members.supervisor()
record("budget", **budget)
if INC == 0:
    sys.exit(3)
""",
    )
    cfg = config(script, out, nproc=1, etcd=etcd_url, max_restarts=1, warm_spares=True)

    assert Launcher(cfg).run() == 0

    before, after = read(out, "budget", 0, 0), read(out, "budget", 0, 1)
    assert (before["restarts_left"], before["warm_spares"], before["ready"]) == (1, True, [0])
    assert (after["restarts_left"], after["warm_spares"], after["ready"]) == (0, False, [])


@pytest.mark.timeout(90)
def test_a_rank_whose_lease_expires_while_it_runs_is_killed_and_restarted(
    tmp_path: Path, etcd_url: str, capsys: pytest.CaptureFixture[str]
) -> None:
    # SIGSTOP freezes the keep-alive thread too: the member lease expires.
    script, out = make_script(
        tmp_path,
        """
if INC == 0:
    from membership.members import Membership
    from resilient.config import RankEnv

    env = RankEnv.from_env()
    member = Membership(env.etcd, env.membership())
    member.join(RANK, INC, [], env.token)
    record("joined")
    os.kill(os.getpid(), signal.SIGSTOP)
record("done")
""",
    )
    cfg = config(script, out, nproc=1, etcd=etcd_url, max_restarts=1, lease_ttl_s=2.0)
    start = time.monotonic()

    assert Launcher(cfg).run() == 0

    assert time.monotonic() - start < 30
    assert records(out, "done") == ["done-0-1.json"]
    err = capsys.readouterr().err
    assert "rank 0 (incarnation 0) hung: its lease expired while it runs; killing it" in err
    assert "rank 0 hung (its lease expired) and was killed; restarting as incarnation 1" in err


@pytest.mark.timeout(90)
def test_metrics_show_ranks_restarts_and_events_while_the_job_runs(
    tmp_path: Path, etcd_url: str
) -> None:
    from resilient.procs import free_port

    script, out = make_script(
        tmp_path,
        """
if RANK == 1 and INC == 0:
    sys.exit(3)
wait_for("scraped", timeout=60)
record("done")
""",
    )
    port = free_port()
    cfg = config(
        script, out, nproc=2, etcd=etcd_url, max_restarts=1, metrics_port=port,
        run_dir=str(tmp_path / "run"), echo=False,
    )  # fmt: skip
    launcher = Launcher(cfg)
    codes: list[int] = []
    runner = threading.Thread(target=lambda: codes.append(launcher.run()))
    runner.start()
    text = ""
    try:

        def scraped() -> bool:
            nonlocal text
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=2) as r:
                    text = r.read().decode()
            except (urllib.error.URLError, ConnectionError):
                return False
            want = ('resilient_rank_incarnation{rank="1"} 1', 'state="running"} 2', "rank.lost")
            return all(w in text for w in want)

        assert wait_until(scraped, 30), text
    finally:
        (out / "scraped").write_text("")
        runner.join(60)
    assert codes == [0]
    assert 'resilient_ranks{state="running"} 2' in text
    assert "resilient_restarts_total 1" in text
    assert 'resilient_events_total{kind="rank.lost"} 1' in text
    assert "# TYPE resilient_restarts_total counter" in text


@pytest.mark.timeout(60)
@pytest.mark.parametrize("leaves", [True, False])
def test_a_rank_that_aborts_after_leaving_the_job_is_done_not_restarted(
    tmp_path: Path, etcd_url: str, capsys: pytest.CaptureFixture[str], leaves: bool
) -> None:
    # What a gloo group alive at interpreter exit does to a rank that finished: its
    # group shut down (the departure is in etcd), then the process aborts. Without
    # the departure the same abort is a crash mid-job, and the rank is restarted.
    script, out = make_script(
        tmp_path,
        f"""
if INC == 0:
    from membership.members import Membership
    from resilient.config import RankEnv

    env = RankEnv.from_env()
    member = Membership(env.etcd, env.membership())
    member.join(RANK, INC, [], env.token)
    if {leaves!r}:
        member.close()
    record("left")
    os.abort()
record("done")
""",
    )
    cfg = config(script, out, nproc=2, etcd=etcd_url, max_restarts=2, lease_ttl_s=5.0)

    assert Launcher(cfg).run() == 0

    err = capsys.readouterr().err
    if leaves:
        assert records(out, "start") == ["start-0-0.json", "start-1-0.json"]
        assert records(out, "done") == []
        assert "after it had left the job (its process group had shut down); not restarted" in err
        assert "all 2 rank(s) finished; rank 0 then exited with code -6 (SIGABRT)" in err
    else:
        assert records(out, "done") == ["done-0-1.json", "done-1-1.json"]
        assert "not restarted" not in err
