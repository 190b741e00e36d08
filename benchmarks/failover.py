"""What losing a NIC in the middle of an all_reduce costs: a stream of all_reduces,
one rail's NIC taken down mid-op on the netns testbed.

    sudo .venv/bin/python benchmarks/failover.py --ranks 4 --rails 2 --size-mb 64

Each rank runs on its own host of the chaos netns testbed, with ``--rails`` veths
that are **not** rate-limited: the op is CPU-bound, so losing a rail costs no
capacity, and whatever the interrupted op takes beyond the median op is the cost
of failing over. While op ``--fault-op`` runs (half a median op after it starts),
the chaos ``nic-down`` injector takes down rail 0 of host ``--victim``
(``ip link set r0 down``); ``--down-s`` later it brings it back up.

Every op reduces the same inputs, so every result must be bitwise equal to the
first (fault-free) one; an op that raises, or returns other bits, counts in
``ops_failed``. Once the NIC is back, the links it broke are rebuilt in the
background (``link.repaired`` events) and the rail gets its share again.
Times come from the ranks (slowest rank per op); detection times
from the ranks' event logs (``nic.down`` on the victim, ``link.down`` on the
peers) against the moment the injector ran ``ip link``.

Prints a table, then a JSON line with ``failover_ms`` (the interrupted op's time
minus the median of the ops before it), ``ops_failed``, ``links_rebuilt``
(links repaired, from ``link.repaired`` events; ``repair_ms`` the slowest),
``detect_ms`` (first rank to notice) and
``peers_detect_ms`` (last rank to notice). Needs root (network namespaces).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import threading
import time
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

from _common import (
    DATA_TRANSPORT,
    CpuMeter,
    control_barrier,
    enter_netns,
    gloo_group,
    load_line,
    print_table,
    run_ranks,
    tcp_store,
)

MB = 1 << 20


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    world: int
    numel: int
    ops: int
    fault_op: int
    victim: int
    timeout_s: float
    netns: tuple[str, ...]
    rails: tuple[tuple[str, ...], ...]
    mgmt: tuple[str, ...]
    run_dir: str
    topology: str
    data_transport: str = DATA_TRANSPORT


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--ranks", type=int, default=4, help="processes, one host each (default 4)")
    p.add_argument("--rails", type=int, default=2, help="rails per host (default 2)")
    p.add_argument("--size-mb", type=float, default=64.0, help="float32 MiB (default 64)")
    p.add_argument("--ops", type=int, default=16, help="all_reduces in the stream (default 16)")
    p.add_argument("--fault-op", type=int, default=6, help="op during which the NIC dies (6)")
    p.add_argument("--victim", type=int, default=1, help="host whose rail-0 NIC dies (1)")
    p.add_argument("--down-s", type=float, default=0.5, help="seconds the NIC stays down (0.5)")
    p.add_argument("--topology", default="auto", help="resilient topology: auto, ring, mesh")
    p.add_argument(
        "--data-transport", choices=("socket", "gloo"), default=DATA_TRANSPORT,
        help=f"resilient data links: sockets or two-rank gloo groups (default {DATA_TRANSPORT})",
    )  # fmt: skip
    p.add_argument("--timeout", type=float, default=30.0, help="deadline of each op (30 s)")
    args = p.parse_args(argv)
    if args.rails < 2 or args.ranks < 2 or not 0 < args.victim < args.ranks:
        p.error("need rails >= 2, ranks >= 2 and 0 < victim < ranks")
    if not 1 <= args.fault_op < args.ops - 1:
        p.error("need 1 <= fault-op < ops - 1 (ops before it give the median, ops after it)")
    return args


def rank_main(
    rank: int, world: int, port: int, plan: Plan, started: Any, median_ms: Any
) -> dict[str, Any]:
    # First: threads started later inherit the namespace; /sys must show its NICs.
    enter_netns(plan.netns[rank], own_sysfs=True)
    os.environ.update(
        RANK=str(rank), WORLD_SIZE=str(world), RESILIENT_RUN_DIR=plan.run_dir,
        RESILIENT_JOB="bench-failover",
    )  # fmt: skip
    import torch

    from resilient.config import DataPlaneConfig
    from resilient.process_group import ResilientProcessGroup

    torch.set_num_threads(1)
    store = tcp_store(rank, world, port, plan.timeout_s, host=plan.mgmt[0])
    control = gloo_group(store, "bench/control", rank, world, [plan.mgmt[rank]], plan.timeout_s)
    pg = ResilientProcessGroup(
        rank=rank, world_size=world, rails=list(plan.rails[rank]), store=store,
        config=DataPlaneConfig(connect_timeout_s=plan.timeout_s,
                               op_timeout_floor_s=plan.timeout_s, topology=plan.topology,
                               data_transport=plan.data_transport),
    )  # fmt: skip
    src = torch.randn(plan.numel, generator=torch.Generator().manual_seed(rank))
    t, ref = src.clone(), None
    times: list[float] = []
    failed: list[str] = []
    wait = timedelta(seconds=plan.timeout_s)
    try:
        for op in range(plan.ops):
            t.copy_(src)
            control_barrier(control, plan.timeout_s)
            if rank == plan.victim and op == plan.fault_op:
                median_ms.value = statistics.median(times[1:])
                started.set()
            start = time.perf_counter()
            try:
                pg.allreduce([t]).wait(wait)
            except Exception as exc:  # counted, and the stream stops: the group is gone
                failed.append(f"op {op}: {type(exc).__name__}: {exc}")
                break
            times.append((time.perf_counter() - start) * 1e3)
            if ref is None:
                ref = t.clone()
            elif not torch.equal(t, ref):
                failed.append(f"op {op}: result differs from the fault-free one")
        weights = list(pg.engine.weights)
        failovers = list(pg.engine.failovers)
    finally:
        pg.shutdown()
        control.shutdown()
    return {"times": times, "failed": failed, "weights": weights, "failovers": failovers}


def inject(testbed: Any, plan: Plan, started: Any, median_ms: Any, down_s: float) -> dict:
    """In a thread of the parent: NIC down half a median op into the fault op, later up."""
    from chaos.injector_kinds import make_injector
    from chaos.injectors import InjectionContext
    from chaos.scenario import Fault

    ctx = InjectionContext(testbed=testbed, pid_of=lambda r: 0)
    fault = Fault(kind="nic-down", params={"rank": plan.victim, "rail": 0})
    nic = make_injector(fault, ctx)
    out: dict[str, Any] = {}

    def run() -> None:
        if not started.wait(plan.timeout_s * (plan.fault_op + 2)):
            return
        time.sleep(median_ms.value / 2e3)
        out["t_down"] = time.time()
        nic.start()
        out["ip_link_ms"] = (time.time() - out["t_down"]) * 1e3
        time.sleep(down_s)
        nic.stop()
        out["t_up"] = time.time()

    out["thread"] = threading.Thread(target=run, name="inject", daemon=True)
    out["thread"].start()
    out["injector"] = nic
    return out


def detection(run_dir: str, t_down: float | None) -> dict[str, Any]:
    """First event per rank that saw the fault, and how many links were repaired."""
    from resilient.events import read_events

    evs = read_events(run_dir)
    first: dict[int, float] = {}
    for e in evs:
        if e["kind"] in ("nic.down", "link.down") and t_down is not None:
            first.setdefault(int(e["rank"]), float(e["ts"]))
    late = {r: round((ts - t_down) * 1e3, 1) for r, ts in first.items()} if t_down else {}
    return {
        "detect_ms_by_rank": late,
        # Both ends log each repair: count links, not events.
        "links_rebuilt": len({
            (e.get("table"), *sorted((e["links"][0][0], e["links"][0][1])), e["links"][0][2],
             e.get("generation"))
            for e in evs if e["kind"] == "link.repaired" and e.get("table")
        }),  # (the rail weights' own "link.repaired", a rail's share back, has no table)
        "repair_ms": max((float(e["duration_ms"]) for e in evs
                          if e["kind"] == "link.repaired" and e.get("table")), default=None),
        "rerouted": sum(1 for e in evs if e["kind"] == "link.rerouted"),
        "kinds": sorted({e["kind"] for e in evs}),
    }  # fmt: skip


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import multiprocessing as mp

    from chaos.testbed import NetnsTestbed
    from resilient.errors import ChaosError

    numel = int(args.size_mb * MB) // 4
    meter, before = CpuMeter(), load_line()
    ctx = mp.get_context("spawn")
    started, median_ms = ctx.Event(), ctx.Value("d", 0.0)
    run_dir = tempfile.mkdtemp(prefix="resilient-failover-")
    try:
        testbed = NetnsTestbed(args.ranks, args.rails).up()
    except ChaosError as exc:
        raise SystemExit(f"failover.py: {exc}") from exc
    try:
        hosts = testbed.hosts
        plan = Plan(
            world=args.ranks, numel=numel, ops=args.ops, fault_op=args.fault_op,
            victim=args.victim, timeout_s=args.timeout,
            netns=tuple(str(h.netns) for h in hosts), rails=tuple(h.rails for h in hosts),
            mgmt=tuple(h.mgmt_addr for h in hosts), run_dir=run_dir, topology=args.topology,
            data_transport=args.data_transport,
        )  # fmt: skip
        fault = inject(testbed, plan, started, median_ms, args.down_s)
        try:
            results = run_ranks(
                rank_main, plan.world, (plan, started, median_ms), args.timeout * (args.ops + 2)
            )
        finally:
            fault["thread"].join(args.down_s + 10)
            fault["injector"].stop()
    finally:
        testbed.down()
    time.sleep(0.5)  # let the ranks' event writers' last lines land (they flush at exit)
    return report(args, results, fault, detection(run_dir, fault.get("t_down")), run_dir,
                  {"load": [before, load_line()], "cpu": meter.report()})  # fmt: skip


def report(
    args: argparse.Namespace, results: list[dict[str, Any]], fault: dict[str, Any],
    det: dict[str, Any], run_dir: str, conditions: dict[str, Any],
) -> int:  # fmt: skip
    n_done = min(len(r["times"]) for r in results)
    per_op = [max(r["times"][i] for r in results) for i in range(n_done)]
    failed = sorted({f for r in results for f in r["failed"]})
    before = per_op[1 : args.fault_op]  # op 0 builds the links
    median = statistics.median(before)
    after = per_op[args.fault_op + 1 :]
    fault_ms = per_op[args.fault_op] if n_done > args.fault_op else None
    detect = det["detect_ms_by_rank"]
    s = {
        "bench": "failover",
        "ranks": args.ranks, "rails": args.rails, "size_mb": args.size_mb,
        "ops": args.ops, "fault_op": args.fault_op, "victim": args.victim,
        "topology": args.topology,
        "data_transport": args.data_transport,
        "median_op_ms": round(median, 1),
        "fault_op_ms": None if fault_ms is None else round(fault_ms, 1),
        "after_median_ms": round(statistics.median(after), 1) if after else None,
        "failover_ms": None if fault_ms is None else round(fault_ms - median, 1),
        "ops_failed": len(failed) + (args.ops - n_done if not failed else 0),
        "failures": failed[:5],
        "links_rebuilt": det["links_rebuilt"],
        "repair_ms": det["repair_ms"],
        "rerouted": det["rerouted"],
        "detect_ms": min(detect.values()) if detect else None,
        "peers_detect_ms": max(detect.values()) if detect else None,
        "detect_ms_by_rank": detect,
        "ip_link_ms": round(fault.get("ip_link_ms", float("nan")), 1),
        "injected": "t_down" in fault,
        "weights_after": results[0]["weights"],
        "run_dir": run_dir,
        "testbed": "netns: one host per rank, rails unshaped",
        **conditions,
    }  # fmt: skip
    print(
        f"{args.ops} all_reduces of {args.size_mb} MiB, {args.ranks} ranks x {args.rails} rails; "
        f"rail 0 of host {args.victim} down during op {args.fault_op} for {args.down_s} s"
    )
    print_table(
        ["op", "ms (slowest rank)", ""],
        [[str(i), f"{ms:.1f}", "<- NIC down" if i == args.fault_op else ""]
         for i, ms in enumerate(per_op)],
    )  # fmt: skip
    print(f"failover_ms {s['failover_ms']}  detect_ms {s['detect_ms']}  "
          f"ops_failed {s['ops_failed']}  links_rebuilt {s['links_rebuilt']}")  # fmt: skip
    print(json.dumps(s))
    return 0 if s["ops_failed"] == 0 and s["injected"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
