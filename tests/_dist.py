"""Run a function on N real processes (spawn) that share a resilient process group."""

from __future__ import annotations

import multiprocessing as mp
import os
import queue
import traceback
from collections.abc import Callable
from datetime import timedelta
from typing import Any

from resilient.procs import free_port

Target = Callable[..., Any]


def _entry(
    target: Target,
    rank: int,
    world: int,
    rails: int,
    port: int,
    results: Any,
    args: tuple[Any, ...],
    config: dict[str, Any],
) -> None:
    try:
        import torch
        import torch.distributed as dist

        from resilient.config import DataPlaneConfig
        from resilient.process_group import ResilientProcessGroup

        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
        pg = ResilientProcessGroup(
            rank=rank,
            world_size=world,
            rails=[f"127.0.{r + 1}.{rank + 1}" for r in range(rails)],
            store=store,
            config=DataPlaneConfig(**{"op_timeout_floor_s": 20.0, **config}),
        )
        try:
            out = target(pg, rank, world, *args)
        finally:
            pg.shutdown()
        results.put((rank, "ok", out))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def run_world(
    target: Target,
    world: int,
    *,
    rails: int = 1,
    timeout_s: float = 90.0,
    args: tuple[Any, ...] = (),
    config: dict[str, Any] | None = None,
    dead: frozenset[int] = frozenset(),
) -> list[Any]:
    """Run ``target(pg, rank, world, *args)`` on ``world`` processes; return results by rank.

    ``config`` holds ``DataPlaneConfig`` fields for the group. Ranks in ``dead`` are
    expected to die without a result (their entry is their exit code).

    Raises AssertionError with every failing rank's traceback; always reaps the processes.
    """
    out, procs = _spawn(
        _entry, world, timeout_s, dead,
        lambda r, port, q: (target, r, world, rails, port, q, args, config or {}),
    )  # fmt: skip
    for r in dead:
        out[r] = procs[r].exitcode
    return out


def stop_c_steps_early(rank: int, slice_s: float) -> None:
    """C steps with no time to wait (``slice_s`` < 0: leave them as they are), so
    they stop part-way and the channels finish from wherever each stream was: even
    ranks stop after one try at each socket; odd ranks wait ``slice_s``, so their
    first steps often finish and their second ones stop."""
    if slice_s < 0:
        return
    from resilient.links import native_steps

    native_steps.SLICE_S = slice_s if rank % 2 else 0.0
    native_steps.HEALTHY_BYTES_PER_S = float("inf")


def reduce_opts(op: Any) -> Any:
    """``AllreduceOptions`` with ``reduceOp`` set (what a process group's call takes)."""
    import torch.distributed as dist

    o = dist.AllreduceOptions()
    o.reduceOp = op
    return o


def broadcast_opts(root: int) -> Any:
    """``BroadcastOptions`` with ``rootRank`` set."""
    import torch.distributed as dist

    o = dist.BroadcastOptions()
    o.rootRank = root
    return o


def _dist_entry(
    target: Target,
    backend: str,
    rank: int,
    world: int,
    port: int,
    results: Any,
    args: tuple[Any, ...],
    env: dict[str, str],
) -> None:
    try:
        os.environ.update(env)
        rails = env.get("RESILIENT_RAILS", "127.0.1.{r}")  # "{r}": this rank's number + 1
        os.environ["RESILIENT_RAILS"] = rails.format(r=rank + 1)
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        store = dist.TCPStore("127.0.0.1", port, world, rank == 0, timeout=timedelta(seconds=60))
        dist.init_process_group(backend, store=store, rank=rank, world_size=world)
        try:
            out = target(rank, world, *args)
        finally:
            dist.destroy_process_group()
        results.put((rank, "ok", out))
    except BaseException:
        results.put((rank, "error", traceback.format_exc()))


def run_dist(
    target: Target,
    world: int,
    *,
    backend: str = "resilient",
    timeout_s: float = 90.0,
    args: tuple[Any, ...] = (),
    env: dict[str, str] | None = None,
    dead: frozenset[int] = frozenset(),
) -> list[Any]:
    """Run ``target(rank, world, *args)`` on ``world`` processes after
    ``dist.init_process_group(backend)``, as a user's script does (``env`` is added
    to each rank's environment); return results by rank. Ranks in ``dead`` are
    expected to die without a result (their entry is None).

    Raises AssertionError with every failing rank's traceback; always reaps the processes.
    """
    out, _ = _spawn(
        _dist_entry, world, timeout_s, dead,
        lambda r, port, q: (target, backend, r, world, port, q, args, env or {}),
    )  # fmt: skip
    return out


def _spawn(
    entry: Callable[..., None],
    world: int,
    timeout_s: float,
    dead: frozenset[int],
    args_of: Callable[[int, int, Any], tuple[Any, ...]],
) -> tuple[list[Any], list[Any]]:
    """Start ``entry(*args_of(rank, port, results))`` on ``world`` spawned processes
    sharing a free port and a result queue; their results by rank, and the processes."""
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    port = free_port()
    procs = [
        ctx.Process(target=entry, args=args_of(r, port, results), daemon=True) for r in range(world)
    ]
    return _collect(procs, results, world, timeout_s, dead), procs


def _collect(
    procs: list[Any], results: Any, world: int, timeout_s: float, dead: frozenset[int]
) -> list[Any]:
    out: dict[int, Any] = {}
    errors: dict[int, str] = {}
    try:
        for p in procs:
            p.start()
        for _ in range(world - len(dead)):
            try:
                rank, status, value = results.get(timeout=timeout_s)
            except queue.Empty:
                raise AssertionError(
                    f"ranks {sorted(set(range(world)) - set(out) - set(errors) - dead)} gave "
                    f"no result within {timeout_s} s"
                ) from None
            (out if status == "ok" else errors)[rank] = value
    finally:
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                os.kill(p.pid or 0, 9)
                p.join(timeout=5)
    if errors:
        raise AssertionError(
            "\n".join(f"--- rank {r} ---\n{tb}" for r, tb in sorted(errors.items()))
        )
    return [out.get(r) for r in range(world)]
