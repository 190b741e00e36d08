"""Scenario files: a valid file round-trips; each kind of mistake names its key."""

from __future__ import annotations

from pathlib import Path

import pytest

from chaos.scenario import ScenarioError, load, parse
from resilient.errors import ConfigError

GOOD = """
name = "nic-down"
[job]
script = "examples/train_ddp.py"
args = ["--steps", "100"]
nproc = 4
rails = 2
steps = 100
topology = "netns"

[[fault]]
kind = "nic-down"
rank = 1
rail = 0
at_step = 30
duration_s = 5

[[fault]]
kind = "throttle"
rank = 2
rail = 1
rate_mbit = 100
at_s = 2.5

[expect]
completes = true
max_steps_replayed = 0
params_equal_fault_free = true
max_detect_ms = 100
"""


@pytest.mark.timeout(10)
def test_valid_scenario() -> None:
    sc = parse(GOOD)
    assert sc.name == "nic-down"
    assert sc.job.nproc == 4 and sc.job.args == ("--steps", "100") and sc.job.topology == "netns"
    assert [f.kind for f in sc.faults] == ["nic-down", "throttle"]
    assert sc.faults[0].at_step == 30 and sc.faults[0].duration_s == 5.0
    assert sc.faults[1].at_s == 2.5 and sc.faults[1].param("rate_mbit") == 100.0
    assert sc.expect.max_detect_ms == 100.0 and sc.expect.params_equal_across_ranks is None


def _with(old: str, new: str) -> str:
    assert old in GOOD
    return GOOD.replace(old, new, 1)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "text,key,words",
    [
        ("[job\nscript=1", "(syntax)", "TOML"),
        ('name = "x"', "job", "missing"),
        (_with('script = "examples/train_ddp.py"\n', ""), "job.script", "missing"),
        (_with("nproc = 4", 'nproc = "four"'), "job.nproc", "expected int"),
        (_with("nproc = 4", "nproc = 0"), "job.nproc", ">= 1"),
        (
            _with("nproc = 4", "nproc = 4\nevict_stragglers = true\nmax_restarts = 0"),
            "job.evict_stragglers",
            "must be replaced or left out",
        ),
        (_with("rank = 1\nrail = 0", "rank = 1\nrail = 0\npin = true"), "fault[0].pin", "unknown"),
        (_with('topology = "netns"', 'topology = "k8s"'), "job.topology", "netns or loopback"),
        (_with('kind = "nic-down"', 'kind = "nic-explode"'), "fault[0].kind", "must be one of"),
        (_with("rank = 1\nrail = 0", "rank = 9\nrail = 0"), "fault[0].rank", "0..3"),
        (_with("rail = 1\nrate_mbit = 100", "rail = 1"), "fault[1].rate_mbit", "missing"),
        (_with("at_step = 30", "at_step = 30\nat_s = 1.0"), "fault[0].at_step", "exactly one"),
        (_with("at_step = 30", ""), "fault[0].at_step", "exactly one"),
        (_with("duration_s = 5", "duraton_s = 5"), "fault[0].duraton_s", "unknown key"),
        (
            _with("max_steps_replayed = 0", "max_steps_replayed = true"),
            "expect.max_steps_replayed",
            "integer",
        ),
        (_with("completes = true", "completes = 1"), "expect.completes", "expected bool"),
        (
            _with("completes = true", "completes = true\nparams_close_fault_free = 2"),
            "expect.params_close_fault_free",
            "relative tolerance",
        ),
        (_with("[expect]", "[expectations]"), "expectations", "unknown key"),
    ],
)
def test_mistakes_name_the_key(text: str, key: str, words: str) -> None:
    with pytest.raises(ScenarioError) as info:
        parse(text, source="bad.toml")
    assert info.value.key == key
    assert words in info.value.problem
    assert str(info.value).startswith("bad.toml: " + key)
    assert isinstance(info.value, ConfigError)


@pytest.mark.timeout(10)
def test_load_from_file_and_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "kill-rank.toml"
    path.write_text(GOOD.replace('name = "nic-down"\n', ""))
    assert load(path).name == "kill-rank"  # defaults to the file's stem
    with pytest.raises(ScenarioError, match="cannot read"):
        load(tmp_path / "nope.toml")


@pytest.mark.parametrize(
    "path",
    sorted((Path(__file__).resolve().parents[2] / "examples" / "scenarios").glob("*.toml")),
    ids=lambda p: p.name,
)
def test_every_shipped_scenario_parses(path: Path) -> None:
    scenario = load(path)
    assert scenario.faults or scenario.name == "demo", path


NODES = """
[job]
script = "examples/train_ddp.py"
nodes = 2
ranks_per_node = 2
rails = 2
topology = "netns"
min_ranks = 2

[[fault]]
kind = "node-kill"
node = 1
at_step = 40
"""


@pytest.mark.timeout(10)
def test_nodes_give_the_world_size_and_node_faults_their_ranks() -> None:
    sc = parse(NODES)
    assert (sc.job.nodes, sc.job.ranks_per_node, sc.job.nproc) == (2, 2, 4)
    assert sc.faults[0].params == {"node": 1, "ranks": (2, 3)}
    assert sc.job.etcd_members == 3  # machines get etcd as deployed, unless told
    assert parse(_nodes_with("min_ranks = 2", "etcd_members = 1")).job.etcd_members == 1
    assert sc.job.spare_nodes == 0
    assert parse(_nodes_with("min_ranks = 2", "spare_nodes = 1")).job.spare_nodes == 1
    one = parse(GOOD)
    assert (one.job.nodes, one.job.ranks_per_node) == (1, 1)  # one rank per host
    assert one.job.etcd_members == 1


@pytest.mark.timeout(10)
def test_etcd_leader_kill_needs_three_members() -> None:
    leader = '[[fault]]\nkind = "etcd-leader-kill"\nat_s = 1.0\n'
    assert parse(NODES + leader).faults[1].kind == "etcd-leader-kill"
    with pytest.raises(ScenarioError) as err:
        parse(_nodes_with("min_ranks = 2", "etcd_members = 1") + leader, source="s.toml")
    assert err.value.key == "fault[1].kind" and "etcd_members >= 3" in str(err.value)


def _nodes_with(old: str, new: str) -> str:
    assert old in NODES
    return NODES.replace(old, new, 1)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    ("text", "key", "words"),
    [
        (_nodes_with("nodes = 2", "nodes = 1"), "job.nodes", "must be >= 2"),
        (_nodes_with("ranks_per_node = 2", "nproc = 4"), "job.nproc", "give ranks_per_node"),
        (_nodes_with("ranks_per_node = 2\n", ""), "job.ranks_per_node", "missing"),
        (_nodes_with("ranks_per_node = 2", "ranks_per_node = 0"), "job.ranks_per_node", ">= 1"),
        (_nodes_with("nodes = 2\n", ""), "job.ranks_per_node", "only with nodes"),
        (_nodes_with("min_ranks = 2", "spare_nodes = -1"), "job.spare_nodes", ">= 0"),
        (_with("nproc = 4", "nproc = 4\nspare_nodes = 1"), "job.spare_nodes", "only with nodes"),
        (_nodes_with("min_ranks = 2", "warm_spares = true"), "job.warm_spares", "not with nodes"),
        (
            _nodes_with("min_ranks = 2", "evict_stragglers = true\nmax_restarts = 1"),
            "job.evict_stragglers",
            "--nnodes",
        ),
        (_nodes_with("min_ranks = 2", "min_ranks = 5"), "job.min_ranks", "1..nproc (4)"),
        (_nodes_with("node = 1", "node = 2"), "fault[0].node", "a node of the job (0..1)"),
        (_nodes_with("node = 1\n", ""), "fault[0].node", "missing"),
        (
            _with('kind = "nic-down"\nrank = 1\nrail = 0', 'kind = "node-kill"\nnode = 0'),
            "fault[0].kind",
            "needs [job] nodes >= 2",
        ),
        (
            _nodes_with(
                'kind = "node-kill"\nnode = 1', 'kind = "partition"\nrank = 2\npeer = 3\nrail = 0'
            ),
            "fault[0].peer",
            "share node 1",
        ),
        (
            _nodes_with('topology = "netns"', 'topology = "loopback"').replace(
                'kind = "node-kill"\nnode = 1', 'kind = "node-partition"\nnode = 1'
            ),
            "fault[0].kind",
            'needs topology = "netns"',
        ),
    ],
)
def test_node_mistakes_name_the_key(text: str, key: str, words: str) -> None:
    with pytest.raises(ScenarioError) as err:
        parse(text, source="s.toml")
    assert err.value.key == key and words in str(err.value), str(err.value)


@pytest.mark.timeout(10)
def test_a_detection_bound_in_steps_is_a_whole_number() -> None:
    sc = parse(_with("max_detect_ms = 100", "max_detect_steps = 20"))
    assert sc.expect.max_detect_steps == 20 and sc.expect.max_detect_ms is None
    assert parse(GOOD).expect.max_detect_steps is None
    with pytest.raises(ScenarioError) as info:
        parse(_with("max_detect_ms = 100", "max_detect_steps = 2.5"), source="bad.toml")
    assert info.value.key == "expect.max_detect_steps"
