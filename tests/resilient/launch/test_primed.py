"""A spare node's primed ranks (resilient.launch.primed): real processes past
``import torch``, handed a rank's environment and script."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from resilient.launch.handover import handover_line, parse_handover
from resilient.launch.spares import PrimedRanks

# What the script sees: its environment, argv, stdin, and whether torch was imported
# before its first line ran.
_SCRIPT = """
import json, os, sys
seen = {
    "torch_before": "torch" in sys.modules,
    "rank": os.environ.get("RANK"),
    "node_only": os.environ.get("PRIMED_NODE_ONLY"),
    "argv": sys.argv,
    "stdin": sys.stdin.read(),
    "main": __name__,
}
with open(sys.argv[1], "w") as f:
    json.dump(seen, f)
sys.exit(int(sys.argv[2]))
"""


def test_a_hand_over_line_round_trips_and_bad_ones_say_what_is_wrong() -> None:
    env, argv = {"RANK": "3"}, ["train.py", "--x"]
    assert parse_handover(handover_line(env, argv)) == (env, argv)
    for bad, why in [
        (b"not json\n", "not JSON"),
        (b"[1]\n", "env"),
        (b'{"env": {"A": 1}, "argv": ["s"]}\n', "env"),
        (b'{"env": {}, "argv": []}\n', "argv"),
        (b'{"env": {}, "argv": [3]}\n', "argv"),
    ]:
        with pytest.raises(ValueError, match=why):
            parse_handover(bad)


@pytest.mark.timeout(120)
def test_a_primed_rank_runs_the_script_in_exactly_the_rank_environment(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text(_SCRIPT)
    node_env = {**os.environ, "PRIMED_NODE_ONLY": "yes"}
    primed = PrimedRanks(2, node_env)
    try:
        assert len(primed.procs) == 2
        rank_env = {k: v for k, v in os.environ.items() if k != "PRIMED_NODE_ONLY"}
        rank_env["RANK"] = "5"
        out = tmp_path / "seen.json"
        proc = primed.take(rank_env, [str(script), str(out), "7"])
        assert proc is not None and len(primed.procs) == 1
        assert proc.wait(timeout=90) == 7  # the script's own exit code
        seen = json.loads(out.read_text())
        assert seen == {
            "torch_before": True,
            "rank": "5",
            "node_only": None,  # the rank's environment replaced the node's
            "argv": [str(script), str(out), "7"],
            "stdin": "",
            "main": "__main__",
        }
    finally:
        left = primed.procs
        primed.close()
    # The one never handed a rank exits 0 at end of file.
    assert [p.wait(timeout=90) for p in left] == [0]


@pytest.mark.timeout(120)
def test_a_bad_hand_over_exits_2_and_says_why() -> None:
    cmd = [sys.executable, "-m", "resilient.launch.primed"]
    done = subprocess.run(cmd, input=b"{}\n", capture_output=True, timeout=90, check=False)
    assert done.returncode == 2
    assert b"resilient.launch.primed: the hand-over's env" in done.stderr


def test_with_none_left_the_caller_starts_the_rank_cold() -> None:
    assert PrimedRanks(0, {}).take({}, ["train.py"]) is None
