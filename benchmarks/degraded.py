"""all_reduce when every NIC of one rank runs at a fraction b of the others' rate.

    sudo .venv/bin/python benchmarks/degraded.py --ranks 4 --size-mb 4 --rate-mbit 400 --b 0.5
    sudo .venv/bin/python benchmarks/degraded.py --b 0.25

Each rank runs on its own host of the chaos netns testbed (one veth: the rail).
Two runs, each measuring the resilient group and gloo on that rail (interleaved):
healthy (every host's NIC at ``--rate-mbit``, tbf both ways, set with the chaos
``throttle`` injector), then degraded (the last host's NIC at ``b`` times that:
``--b 0.5`` halves its bandwidth, ``--b 0.25`` leaves it a quarter).

The headline lower bound of the degraded all_reduce is DESIGN.md's
``max(T_healthy, N / (b * B))`` at the **configured** rate B (``bound_ms``; the
second term is ``slow_nic_floor_ms``): the healthy ranks can do no better than
their own ring, and the slow rank must at least send its N bytes and receive the
N-byte result over its slow NIC. ``T_healthy`` is the faster healthy all_reduce
(resilient or gloo). ``resilient_over_bound`` and ``gloo_over_bound`` are against
it. A ring (gloo's) runs at about ``1/b`` of its healthy time instead.

Beside it (never instead of it), ``measured_bound_ms`` puts in place of N / (b B)
what the slow NIC was measured to take moving N bytes out and N in at once with
nothing else running, the faster of two ways: one message per peer and direction
(``nic_both_ms``) or 16 (``nic_both_fine_ms``); ``nic_out_ms`` and ``nic_in_ms``
are each direction alone. These exchanges run in the timed iterations,
interleaved with the all_reduces. On the netns testbed both ways at once take
1.1-1.55x as long as one way, so the configured-rate bound may be out of reach of
any schedule there; ``*_over_measured_bound`` shows by how much.

The resilient group measures its links' send rates after each reduction; once the
ranks agree that one rank's links are all slow, all_reduce leaves that rank out of
the reduction (it sends once and receives once). The warm-up covers that
agreement; ``slow_rank`` in the JSON says what the ranks agreed on at the end
(``--no-straggler-schedule`` keeps the normal schedule, for comparison). Prints a
table, then one JSON line (always the last line of stdout) with ``ok``, ``b``,
``resilient_ms``, ``gloo_ms``, ``bound_ms``, ``resilient_over_bound``,
``gloo_over_bound`` and the measured figures.

Needs root (network namespaces, tc). Cleanup: the testbed (namespaces, with the
tbf qdiscs inside them, and one root veth) is taken down on every exit, SIGINT,
SIGTERM and SIGHUP included; at start, testbeds left by a killed earlier run are
removed. Loopback shaping cannot stand in here: on ``lo`` the connecting side of a
link is unbound, so only half of a rank's connections would carry its address.
"""

from __future__ import annotations

import argparse
import json
import sys
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
    max_over_ranks,
    print_table,
    run_ranks,
    summarise,
    tcp_store,
)
from _guard import SignalGuard, netns_left, sweep_own_leftovers
from _verdicts import degraded_bounds

MB = 1 << 20
NAMES = ("resilient", "gloo")
# The last rank moves N bytes through its NIC and nothing else runs: out, in, both
# (both also in FINE_PIECES messages per peer: see exchange).
EXCHANGES = ("nic_out", "nic_in", "nic_both", "nic_both_fine")
FINE_PIECES = 16


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    world: int
    numel: int
    iters: int
    warmup: int
    timeout_s: float  # one operation
    run_timeout_s: float  # all of one measurement's iterations
    netns: tuple[str, ...]
    rails: tuple[str, ...]
    mgmt: tuple[str, ...]
    topology: str = "auto"
    straggler_schedule: bool = True
    data_transport: str = DATA_TRANSPORT


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.splitlines()[0],
        epilog="Needs root. The last line of stdout is one JSON line (ok false and the "
        "reason when the run stopped early).",
    )
    p.add_argument(
        "--ranks", type=int, default=4,
        help="processes, each on its own netns host; the last one is slowed (default 4; >= 3)",
    )  # fmt: skip
    p.add_argument(
        "--size-mb", type=float, default=4.0,
        help="size N of the all_reduce's float32 tensor in MiB (default 4)",
    )  # fmt: skip
    p.add_argument(
        "--rate-mbit", type=float, default=400.0,
        help="B: every healthy NIC's rate in Mbit/s, tbf both ways (default 400)",
    )  # fmt: skip
    p.add_argument(
        "--b", type=float, default=0.5,
        help="the degraded NIC's share of B, 0 < b <= 1: the last host's NIC runs at b*B "
        "in the degraded phase (0.5: half the bandwidth, 0.25: a quarter; default 0.5)",
    )  # fmt: skip
    p.add_argument(
        "--iters", type=int, default=20,
        help="timed iterations per phase, each running every configuration once (default 20)",
    )  # fmt: skip
    p.add_argument(
        "--warmup", type=int, default=40,
        help="untimed iterations first (40: the slow-rank vote starts after 20 calls, "
        "then needs a few to agree)",
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
        "--no-straggler-schedule", dest="straggler_schedule", action="store_false",
        help="never leave the slow rank out of the reduction (for comparison)",
    )  # fmt: skip
    args = p.parse_args(argv)
    if not 0 < args.b <= 1 or args.ranks < 3 or args.size_mb <= 0 or args.rate_mbit <= 0:
        p.error("need 0 < b <= 1, ranks >= 3, size-mb > 0, rate-mbit > 0")
    if args.iters < 1 or args.warmup < 0:
        p.error("need iters >= 1 and warmup >= 0")
    return args


def rank_main(rank: int, world: int, port: int, plan: Plan) -> dict[str, Any]:
    enter_netns(plan.netns[rank])  # first: every thread started later inherits it
    import torch

    from resilient.config import DataPlaneConfig
    from resilient.process_group import ResilientProcessGroup

    torch.set_num_threads(1)
    store = tcp_store(rank, world, port, plan.timeout_s, host=plan.mgmt[0])
    addr = plan.rails[rank]
    # The barrier runs on the unshaped management network.
    control = gloo_group(store, "bench/control", rank, world, [plan.mgmt[rank]], plan.timeout_s)
    groups: dict[str, Any] = {
        "gloo": gloo_group(store, "bench/gloo", rank, world, [addr], plan.timeout_s),
        "resilient": ResilientProcessGroup(
            rank=rank, world_size=world, rails=[addr], store=store,
            config=DataPlaneConfig(connect_timeout_s=plan.timeout_s,
                                   op_timeout_floor_s=plan.timeout_s, topology=plan.topology,
                                   straggler_schedule=plan.straggler_schedule,
                                   data_transport=plan.data_transport),
        ),
    }  # fmt: skip
    times: dict[str, list[float]] = {n: [] for n in (*NAMES, *EXCHANGES)}
    src = torch.randn(plan.numel, generator=torch.Generator().manual_seed(rank))
    t = src.clone()
    wait = timedelta(seconds=plan.timeout_s)
    try:
        for it in range(plan.warmup + plan.iters):
            timed = it >= plan.warmup
            # The floor's exchanges run in the timed iterations too, so that a drift
            # of the testbed between phases cannot bias the ratio to the bound.
            names = (*NAMES, *EXCHANGES) if timed else NAMES
            shift = it % len(names)
            for name in names[shift:] + names[:shift]:
                t.copy_(src)
                control_barrier(control, plan.timeout_s)
                start = time.perf_counter()
                if name in NAMES:
                    groups[name].allreduce([t]).wait(wait)
                else:
                    exchange(groups["gloo"], name, rank, world, (src, t), wait)
                if timed:
                    times[name].append((time.perf_counter() - start) * 1e3)
        slow = groups["resilient"].engine.slow_rank
    finally:
        groups["resilient"].shutdown()
        groups["gloo"].shutdown()
        control.shutdown()
    return {**times, "slow_rank": [-1 if slow is None else slow]}


def exchange(
    pg: Any, name: str, rank: int, world: int, bufs: tuple[Any, Any], wait: timedelta
) -> None:
    """What any all_reduce must at least move through the last rank's NIC, alone:
    its N bytes out (a part to each other rank: ``nic_out``), the N-byte result in
    (``nic_in``), or both at once (``nic_both``).

    Timed, these give the floor ``N / (b * B)`` at the rate TCP reaches over the
    shaped link ("the lower bound computed from the measured rates"), where
    ``slow_nic_floor_ms`` is the same at the configured rate.
    """
    src, buf = bufs
    slow = world - 1
    both = name.startswith("nic_both")
    out, into = both or name == "nic_out", both or name == "nic_in"
    # One message per peer and direction; "fine": FINE_PIECES of them, the grain of
    # the straggler-aware schedule (with gloo's pairs, a few large messages both
    # ways on one connection can be slower than many small ones).
    pieces = FINE_PIECES if name.endswith("_fine") else 1
    works = []
    for j in range(pieces):
        for q in range(slow):
            lo = (q * pieces + j) * src.numel() // (slow * pieces)
            hi = (q * pieces + j + 1) * src.numel() // (slow * pieces)
            if rank == slow:
                works += [pg.send([src[lo:hi]], q, 7)] if out else []
                works += [pg.recv([buf[lo:hi]], q, 8)] if into else []
            elif rank == q:
                works += [pg.recv([buf[lo:hi]], slow, 7)] if out else []
                works += [pg.send([src[lo:hi]], slow, 8)] if into else []
    for w in works:
        w.wait(wait)


def measure(plan: Plan, testbed: Any, rates: list[float]) -> dict[str, Any]:
    """Median (slowest rank per iteration) of each configuration, host r at rates[r]."""
    from chaos.injector_kinds import make_injector
    from chaos.injectors import InjectionContext
    from chaos.scenario import Fault

    ctx = InjectionContext(testbed=testbed, pid_of=lambda r: 0)
    throttles = [
        make_injector(Fault(kind="throttle", params={"rank": r, "rail": 0, "rate_mbit": rate}), ctx)
        for r, rate in enumerate(rates)
    ]
    try:
        for t in throttles:
            t.start()
        results = run_ranks(rank_main, plan.world, (plan,), plan.run_timeout_s)
    finally:
        for t in throttles:
            t.stop()
    per_iter = max_over_ranks([{n: r[n] for n in (*NAMES, *EXCHANGES)} for r in results])
    agreed = {r["slow_rank"][0] for r in results}
    return {
        **{n: summarise(v)["median"] for n, v in per_iter.items()},
        "slow_rank": agreed.pop() if len(agreed) == 1 else "ranks disagree",
    }


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    guard = SignalGuard().install()
    cleanup: dict[str, Any] = {"leftovers_removed": None, "netns_left": None}
    try:
        return run(args, guard, cleanup)
    except BaseException as exc:  # the JSON line says why, whatever stopped the run
        reason = guard.reason or f"{type(exc).__name__}: {str(exc).strip()[-2000:]}"
        print(json.dumps({
            "bench": "degraded", "ok": False, "reasons": [reason], "b": args.b,
            "cleanup": cleanup,
        }))  # fmt: skip
        if isinstance(exc, KeyboardInterrupt):
            return 130
        if isinstance(exc, SystemExit) and isinstance(exc.code, int):
            return exc.code
        print(f"degraded.py: {reason}", file=sys.stderr)
        return 1
    finally:
        guard.uninstall()


def run(args: argparse.Namespace, guard: SignalGuard, cleanup: dict[str, Any]) -> int:
    from chaos.testbed import NetnsTestbed

    with guard.shielded():
        cleanup["leftovers_removed"] = sweep_own_leftovers()
    nbytes = int(args.size_mb * MB) // 4 * 4
    rate_bps = args.rate_mbit * 1e6 / 8
    # Generous: the degraded ring moves 2N(P-1)/P bytes through the slow NIC.
    slow_s = nbytes / (args.b * rate_bps)  # N through the slow NIC
    timeout = 30.0 + 4 * slow_s
    # Each iteration runs up to six configurations (see rank_main), the slowest a
    # ring at 1.5 N through the slow NIC; three times that leaves room for a slow testbed.
    run_timeout = 120.0 + (args.warmup + args.iters) * 6 * 3 * 1.5 * slow_s
    meter, before = CpuMeter(), load_line()
    testbed = NetnsTestbed(args.ranks, 1)
    names = [testbed.switch_netns, *(testbed.host_netns(i) for i in range(args.ranks))]
    try:
        with guard.shielded():  # a half-built testbed is taken down by up() itself
            testbed.up()
        names = [testbed.switch_netns, *(testbed.host_netns(i) for i in range(args.ranks))]
        hosts = testbed.hosts
        plan = Plan(
            world=args.ranks, numel=nbytes // 4, iters=args.iters, warmup=args.warmup,
            timeout_s=timeout, run_timeout_s=run_timeout, netns=tuple(str(h.netns) for h in hosts),
            rails=tuple(h.rails[0] for h in hosts), mgmt=tuple(h.mgmt_addr for h in hosts),
            topology=args.topology, straggler_schedule=args.straggler_schedule,
            data_transport=args.data_transport,
        )  # fmt: skip
        rates = [args.rate_mbit] * args.ranks
        healthy = measure(plan, testbed, rates)
        rates[-1] = args.rate_mbit * args.b
        degraded = measure(plan, testbed, rates)
    finally:
        with guard.shielded():
            testbed.down()
            cleanup["netns_left"] = netns_left(names)
    healthy_ms = min(healthy[n] for n in NAMES)
    # The slow NIC moving N out and N in, nothing else, the faster way: measured.
    both_ms = min(degraded["nic_both"], degraded["nic_both_fine"])
    bounds = degraded_bounds(
        nbytes=nbytes, rate_mbit=args.rate_mbit, b=args.b, healthy_ms=healthy_ms,
        nic_both_ms=both_ms,
    )  # fmt: skip
    bound, measured = bounds["bound_ms"], bounds["measured_bound_ms"]
    floor_ms = bounds["slow_nic_floor_ms"]
    s = {
        "bench": "degraded",
        "ok": True,
        "reasons": [],
        "ranks": args.ranks,
        "size_mb": args.size_mb,
        "rate_mbit": args.rate_mbit,
        "b": args.b,
        "slow_rate_mbit": args.rate_mbit * args.b,
        "iters": args.iters,
        "warmup": args.warmup,
        "topology": args.topology,
        "straggler_schedule": args.straggler_schedule,
        "data_transport": args.data_transport,
        "healthy_ms": {n: round(healthy[n], 2) for n in NAMES},
        "slow_rank": {"healthy": healthy["slow_rank"], "degraded": degraded["slow_rank"]},
        "resilient_ms": round(degraded["resilient"], 2),
        "gloo_ms": round(degraded["gloo"], 2),
        # The headline: max(T_healthy, N / (b B)) at the configured rate.
        "bound": "max(T_healthy, N/(b*B)) at the configured rate B",
        "bound_ms": round(bound, 2),
        "slow_nic_floor_ms": round(floor_ms, 2),
        "resilient_over_bound": round(degraded["resilient"] / bound, 3),
        "gloo_over_bound": round(degraded["gloo"] / bound, 3),
        # Beside it: the same with the slow NIC's measured exchange in place of N / (b B).
        "measured_bound_ms": round(measured, 2),
        "resilient_over_measured_bound": round(degraded["resilient"] / measured, 3),
        "gloo_over_measured_bound": round(degraded["gloo"] / measured, 3),
        **{
            f"{n}_ms": {"healthy": round(healthy[n], 2), "degraded": round(degraded[n], 2)}
            for n in EXCHANGES
        },
        "testbed": "netns: one host per rank, tbf on both ends of its veth",
        "load": [before, load_line()],
        "cpu": meter.report(),
        "cleanup": cleanup,
    }
    print(
        f"all_reduce of {args.size_mb} MiB, {args.ranks} ranks on one rail at "
        f"{args.rate_mbit} Mbit/s; rank {args.ranks - 1} at b={args.b} "
        f"({args.rate_mbit * args.b:g} Mbit/s)"
    )
    print_table(
        ["config", "healthy ms", "degraded ms", "bound ms", "over bound",
         "measured bound ms", "over measured"],
        [
            [n, f"{healthy[n]:.1f}", f"{degraded[n]:.1f}", f"{bound:.1f}",
             f"{degraded[n] / bound:.3f}", f"{measured:.1f}", f"{degraded[n] / measured:.3f}"]
            for n in NAMES
        ],
    )  # fmt: skip
    print(
        f"bound = max(T_healthy {healthy_ms:.1f}, N/(bB) {floor_ms:.1f}) = {bound:.1f} ms "
        f"(configured rate); slow NIC alone, degraded: {degraded['nic_out']:.1f} ms out, "
        f"{degraded['nic_in']:.1f} ms in, {degraded['nic_both']:.1f} ms both ways "
        f"({degraded['nic_both_fine']:.1f} ms in {FINE_PIECES} pieces per peer)"
    )
    print(json.dumps(s))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
