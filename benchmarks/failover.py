"""What losing a NIC in the middle of an all_reduce costs: a stream of all_reduces,
one rail's NIC taken down mid-op on the netns testbed.

    sudo .venv/bin/python benchmarks/failover.py --ranks 4 --rails 2 --size-mb 64

Each rank runs on its own host of the chaos netns testbed, with ``--rails`` veths
that are **not** rate-limited: the op is CPU-bound, so losing a rail costs no
capacity, and whatever the faulted op takes beyond the ops around it is the cost
of failing over. While op ``--fault-op`` runs (half a median op after it starts),
the chaos ``nic-down`` injector takes down rail 0 of host ``--victim``
(``ip link set r0 down``); ``--down-s`` later it brings it back up.

The run proves what it claims only if (a) the NIC went down inside the faulted op:
the injector's ``ip link`` call (timestamped before and after) lies between the
moment the last rank started the op and the moment the first rank finished it
(all wall-clock times on this one machine), and (b) the engine failed over in that
op: each rank reads ``len(pg.engine.failovers)`` (``(peer, from_rail, to_rail,
resumed_at)`` records) before and after every op. Otherwise the final JSON line
says ``"ok": false`` with the reasons and the exit code is 1.

Every op reduces the same inputs, so every result must be bitwise equal to the
first (fault-free) one; an op that raises, or returns other bits, counts in
``ops_failed`` (also a failure). Once the NIC is back, the links it broke are
rebuilt in the background (``link.repaired`` events). Op times are the slowest
rank's; detection times come from the ranks' event logs (``nic.down`` on the
victim, ``link.down`` on the peers) against the moment the injector ran ``ip link``.

Prints a table, then one JSON line (always the last line of stdout) with
``fault_op_ms``, ``median_before_ms`` (ops 1..F-1), ``median_after_ms`` (ops F+1..),
``extra_ms`` = fault_op_ms - median(ops before and after together),
``failovers`` (total, in the faulted op, per rank), ``fault`` (where the NIC went
down relative to the op: ``position`` inside/before/after/across-start/across-end,
``down_at_ms`` and ``down_done_at_ms`` from the op's start, ``op_window_ms``),
``ops_failed``, ``links_rebuilt``, ``detect_ms``, ``ok`` and ``reasons``.

Needs root (network namespaces). Cleanup: the testbed (namespaces, with the NIC
states inside them, and one root veth) is taken down on every exit, SIGINT, SIGTERM
and SIGHUP included; at start, testbeds left by a killed earlier run are removed.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
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
from _guard import SignalGuard, netns_left, sweep_own_leftovers
from _verdicts import failover_reasons, op_stats, place_fault

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
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Needs root. The last line of stdout is one JSON line; exit 1 when the run "
        "proves nothing (no failover in the faulted op, the NIC down outside it, an op failed).",
    )
    p.add_argument(
        "--ranks", type=int, default=4,
        help="processes, each on its own netns host (default 4; at least 2)",
    )  # fmt: skip
    p.add_argument(
        "--rails", type=int, default=2,
        help="rails (veths, unshaped) per host; rail 0 of the victim dies (default 2; at least 2)",
    )  # fmt: skip
    p.add_argument(
        "--size-mb", type=float, default=64.0,
        help="size of each all_reduce's float32 tensor in MiB (default 64)",
    )  # fmt: skip
    p.add_argument(
        "--ops", type=int, default=16,
        help="all_reduces in the stream; op 0 builds the links and is left out (default 16)",
    )  # fmt: skip
    p.add_argument(
        "--fault-op", type=int, default=6,
        help="op F during which the NIC goes down, half a median op in; ops 1..F-1 and "
        "F+1.. are the ops before and after it (default 6)",
    )  # fmt: skip
    p.add_argument(
        "--victim", type=int, default=1,
        help="host (rank) whose rail-0 NIC goes down; not 0 (default 1)",
    )  # fmt: skip
    p.add_argument(
        "--down-s", type=float, default=0.5,
        help="seconds the NIC stays down before the injector brings it back (default 0.5)",
    )  # fmt: skip
    p.add_argument(
        "--topology", choices=("auto", "ring", "mesh"), default="auto",
        help="resilient schedule (DataPlaneConfig.topology, default auto)",
    )  # fmt: skip
    p.add_argument(
        "--data-transport", choices=("socket", "gloo"), default=DATA_TRANSPORT,
        help=f"resilient data links: sockets or two-rank gloo groups (default {DATA_TRANSPORT})",
    )  # fmt: skip
    p.add_argument(
        "--timeout", type=float, default=30.0,
        help="deadline of each op and of the rendezvous, in seconds (default 30)",
    )  # fmt: skip
    args = p.parse_args(argv)
    if args.rails < 2 or args.ranks < 2 or not 0 < args.victim < args.ranks:
        p.error("need rails >= 2, ranks >= 2 and 0 < victim < ranks")
    if not 2 <= args.fault_op < args.ops - 1:
        p.error("need 2 <= fault-op < ops - 1 (ops before it and after it give the medians)")
    if args.size_mb <= 0 or args.down_s < 0 or args.timeout <= 0:
        p.error("need size-mb > 0, down-s >= 0 and timeout > 0")
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
    starts: list[float] = []  # wall clock (time.time()), comparable with the injector's
    ends: list[float] = []
    failovers_per_op: list[int] = []
    failed: list[str] = []
    wait = timedelta(seconds=plan.timeout_s)
    try:
        for op in range(plan.ops):
            t.copy_(src)
            control_barrier(control, plan.timeout_s)
            if rank == plan.victim and op == plan.fault_op:
                median_ms.value = statistics.median(times[1:])
                started.set()
            engine: Any = pg.engine  # a RingEngine: world >= 2 (a SoloEngine has no failovers)
            n_before = len(engine.failovers)
            starts.append(time.time())
            start = time.perf_counter()
            try:
                pg.allreduce([t]).wait(wait)
            except Exception as exc:  # counted, and the stream stops: the group is gone
                failed.append(f"op {op}: {type(exc).__name__}: {exc}")
                failovers_per_op.append(max(0, len(engine.failovers) - n_before))
                break
            times.append((time.perf_counter() - start) * 1e3)
            ends.append(time.time())
            failovers_per_op.append(max(0, len(engine.failovers) - n_before))
            if ref is None:
                ref = t.clone()
            elif not torch.equal(t, ref):
                failed.append(f"op {op}: result differs from the fault-free one")
        last: Any = pg.engine
        weights = list(last.weights)
        failovers = [list(f) for f in last.failovers]
    finally:
        pg.shutdown()
        control.shutdown()
    return {
        "times": times, "starts": starts, "ends": ends, "failed": failed, "weights": weights,
        "failovers": failovers, "failovers_per_op": failovers_per_op,
    }  # fmt: skip


def inject(testbed: Any, plan: Plan, started: Any, median_ms: Any, down_s: float) -> dict[str, Any]:
    """In a thread of the parent: NIC down half a median op into the fault op, later up.

    ``t_down`` is the wall-clock time just before ``ip link set r0 down`` ran and
    ``t_down_done`` just after it returned: the NIC went down in between.
    """
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
        try:
            nic.start()
        except Exception as exc:  # reported; the run then fails (not injected)
            out["error"] = f"{type(exc).__name__}: {exc}"
            return
        out["t_down_done"] = time.time()
        out["ip_link_ms"] = (out["t_down_done"] - out["t_down"]) * 1e3
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
    guard = SignalGuard().install()
    cleanup: dict[str, Any] = {"leftovers_removed": None, "netns_left": None}
    try:
        return run(args, guard, cleanup)
    except BaseException as exc:  # the JSON line says why, whatever stopped the run
        reason = guard.reason or f"{type(exc).__name__}: {str(exc).strip()[-2000:]}"
        print(json.dumps({
            "bench": "failover", "ok": False, "reasons": [reason], "cleanup": cleanup,
        }))  # fmt: skip
        if isinstance(exc, KeyboardInterrupt):
            return 130
        if isinstance(exc, SystemExit) and isinstance(exc.code, int):
            return exc.code
        print(f"failover.py: {reason}", file=sys.stderr)
        return 1
    finally:
        guard.uninstall()


def run(args: argparse.Namespace, guard: SignalGuard, cleanup: dict[str, Any]) -> int:
    import multiprocessing as mp

    from chaos.testbed import NetnsTestbed

    with guard.shielded():
        cleanup["leftovers_removed"] = sweep_own_leftovers()
    numel = int(args.size_mb * MB) // 4
    meter, before = CpuMeter(), load_line()
    ctx = mp.get_context("spawn")
    started, median_ms = ctx.Event(), ctx.Value("d", 0.0)
    run_dir = tempfile.mkdtemp(prefix="resilient-failover-")
    testbed = NetnsTestbed(args.ranks, args.rails)
    names = [testbed.switch_netns, *(testbed.host_netns(i) for i in range(args.ranks))]
    fault: dict[str, Any] = {}
    try:
        with guard.shielded():  # a half-built testbed is taken down by up() itself
            testbed.up()
        names = [testbed.switch_netns, *(testbed.host_netns(i) for i in range(args.ranks))]
        hosts = testbed.hosts
        plan = Plan(
            world=args.ranks, numel=numel, ops=args.ops, fault_op=args.fault_op,
            victim=args.victim, timeout_s=args.timeout,
            netns=tuple(str(h.netns) for h in hosts), rails=tuple(h.rails for h in hosts),
            mgmt=tuple(h.mgmt_addr for h in hosts), run_dir=run_dir, topology=args.topology,
            data_transport=args.data_transport,
        )  # fmt: skip
        fault = inject(testbed, plan, started, median_ms, args.down_s)
        results = run_ranks(
            rank_main, plan.world, (plan, started, median_ms), args.timeout * (args.ops + 2)
        )
    finally:
        with guard.shielded():
            if fault:
                fault["thread"].join(args.down_s + 10)
                fault["injector"].stop()
            testbed.down()
            cleanup["netns_left"] = netns_left(names)
    time.sleep(0.5)  # let the ranks' event writers' last lines land (they flush at exit)
    conditions = {"load": [before, load_line()], "cpu": meter.report(), "cleanup": cleanup}
    det = detection(run_dir, fault.get("t_down"))
    return report(args, results, fault, det, run_dir, conditions)


def report(
    args: argparse.Namespace, results: list[dict[str, Any]], fault: dict[str, Any],
    det: dict[str, Any], run_dir: str, conditions: dict[str, Any],
) -> int:  # fmt: skip
    n_done = min(len(r["times"]) for r in results)
    per_op = [max(r["times"][i] for r in results) for i in range(n_done)]
    failed = sorted({f for r in results for f in r["failed"]})
    ops_failed = len(failed) + (args.ops - n_done if not failed else 0)
    stats = op_stats(per_op, args.fault_op)
    f = args.fault_op
    placement = place_fault(
        fault.get("t_down"), fault.get("t_down_done"),
        [r["starts"][f] for r in results if len(r["starts"]) > f],
        [r["ends"][f] for r in results if len(r["ends"]) > f]
        if all(len(r["ends"]) > f for r in results) else [],
    )  # fmt: skip
    by_rank = [len(r["failovers"]) for r in results]
    in_fault_op = [r["failovers_per_op"][f] if len(r["failovers_per_op"]) > f else 0
                   for r in results]  # fmt: skip
    injected = "t_down_done" in fault
    reasons = failover_reasons(
        injected=injected, placement=placement, failovers_total=sum(by_rank),
        failovers_in_fault_op=sum(in_fault_op), ops_failed=ops_failed,
    )  # fmt: skip
    if "error" in fault:
        reasons.insert(0, f"the injector failed: {fault['error']}")
    detect = det["detect_ms_by_rank"]
    s = {
        "bench": "failover",
        "ok": not reasons,
        "reasons": reasons,
        "ranks": args.ranks, "rails": args.rails, "size_mb": args.size_mb,
        "ops": args.ops, "fault_op": args.fault_op, "victim": args.victim,
        "down_s": args.down_s, "topology": args.topology,
        "data_transport": args.data_transport,
        **stats.as_json(),
        "failovers": {
            "total": sum(by_rank), "in_fault_op": sum(in_fault_op),
            "by_rank": by_rank, "in_fault_op_by_rank": in_fault_op,
            "per_op": [sum(r["failovers_per_op"][i] for r in results
                           if len(r["failovers_per_op"]) > i) for i in range(args.ops)],
            "records_by_rank": [r["failovers"] for r in results],
        },
        "fault": placement.as_json(),
        "ops_failed": ops_failed,
        "failures": failed[:5],
        "op_ms": [round(ms, 1) for ms in per_op],
        "links_rebuilt": det["links_rebuilt"],
        "repair_ms": det["repair_ms"],
        "rerouted": det["rerouted"],
        "detect_ms": min(detect.values()) if detect else None,
        "peers_detect_ms": max(detect.values()) if detect else None,
        "detect_ms_by_rank": detect,
        "ip_link_ms": round(fault["ip_link_ms"], 1) if "ip_link_ms" in fault else None,
        "injected": injected,
        "weights_after": results[0]["weights"],
        "run_dir": run_dir,
        "testbed": "netns: one host per rank, rails unshaped",
        **conditions,
    }  # fmt: skip
    print(
        f"{args.ops} all_reduces of {args.size_mb} MiB, {args.ranks} ranks x {args.rails} rails; "
        f"rail 0 of host {args.victim} down during op {args.fault_op} for {args.down_s} s"
    )
    fo_per_op = s["failovers"]["per_op"]
    print_table(
        ["op", "ms (slowest rank)", "failovers", ""],
        [[str(i), f"{ms:.1f}", str(fo_per_op[i]), "<- NIC down" if i == f else ""]
         for i, ms in enumerate(per_op)],
    )  # fmt: skip
    print(
        f"fault op {s['fault_op_ms']} ms; median before {s['median_before_ms']}, after "
        f"{s['median_after_ms']}, around {s['median_around_ms']}; extra {s['extra_ms']} ms"
    )
    print(
        f"NIC down {placement.position} the op ({s['fault']['down_at_ms']} ms in); "
        f"failovers {sum(by_rank)} ({sum(in_fault_op)} in the op); detect_ms {s['detect_ms']}; "
        f"ops_failed {ops_failed}; links_rebuilt {s['links_rebuilt']}"
    )
    for r in reasons:
        print(f"NOT OK: {r}")
    print(json.dumps(s))
    return 0 if not reasons else 1


if __name__ == "__main__":
    raise SystemExit(main())
