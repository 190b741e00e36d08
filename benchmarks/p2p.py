"""Point-to-point latency: a send/recv ping-pong on the resilient group against gloo.

    python benchmarks/p2p.py --size-kib 4 --iters 2000

Two processes on this machine. Each builds a ``ResilientProcessGroup`` (one loopback
rail, ``127.0.1.<rank+1>``) and a gloo group bound to the same address. Rank 0 sends
``--size-kib`` of float32 and waits for it to come back; rank 1 receives and sends it
back, ``--iters`` round trips per round, the two groups taking turns over
``--rounds`` rounds (so both see the same load). Reports rank 0's round-trip time
per configuration (median over rounds of each round's mean) and the ratio
resilient / gloo. Prints a table, then one JSON line (last line of output).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from typing import Any

from _common import (
    CpuMeter,
    gloo_group,
    load_line,
    print_table,
    rail_address,
    run_ranks,
    tcp_store,
)

NAMES = ("resilient", "gloo")


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--size-kib", type=float, default=4.0, help="message size (KiB, float32)")
    p.add_argument("--iters", type=int, default=1000, help="round trips per round")
    p.add_argument("--rounds", type=int, default=5, help="rounds per configuration")
    p.add_argument("--warmup", type=int, default=100, help="untimed round trips first")
    p.add_argument("--timeout", type=float, default=600.0, help="whole-run bound (s)")
    return p.parse_args(argv)


def _ping_pong(pg: Any, rank: int, buf: Any, iters: int) -> float:
    """Seconds per round trip (rank 0's view; rank 1 echoes)."""
    start = time.perf_counter()
    for _ in range(iters):
        if rank == 0:
            pg.send([buf], 1, 0).wait()
            pg.recv([buf], 1, 0).wait()
        else:
            pg.recv([buf], 0, 0).wait()
            pg.send([buf], 0, 0).wait()
    return (time.perf_counter() - start) / iters


def rank_main(rank: int, world: int, port: int, args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from resilient.config import DataPlaneConfig
    from resilient.process_group import ResilientProcessGroup

    torch.set_num_threads(1)
    store = tcp_store(rank, world, port, 60.0)
    address = rail_address(rank, 0)
    groups = {
        "resilient": ResilientProcessGroup(
            rank=rank, world_size=world, rails=[address], store=store, config=DataPlaneConfig()
        ),
        "gloo": gloo_group(store, "gloo-p2p", rank, world, [address], 60.0),
    }
    buf = torch.arange(int(args.size_kib * 256), dtype=torch.float32)
    want = buf.clone()
    rounds: dict[str, list[float]] = {name: [] for name in NAMES}
    try:
        for name in NAMES:
            _ping_pong(groups[name], rank, buf, args.warmup)
        for r in range(args.rounds):
            # Alternate which goes first, so neither always follows the other's tail.
            for name in NAMES if r % 2 == 0 else NAMES[::-1]:
                rounds[name].append(_ping_pong(groups[name], rank, buf, args.iters))
        correct = bool(torch.equal(buf, want))
    finally:
        groups["resilient"].shutdown()
    return {"rounds": rounds, "correct": correct}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    loads, meter = [load_line()], CpuMeter()
    results = run_ranks(rank_main, 2, (args,), args.timeout)
    loads.append(load_line())
    rounds = results[0]["rounds"]
    us = {name: statistics.median(rounds[name]) * 1e6 for name in NAMES}
    ratio = us["resilient"] / us["gloo"]
    print_table(
        ["group", "round trip (us, median of rounds)", "min round (us)", "max round (us)"],
        [
            [name, f"{us[name]:.1f}", f"{min(rounds[name]) * 1e6:.1f}",
             f"{max(rounds[name]) * 1e6:.1f}"]
            for name in NAMES
        ],
    )  # fmt: skip
    print(f"resilient / gloo: {ratio:.2f}x")
    summary = {
        "bench": "p2p",
        "size_bytes": int(args.size_kib * 1024),
        "iters": args.iters,
        "rounds": args.rounds,
        "round_trip_us": {name: round(v, 1) for name, v in us.items()},
        "ratio_resilient_to_gloo": round(ratio, 3),
        "correct": all(r["correct"] for r in results),
        "load": loads,
        "cpu": meter.report(),
    }
    print(json.dumps(summary), flush=True)
    return 0 if summary["correct"] else 1


if __name__ == "__main__":
    sys.exit(main())
