"""Node agents' configuration: global ranks, the flags, Slurm/Kubernetes defaults,
and bad input from the command line (no process is started)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from resilient import cli
from resilient.config import scheduler_env
from resilient.errors import ConfigError
from resilient.launch.launch_config import LaunchConfig

ETCD = "http://127.0.0.1:2379"


@pytest.fixture
def script(tmp_path: Path) -> str:
    path = tmp_path / "train.py"
    path.write_text("pass\n")
    return str(path)


def test_global_ranks_are_node_rank_times_nproc_plus_local_rank(script: str) -> None:
    cfg = LaunchConfig(nproc=3, nnodes=4, node_rank=2, etcd=ETCD, script=script, rails=2)
    assert cfg.world_size == 12 and cfg.first_rank == 6
    assert [cfg.global_rank(local) for local in range(3)] == [6, 7, 8]
    # Loopback rails by global rank: no two ranks of the job share an address.
    assert cfg.rails_of(7) == ("127.0.1.8", "127.0.2.8")
    # Deterministic: another agent (or a restart) computes the same.
    again = LaunchConfig(nproc=3, nnodes=4, node_rank=2, etcd=ETCD, script=script, rails=2)
    assert [again.global_rank(local) for local in range(3)] == [6, 7, 8]


def test_one_node_is_todays_launch(script: str) -> None:
    cfg = LaunchConfig(nproc=4, script=script)
    assert (cfg.nnodes, cfg.node_rank, cfg.world_size, cfg.first_rank) == (1, 0, 4, 0)
    assert cfg.rails_of(3) == ("127.0.1.4",)


def test_ranks_fence_themselves_only_when_asked(
    script: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # RESILIENT_FENCE in the agent's environment reaches every rank (off by default:
    # docs/DEPLOY.md says why).
    from resilient.config import RankEnv

    cfg = LaunchConfig(nproc=2, nnodes=2, node_rank=1, etcd=ETCD, script=script)

    def fence() -> bool:
        env = cfg.environ(2, 0, master_addr="127.0.0.1", master_port=29500, etcd_url=ETCD)
        return RankEnv.from_env(env).fence

    monkeypatch.delenv("RESILIENT_FENCE", raising=False)
    assert not fence()
    monkeypatch.setenv("RESILIENT_FENCE", "1")
    assert fence()


def test_rail_names_are_handed_to_every_rank_of_the_node(script: str) -> None:
    cfg = LaunchConfig(
        nproc=2, nnodes=2, node_rank=1, etcd=ETCD, script=script, rail_names=("eth0", "eth1")
    )
    assert cfg.rails == 2 and cfg.rails_of(2) == cfg.rails_of(3) == ("eth0", "eth1")


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"nnodes": 2, "node_rank": 2, "etcd": ETCD}, "node_rank=2: must be between 0 and 1"),
        ({"nnodes": 0}, "nnodes=0"),
        ({"nnodes": 2}, "every node agent must reach the same etcd"),
        ({"nnodes": 2, "etcd": ETCD, "join_timeout_s": 0.0}, "join_timeout_s"),
        ({"nnodes": 2, "etcd": ETCD, "min_ranks": 5}, "min_ranks=5: must be between 1 and 4"),
        ({"nnodes": 2, "etcd": ETCD, "rail_names": ("eth0", "")}, "rail_names"),
        ({"nnodes": 200, "etcd": ETCD}, "400 ranks on loopback rails"),
        (
            {"nnodes": 2, "etcd": ETCD, "evict_stragglers": True, "max_restarts": 1},
            "not built for several nodes",
        ),
        ({"spare": True}, "a spare node stands by for a job of several"),
        ({"min_nodes": 1}, "min_nodes: for a job of several nodes"),
        ({"nnodes": 2, "etcd": ETCD, "min_nodes": 3}, "min_nodes=3: must be between 1 and 2"),
        ({"nnodes": 2, "etcd": ETCD, "min_nodes": 1, "min_ranks": 3}, "give one of them"),
    ],
)
def test_bad_node_settings_are_refused(script: str, kwargs: dict[str, Any], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        LaunchConfig(nproc=2, script=script, **kwargs)


@pytest.mark.parametrize(
    ("env", "expected"),
    [
        ({}, (None, None, "")),
        ({"SLURM_NODEID": "3", "SLURM_NNODES": "4", "SLURM_JOB_ID": "81234"}, (3, 4, "81234")),
        ({"JOB_COMPLETION_INDEX": "2"}, (2, None, "")),
        # Slurm's node id wins over a stray Kubernetes index.
        ({"SLURM_NODEID": "1", "JOB_COMPLETION_INDEX": "5"}, (1, None, "")),
        ({"SLURM_NODEID": "", "JOB_COMPLETION_INDEX": "0"}, (0, None, "")),
    ],
)
def test_scheduler_env(env: dict[str, str], expected: tuple[Any, ...]) -> None:
    assert scheduler_env(env) == expected


@pytest.mark.parametrize("name", ["SLURM_NODEID", "JOB_COMPLETION_INDEX", "SLURM_NNODES"])
def test_scheduler_env_names_a_malformed_variable(name: str) -> None:
    with pytest.raises(ConfigError, match=f"{name}='x'"):
        scheduler_env({name: "x"})


class _Captured:
    configs: list[LaunchConfig] = []

    def __init__(self, config: LaunchConfig) -> None:
        self.configs.append(config)

    def run(self) -> int:
        return 0


@pytest.fixture
def captured(monkeypatch: pytest.MonkeyPatch) -> list[LaunchConfig]:
    for name in ("SLURM_NODEID", "JOB_COMPLETION_INDEX", "SLURM_NNODES", "SLURM_JOB_ID"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RESILIENT_TOKEN", "s3cret")
    monkeypatch.setattr(cli, "Launcher", _Captured)
    _Captured.configs = []
    return _Captured.configs


def test_cli_torchrun_flags(captured: list[LaunchConfig], script: str) -> None:
    argv = ["run", "--nnodes", "2", "--node-rank", "1", "--nproc-per-node", "2"]
    argv += ["--etcd", ETCD, "--job", "j1", "--rails", "eth0,eth1", script, "--lr", "1"]
    assert cli.main(argv) == 0
    (cfg,) = captured
    assert (cfg.nnodes, cfg.node_rank, cfg.nproc, cfg.job, cfg.token) == (2, 1, 2, "j1", "s3cret")
    assert cfg.rail_names == ("eth0", "eth1") and cfg.script_args == ("--lr", "1")


def test_cli_nproc_alone_is_one_node(captured: list[LaunchConfig], script: str) -> None:
    assert cli.main(["run", "--nproc", "3", "--rails", "2", script]) == 0
    (cfg,) = captured
    assert (cfg.nnodes, cfg.node_rank, cfg.world_size, cfg.rails, cfg.master_addr) == (
        1, 0, 3, 2, "127.0.0.1",
    )  # fmt: skip


def test_cli_defaults_from_slurm(
    captured: list[LaunchConfig], script: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("SLURM_NODEID", "2")
    monkeypatch.setenv("SLURM_NNODES", "3")
    monkeypatch.setenv("SLURM_JOB_ID", "4711")
    assert cli.main(["run", "--nproc-per-node", "2", "--etcd", ETCD, script]) == 0
    (cfg,) = captured
    assert (cfg.nnodes, cfg.node_rank, cfg.job, cfg.first_rank) == (3, 2, "4711", 4)


def test_cli_defaults_from_a_kubernetes_indexed_job(
    captured: list[LaunchConfig], script: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("JOB_COMPLETION_INDEX", "1")
    argv = ["run", "--nnodes", "2", "--etcd", ETCD, "--job", "k", script]
    assert cli.main(argv) == 0
    assert captured[0].node_rank == 1
    # Flags win over the environment.
    assert cli.main([*argv[:1], "--node-rank", "0", *argv[1:]]) == 0
    assert captured[1].node_rank == 0


def test_cli_refuses_several_nodes_without_a_shared_token(
    captured: list[LaunchConfig],
    script: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.delenv("RESILIENT_TOKEN")
    assert cli.main(["run", "--nnodes", "2", "--etcd", ETCD, script]) == 2
    assert "RESILIENT_TOKEN" in capsys.readouterr().err and not captured


def test_min_nodes_is_min_ranks_in_whole_nodes(script: str) -> None:
    cfg = LaunchConfig(nproc=4, nnodes=3, etcd=ETCD, script=script, min_nodes=2)
    assert cfg.min_ranks == 8
    assert LaunchConfig(nproc=4, nnodes=3, etcd=ETCD, script=script, min_nodes=2, min_ranks=8)


@pytest.mark.parametrize(
    ("nnodes", "extra", "want"),
    [
        ("3", [], (3, None)),
        ("2:3", [], (3, 4)),  # torchrun's MIN:MAX: three nodes start, two must stay
        ("3:3", [], (3, None)),  # a fixed size
        ("2:3", ["--min-nodes", "2"], (3, 4)),
    ],
)
def test_cli_nnodes_takes_torchruns_min_max(
    captured: list[LaunchConfig],
    script: str,
    nnodes: str,
    extra: list[str],
    want: tuple[int, int | None],
) -> None:
    argv = ["run", "--nnodes", nnodes, "--nproc-per-node", "2", "--etcd", ETCD, *extra, script]
    assert cli.main(argv) == 0
    (cfg,) = captured
    assert (cfg.nnodes, cfg.min_ranks) == want


@pytest.mark.parametrize(
    ("nnodes", "extra", "error"),
    [
        ("3:2", [], "'3:2': need 1 <= MIN <= MAX"),
        ("0:2", [], "'0:2': need 1 <= MIN <= MAX"),
        ("2:x", [], "'2:x': a node count N or a range MIN:MAX"),
        ("2:3", ["--min-nodes", "1"], "--nnodes 2:3 and --min-nodes 1 disagree"),
    ],
)
def test_cli_nnodes_range_errors_name_the_flag(
    captured: list[LaunchConfig],
    script: str,
    capsys: pytest.CaptureFixture[str],
    nnodes: str,
    extra: list[str],
    error: str,
) -> None:
    argv = ["run", "--nnodes", nnodes, "--nproc-per-node", "2", "--etcd", ETCD, *extra, script]
    assert cli.main(argv) == 2
    assert error in capsys.readouterr().err and not captured


def test_cli_spare_and_min_nodes(
    captured: list[LaunchConfig],
    script: str,
    monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    monkeypatch.setenv("SLURM_NODEID", "2")  # a spare's own place in Slurm means nothing
    argv = ["run", "--nnodes", "2", "--nproc-per-node", "2", "--etcd", ETCD, "--job", "s"]
    assert cli.main([*argv, "--spare", "--min-nodes", "1", script]) == 0
    (cfg,) = captured
    assert cfg.spare and cfg.node_rank == 0 and cfg.min_ranks == 2
    assert cli.main([*argv, "--spare", "--node-rank", "1", script]) == 2
    assert "a spare node takes the node rank of the node it replaces" in capsys.readouterr().err
