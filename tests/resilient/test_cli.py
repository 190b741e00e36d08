"""The ``resilient`` command line: help texts, errors as one line, pass-through of args."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from resilient.cli import main
from resilient.launch.launcher import RankVar

REPO = Path(__file__).resolve().parents[2]

# The launcher never contacts etcd itself, so runs of scripts that do not use it
# can be given an address where nothing listens, and skip starting an etcd.
NO_ETCD = "http://127.0.0.1:9"

RUN_FLAGS = (
    "--nproc",
    "--nproc-per-node",
    "--rails",
    "--etcd",
    "--job",
    "--max-restarts",
    "--log-dir",
    "--run-dir",
    "--lease-ttl",
    "--grace",
)


def python_env() -> dict[str, str]:
    path = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    return {**os.environ, "PYTHONPATH": path}


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(
        "import json, os, sys\n"
        "out = os.environ['OUT_FILE']\n"
        "with open(out, 'w') as f:\n"
        "    json.dump({'argv': sys.argv[1:], 'world': os.environ['WORLD_SIZE']}, f)\n"
        "sys.exit(int(os.environ.get('EXIT_CODE', '0')))\n"
    )
    return path


@pytest.mark.timeout(10)
def test_run_help_explains_every_flag_and_the_rank_env(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["run", "--help"]) == 0
    out = capsys.readouterr().out
    for flag in RUN_FLAGS:
        assert flag in out
    for var in RankVar:
        assert var.value in out
    assert "script" in out and "restart" in out


@pytest.mark.timeout(10)
def test_chaos_help_and_usage_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["chaos", "--help"]) == 0
    out = capsys.readouterr().out
    assert "fault-injection scenario (TOML)" in out and "report.json" in out
    assert main(["chaos"]) == 2  # the scenario is required
    bad = tmp_path / "bad.toml"
    bad.write_text('[job]\nscript = "x.py"\nnproc = 0\n')
    assert main(["chaos", str(bad)]) == 2
    assert "job.nproc" in capsys.readouterr().err
    assert main(["chaos", str(tmp_path / "missing.toml")]) == 2


@pytest.mark.timeout(10)
def test_top_level_help_lists_the_commands(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--help"]) == 0
    out = capsys.readouterr().out
    for command in ("run", "chaos", "events"):
        assert command in out


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "flags",
    [
        ["--nproc", "0"],
        ["--nproc", "abc"],
        ["--rails", "0"],
        ["--max-restarts", "-1"],
        ["--lease-ttl", "1"],
        ["--grace", "0"],
        ["--job", "bad name!"],
        ["--etcd", "ftp://host:1"],
        ["--log-dir", "__SCRIPT__"],
    ],
)
def test_bad_values_give_one_error_line_and_exit_2(
    flags: list[str], script: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    flags = [str(script) if f == "__SCRIPT__" else f for f in flags]
    assert main(["run", *flags, str(script)]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 1, captured.err
    assert lines[0].startswith("resilient: error: ")
    assert "Traceback" not in captured.err


@pytest.mark.timeout(10)
@pytest.mark.parametrize("argv", [["run", "/nonexistent/train.py"], ["run"], [], ["bogus"]])
def test_usage_errors_are_one_line(argv: list[str], capsys: pytest.CaptureFixture[str]) -> None:
    assert main(argv) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("resilient: error: ")


@pytest.mark.timeout(30)
def test_launcher_error_is_one_line(
    script: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    run_dir = script / "run"  # under a file: cannot be created
    assert main(["run", "--etcd", NO_ETCD, "--run-dir", str(run_dir), str(script)]) == 2
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith("resilient: error: cannot create directory")


@pytest.mark.timeout(30)
def test_script_args_pass_through_untouched(
    script: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    out = tmp_path / "seen.json"
    monkeypatch.setenv("OUT_FILE", str(out))
    args = ["--nproc", "7", "-x", "--", "positional", "--max-restarts=3"]

    code = main(["run", "--nproc-per-node", "1", "--etcd", NO_ETCD, str(script), *args])

    assert code == 0
    assert json.loads(out.read_text()) == {"argv": args, "world": "1"}


@pytest.mark.timeout(30)
def test_job_exit_code_is_the_command_exit_code(
    script: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("OUT_FILE", str(tmp_path / "seen.json"))
    monkeypatch.setenv("EXIT_CODE", "3")
    assert main(["run", "--etcd", NO_ETCD, "--grace", "1", str(script)]) == 3


@pytest.mark.timeout(60)
def test_python_dash_m_resilient_and_import_stays_light(tmp_path: Path) -> None:
    help_run = subprocess.run(
        [sys.executable, "-m", "resilient", "run", "--help"],
        cwd=tmp_path,
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert help_run.returncode == 0, help_run.stderr
    assert "--max-restarts" in help_run.stdout
    probe = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, resilient.cli; print(sorted({'torch', 'grpc'} & set(sys.modules)))",
        ],
        cwd=tmp_path,
        env=python_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert probe.returncode == 0, probe.stderr
    assert probe.stdout.strip() == "[]"


@pytest.mark.timeout(30)
def test_token_from_launcher_env_reaches_ranks(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    script = tmp_path / "tok.py"
    out = tmp_path / "tok.txt"
    script.write_text(f"import os\nopen({str(out)!r}, 'w').write(os.environ['RESILIENT_TOKEN'])\n")
    monkeypatch.setenv("RESILIENT_TOKEN", "rejoin-secret")
    assert main(["run", "--etcd", NO_ETCD, str(script)]) == 0
    assert out.read_text() == "rejoin-secret"
    monkeypatch.delenv("RESILIENT_TOKEN")
    assert main(["run", "--etcd", NO_ETCD, str(script)]) == 0
    generated = out.read_text()
    assert generated and generated != "rejoin-secret"
