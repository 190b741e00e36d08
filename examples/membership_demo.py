"""A 4-rank job that shows membership, epochs and a single-rank restart.

Run it under the launcher (``make demo`` does this)::

    resilient run --nproc 4 --max-restarts 1 examples/membership_demo.py --steps 16

Each rank joins the job in etcd with a lease, watches the member list, and does
"steps" (a sleep standing in for training), publishing its progress as a health
record. Rank 2 kills itself (SIGKILL) half-way through its first incarnation; the
launcher restarts only that rank (incarnation 1), which resumes from the step its
peers published. On every membership change all ranks race to make the epoch stand
for the new member set with compare-and-swap: exactly one wins, the others see
``StaleEpoch`` and find the winner's epoch already records their view. Rank 0
prints who finished and the epoch history at the end.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import threading
import time
from collections.abc import Callable

from membership import Membership
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


def view_of(m: Membership) -> dict[str, int]:
    """The member set an epoch stands for: rank -> incarnation."""
    return {str(rank): info.incarnation for rank, info in sorted(m.members().items())}


def agree_on_epoch(m: Membership, env: RankEnv, reason: str) -> None:
    """Make the epoch stand for the current member set; exactly one rank bumps it.

    Every rank that saw the change tries a compare-and-swap from the epoch it read;
    the losers (``StaleEpoch``) re-read and find that the winner's epoch already
    records their view, so one change yields one epoch.
    """
    for _ in range(10):
        current = m.epoch()
        view = view_of(m)
        record = m.epoch_record(current) or {}
        if record.get("view") == view:
            return
        try:
            new = m.bump_epoch(current, reason, view=view)
            say(env, f"won the epoch bump {current} -> {new} ({reason})")
            return
        except StaleEpoch as exc:
            say(env, f"lost the epoch race at {current} (epoch already {exc.current})")


def wait_for(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


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
    say(env, f"joined job {env.job} with rails {','.join(env.rails)}")
    if not wait_for(lambda: len(m.members()) == env.world_size, 30):
        say(env, "not every rank joined within 30 s")
        return 1
    formed = (
        f"rank {env.rank} rejoined as incarnation {env.incarnation}"
        if env.incarnation
        else f"{env.world_size} ranks formed the job"
    )
    agree_on_epoch(m, env, formed)
    changed = threading.Event()
    m.watch_members(lambda kind, rank, info: changed.set(), initial=False)
    start = resume_step(m) if env.incarnation > 0 else 0
    if start:
        say(env, f"restarted: resuming at step {start} from peers' progress")
    for step in range(start, args.steps):
        if changed.is_set():
            changed.clear()
            agree_on_epoch(m, env, f"membership changed: {view_of(m)} (rank:incarnation)")
        if env.rank == args.crash_rank and env.incarnation == 0 and step == args.steps // 2:
            say(env, f"step {step}: simulating a crash (SIGKILL to myself)")
            os.kill(os.getpid(), signal.SIGKILL)
        m.publish_rank_health({"step": step + 1})
        time.sleep(args.step_s)
    done = m.keys.sub("done")
    m.client.put(done + str(env.rank), str(env.incarnation))
    # Leave only when everyone is done, so no one sees a departure as a fault.
    wait_for(lambda: m.client.count_prefix(done) >= env.world_size, 30)
    if env.rank == 0:
        report(m, env)
    m.close()
    return 0


def report(m: Membership, env: RankEnv) -> None:
    finished, _ = m.client.get_prefix(m.keys.sub("done"))
    kvs, _ = m.client.get_prefix(m.keys.epoch_log)
    print("\n=== result ===")
    print(f"job {env.job}: {len(finished)} of {env.world_size} ranks finished")
    for kv in finished:
        print(f"  rank {kv.key.rsplit('/', 1)[1]}: finished as incarnation {kv.value.decode()}")
    print(f"epoch history (final epoch {m.epoch()}):")
    for kv in kvs:
        rec = json.loads(kv.value)
        print(f"  epoch {rec['epoch']}: {rec['reason']} (bumped by rank {rec['rank']})")
    sys.stdout.flush()


if __name__ == "__main__":
    sys.exit(main())
