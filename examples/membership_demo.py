"""A 4-rank job that shows membership, epochs and a single-rank restart.

Run it under the launcher (``make demo`` does this)::

    resilient run --nproc 4 --max-restarts 1 examples/membership_demo.py --steps 16

Each rank joins the job in etcd with a lease, watches the member list, and does
"steps" (a sleep standing in for training), publishing its progress as a health
record. Rank 2 kills itself (SIGKILL) half-way through its first incarnation; the
launcher restarts only that rank (incarnation 1), which resumes from the step its
peers published. On every membership change all survivors race to bump the epoch
with compare-and-swap: exactly one wins, the others see ``StaleEpoch``. Rank 0
prints the member list and the epoch history at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time

from membership import MemberInfo, Membership
from resilient.config import RankEnv
from resilient.errors import StaleEpoch


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=16, help="steps each rank runs")
    p.add_argument("--step-s", type=float, default=0.25, help="seconds per step")
    p.add_argument("--crash-rank", type=int, default=2, help="rank that crashes once (-1: none)")
    return p.parse_args()


def say(env: RankEnv, msg: str) -> None:
    print(f"rank {env.rank} inc {env.incarnation}: {msg}", flush=True)


def race_epoch_bump(m: Membership, env: RankEnv, reason: str) -> None:
    current = m.epoch()
    try:
        new = m.bump_epoch(current, reason)
        say(env, f"won the epoch bump {current} -> {new} ({reason})")
    except StaleEpoch as exc:
        say(env, f"lost the epoch race (epoch already {exc.current})")


def resume_step(m: Membership) -> int:
    """The furthest step any live peer published: a stand-in for restoring state."""
    steps = [int(rec.get("step", 0)) for rec in m.rank_health().values()]
    return max(steps, default=0)


def main() -> int:
    args = parse_args()
    env = RankEnv.from_env()
    assert env.etcd is not None and env.token is not None, "run me under `resilient run`"
    m = Membership(env.etcd, env.membership())
    m.join(env.rank, env.incarnation, env.rails, env.token)
    say(env, f"joined job {env.job} with rails {','.join(env.rails)}; epoch {m.epoch()}")
    changes: list[tuple[str, int, MemberInfo | None]] = []
    changed = threading.Event()

    def on_member(kind: str, rank: int, info: MemberInfo | None) -> None:
        if rank != env.rank:
            changes.append((kind, rank, info))
            changed.set()

    m.watch_members(on_member, initial=False)
    start = resume_step(m) if env.incarnation > 0 else 0
    if start:
        say(env, f"restarted: resuming at step {start} from peers' progress")
    for step in range(start, args.steps):
        if changed.is_set():
            changed.clear()
            for kind, rank, info in changes[:]:
                what = (
                    "left"
                    if kind == "delete"
                    else f"joined (incarnation {info.incarnation if info else '?'})"
                )
                say(env, f"saw rank {rank} {what}")
                race_epoch_bump(m, env, f"rank {rank} {what}")
            changes.clear()
        if env.rank == args.crash_rank and env.incarnation == 0 and step == args.steps // 2:
            say(env, f"step {step}: simulating a crash (SIGKILL to myself)")
            os.kill(os.getpid(), signal.SIGKILL)
        m.publish_rank_health({"step": step + 1})
        time.sleep(args.step_s)
    m.client.put(m.keys.sub("done") + str(env.rank), str(env.incarnation))
    if env.rank == 0:
        report(m, env)
    m.close()
    return 0


def report(m: Membership, env: RankEnv) -> None:
    deadline = time.monotonic() + 30
    while m.client.count_prefix(m.keys.sub("done")) < env.world_size:
        if time.monotonic() > deadline:
            say(env, "gave up waiting for every rank to finish")
            break
        time.sleep(0.1)
    members = m.members()
    kvs, _ = m.client.get_prefix(m.keys.epoch_log)
    print("\n=== result ===")
    print(f"job {env.job}: {len(members)} members live at the end")
    for rank, info in sorted(members.items()):
        print(f"  rank {rank}: incarnation {info.incarnation}, pid {info.pid}, rails {info.rails}")
    print(f"epoch history (final epoch {m.epoch()}):")
    for kv in kvs:
        rec = json.loads(kv.value)
        print(f"  epoch {rec['epoch']}: {rec['reason']} (bumped by rank {rec['rank']})")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
