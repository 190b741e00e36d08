"""The soak's fault draw and leak check (chaos.soak): pure logic."""

from __future__ import annotations

import pytest

from chaos.soak import FD_SLACK, draw_faults, leaks, soak_scenario

pytestmark = pytest.mark.timeout(10)


def test_a_seed_draws_the_same_faults_one_at_a_time_within_the_window() -> None:
    faults = draw_faults(7, 600.0)
    assert faults == draw_faults(7, 600.0)
    assert faults != draw_faults(8, 600.0)
    assert len({f.kind for f in faults}) >= 5  # the whole matrix over ten minutes
    ends = 0.0
    for f in faults:
        assert f.at_s is not None and 10.0 <= f.at_s < 0.8 * 600.0
        assert f.at_s >= ends  # the previous one is undone first
        ends = f.at_s + (f.duration_s or 0.0)
        assert 0 <= f.params["rank"] < 4
        if "rail" in f.params:
            assert 0 <= f.params["rail"] < 2
        if "peer" in f.params:
            assert f.params["peer"] != f.params["rank"]


def test_with_one_rail_no_fault_leaves_a_pair_without_a_path() -> None:
    kinds = {f.kind for seed in range(5) for f in draw_faults(seed, 600.0, rails=1)}
    assert not kinds & {"nic-down", "flap", "partition"}


def test_the_scenario_budgets_a_restart_per_kill_and_hang() -> None:
    s = soak_scenario(300.0, 3, steps_per_s=5.0)
    assert soak_scenario(300.0, 3).job.steps == 4500  # 15 steps/s by default
    replaced = sum(f.kind in ("kill", "hang") for f in s.faults)
    assert s.job.max_restarts == replaced + 1 and s.job.steps == 1500
    assert s.expect.completes and s.expect.params_equal_across_ranks
    with pytest.raises(ValueError, match="30 s"):
        soak_scenario(10.0, 0)


def test_leaks_name_what_was_left_and_what_grew() -> None:
    report = {
        "etcd_stray_keys": ["/elsewhere/x"],
        "resources": {
            "0": {"fds": [40, 40 + FD_SLACK], "threads": [12, 13]},
            "1": {"fds": [40, 41 + FD_SLACK], "threads": [12, 30]},
        },
    }
    found = leaks(report, ["netns rsl-a-sw"], ["netns rsl-a-sw", "qdisc lo"], [4242])
    assert found == [
        "left in the kernel: qdisc lo",
        "child process 4242 still running",
        "etcd key outside the jobs' prefixes: /elsewhere/x",
        f"rank 1: fds grew from 40 to {41 + FD_SLACK} (slack {FD_SLACK})",
        "rank 1: threads grew from 12 to 30 (slack 4)",
    ]
    assert leaks({"resources": {}}, [], [], []) == []
