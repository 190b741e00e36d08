"""Soak: one long run with faults drawn from the whole matrix, and nothing may leak.

``resilient chaos --soak DURATION --seed S`` builds a scenario (:func:`soak_scenario`):
``examples/train_ddp.py`` on the netns testbed, and from 10 s on one fault at a time,
each bounded and undone before the next, drawn by ``S`` from every kind a 4-rank,
2-rail job survives without leaving a rank out (NIC down, flap, throttle, drop, a
partition of one pair on one rail, a CPU straggler, a kill, a hang). It checks:

* the run's own expectations: every step completes on every rank, parameters
  equal across ranks;
* nothing leaks (:func:`leaks`): no kernel object of ours left (namespaces, links,
  qdiscs, iptables rules, cgroups: :func:`chaos.cleanup.our_objects`), no child
  process left, no etcd key outside a job's prefix, and no rank's open file
  descriptors or threads grew between its first records after the warm-up and its
  last (beyond a small slack: a link rebuilt on another rail is a socket more).

The run lasts about DURATION: its steps are DURATION times ``steps_per_s``, the
rate this job runs at (15 steps/s on the 2-core development host when quiet; a
slower or busier machine runs longer, bounded by the scenario's timeout, a faster
one ends sooner and leaves the last faults unfired: the report counts them); the
faults are drawn over the first 80 % of DURATION.
"""

from __future__ import annotations

import json
import os
import random
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any, Final

from chaos.cleanup import our_objects
from chaos.cpu_throttle import descendants
from chaos.scenario import Expectations, Fault, JobSpec, Scenario
from resilient.errors import ChaosError

_EXAMPLE: Final = Path(__file__).resolve().parents[1] / "examples" / "train_ddp.py"

__all__ = ["FD_SLACK", "THREAD_SLACK", "draw_faults", "leaks", "run_soak", "soak_scenario"]

FD_SLACK: Final = 8  # sockets of links rebuilt on another rail, a log reopened
THREAD_SLACK: Final = 4  # a repair or standby thread alive at the last record
_FIRST_S: Final = 10.0  # after the job's first step (chaos.runner): fault-free
_GAP_S: Final = 6.0  # after a fault is undone: the job settles before the next
_REPLACE_GAP_S: Final = 20.0  # after a kill or hang: a replacement is admitted, settled


def _draw(rng: random.Random, kind: str, nproc: int, rails: int) -> tuple[dict[str, Any], float]:
    """``kind``'s parameters and how long it lasts (0: a kill, undone by a restart)."""
    rank = rng.randrange(nproc)
    peer = rng.choice([r for r in range(nproc) if r != rank])
    rail = rng.randrange(rails)
    table: dict[str, tuple[dict[str, Any], float]] = {
        "nic-down": ({"rank": rank, "rail": rail}, round(rng.uniform(2.0, 4.0), 1)),
        "flap": ({"rank": rank, "rail": rail, "period_s": 0.2, "count": 10}, 0.0),
        "throttle": ({"rank": rank, "rail": rail, "rate_mbit": rng.choice([50.0, 100.0])}, 4.0),
        "drop": ({"rank": rank, "rail": rail, "percent": rng.choice([2.0, 5.0])}, 4.0),
        "partition": ({"rank": rank, "peer": peer, "rail": rail}, round(rng.uniform(3.0, 5.0), 1)),
        "slow-cpu": ({"rank": rank, "factor": 0.6}, 5.0),
        "kill": ({"rank": rank}, 0.0),
        "hang": ({"rank": rank}, 0.0),
    }
    return table[kind]


def draw_faults(
    seed: int, duration_s: float, *, nproc: int = 4, rails: int = 2
) -> tuple[Fault, ...]:
    """One fault at a time over the first 80 % of ``duration_s``, drawn by ``seed``
    (the same seed draws the same faults)."""
    rng = random.Random(seed)
    kinds = ["nic-down", "flap", "throttle", "drop", "partition", "slow-cpu", "kill", "hang"]
    if rails < 2:  # a NIC down or a partition with no other rail is a stall, not a reroute
        kinds = [k for k in kinds if k not in ("nic-down", "flap", "partition")]
    faults: list[Fault] = []
    at = _FIRST_S
    while at < 0.8 * duration_s:
        kind = rng.choice(kinds)
        params, lasts = _draw(rng, kind, nproc, rails)
        faults.append(Fault(kind=kind, at_s=round(at, 1), duration_s=lasts or None, params=params))
        settle = _REPLACE_GAP_S if kind in ("kill", "hang") else _GAP_S
        at += (lasts or 2.0) + settle
    return tuple(faults)


def soak_scenario(
    duration_s: float, seed: int, *, nproc: int = 4, rails: int = 2, steps_per_s: float = 15.0
) -> Scenario:
    """The soak's scenario (see the module docstring).

    Raises:
        ValueError: a duration under 30 s, or a rate that is not positive.
    """
    if duration_s < 30.0 or not steps_per_s > 0:
        raise ValueError(f"a soak needs >= 30 s and a rate > 0, got {duration_s} s, {steps_per_s}")
    faults = draw_faults(seed, duration_s, nproc=nproc, rails=rails)
    replaced = sum(f.kind in ("kill", "hang") for f in faults)
    script = str(_EXAMPLE) if _EXAMPLE.is_file() else "examples/train_ddp.py"
    job = JobSpec(
        script=script, args=("--width", "256", "--quiet"), nproc=nproc,
        rails=rails, steps=max(100, int(duration_s * steps_per_s)), topology="netns",
        seed=seed, max_restarts=replaced + 1, timeout_s=3.0 * duration_s + 120.0,
    )  # fmt: skip
    expect = Expectations(completes=True, params_equal_across_ranks=True)
    return Scenario(
        name=f"soak-{int(duration_s)}s-seed{seed}", job=job, faults=faults, expect=expect
    )


def leaks(
    report: Mapping[str, Any], objects_before: Sequence[str], objects_after: Sequence[str],
    children: Sequence[int],
) -> list[str]:  # fmt: skip
    """What the run left behind or let grow, one line each (empty: nothing)."""
    found = [f"left in the kernel: {o}" for o in sorted(set(objects_after) - set(objects_before))]
    found += [f"child process {pid} still running" for pid in children]
    found += [
        f"etcd key outside the jobs' prefixes: {k}" for k in report.get("etcd_stray_keys", [])
    ]
    for rank, counts in sorted(report.get("resources", {}).items()):
        for what, slack in (("fds", FD_SLACK), ("threads", THREAD_SLACK)):
            first, last = counts[what]
            if last - first > slack:
                found.append(f"rank {rank}: {what} grew from {first} to {last} (slack {slack})")
    return found


def run_soak(
    scenario: Scenario, out: Path, run: Callable[[Scenario, Path], dict[str, Any]]
) -> dict[str, Any]:
    """Run the soak's ``scenario`` with ``run`` (the runner's ``run_scenario``) and
    add the leak check to its report: ``soak.leaks`` and ``passed`` (and to
    ``out/report.json``).

    Raises:
        ChaosError: the report could not be written; what ``run`` raises.
    """
    # Not the objects of runs going on beside this one (tests in parallel).
    before = our_objects(others=False)
    report = run(scenario, out)
    found = leaks(report, before, our_objects(others=False), descendants(os.getpid()))
    fired = [f for f in report.get("faults", []) if f.get("fired_s") is not None]
    report["soak"] = {
        "faults": [f"{f.kind} {dict(f.params)} at {f.at_s} s" for f in scenario.faults],
        "fired": len(fired),
        "fired_while_training": sum(
            1 for f in fired if f.get("fired_step") is not None and f["fired_step"] >= 0
        ),
        "leaks": found,
        "resources": report.get("resources", {}),
    }
    report["passed"] = bool(report["passed"]) and not found
    try:
        (out / "report.json").write_text(json.dumps(report, indent=2, default=str))
    except OSError as exc:
        raise ChaosError(f"cannot write {out / 'report.json'}: {exc}") from exc
    return report
