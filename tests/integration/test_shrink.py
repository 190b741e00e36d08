"""No replacement comes for a lost rank: the survivors shrink and train on.

Four real processes train a small MLP with DDP over "resilient" (2 rails) under
``recovery.Session`` with ``RESILIENT_SHRINK_AFTER_S``. Rank 2 kills itself inside
backward at step 5 and nobody starts it again. After the shrink delay the three
survivors agree on epoch 1 without it, renumber themselves 0..2 (rank 3 becomes
position 2), keep every link among themselves (same objects) and drop only those
to rank 2, share out rank 2's data shard, average gradients over three, replay
the interrupted step and finish with the same parameters on every survivor.

When a replacement for rank 2 does start later, it asks to join; the members take
it in at the next step boundary (epoch 2, all four ranks again), it receives the
state, and the job ends with the same parameters on all four. With five ranks,
two lost and one back, the group stays one short after the grow and stays
consistent (every member, the newcomer too, keeps checking for joins).
"""

from __future__ import annotations

import functools
import hashlib
import multiprocessing as mp
import os
import queue
import signal
import time
from typing import Any

import pytest

from recovery.shards import Piece
from resilient.procs import free_port

WORLD = 4
STEPS = 10
VICTIM = 2
KILL_AT = 5
SURVIVORS = (0, 1, 3)


def _worker(
    rank: int,
    port: int,
    results: Any,
    incarnation: int = 0,
    steps: int = STEPS,
    world: int = WORLD,
    victims: tuple[int, ...] = (VICTIM,),
) -> None:
    os.environ.update(
        RESILIENT_INCARNATION=str(incarnation),
        RANK=str(rank),
        WORLD_SIZE=str(world),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RESILIENT_RAILS=f"127.0.1.{rank + 1},127.0.2.{rank + 1}",
        RESILIENT_OP_TIMEOUT_S="5",
        RESILIENT_REPLACE_TIMEOUT_S="30",
        RESILIENT_SHRINK_AFTER_S="1",
        RESILIENT_MIN_RANKS="3",
    )
    import torch
    import torch.distributed as dist
    from torch import nn

    import resilient
    from recovery.session import Session, TrainState

    torch.set_num_threads(1)
    pg = resilient.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 8))
    ddp = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.05)
    at = {"step": -1}

    def die_in_backward(grad: torch.Tensor) -> torch.Tensor:
        if rank in victims and incarnation == 0 and at["step"] == KILL_AT:
            os.kill(os.getpid(), signal.SIGKILL)
        return grad

    model[0].weight.register_hook(die_in_backward)

    def train_step(
        step: int,
        shards: tuple[Piece, ...] = (Piece(rank),),
        ddp: nn.Module = ddp,
        opt: torch.optim.Optimizer = opt,
    ) -> torch.Tensor:
        xs = [torch.randn(8, 64, generator=torch.Generator().manual_seed(p.shard * 1_000 + step))
              [p.rows(8)] for p in shards]  # fmt: skip
        loss = ddp(torch.cat(xs)).square().mean()
        opt.zero_grad(set_to_none=True)
        loss.backward()
        return loss.detach()

    session = Session(pg, TrainState(model, opt), warmup=functools.partial(train_step, 0), ddp=ddp)
    links_before: dict[tuple[int, int], int] = {}
    shards: dict[int, list[Piece]] = {}
    told = False
    for step in session.steps(steps):
        if len(pg.members) < world and not told:
            results.put(("shrunk", rank))  # a replacement may start now
            told = True
        if len(pg.members) < world and steps > STEPS and pg.epoch < 2:
            time.sleep(0.25)  # leave a replacement time to start and join (~14 s)
        with session.step(step):
            at["step"] = step
            shards[step] = session.shards()
            loss = train_step(step, tuple(shards[step]))
            dist.all_reduce(loss)
        if step == KILL_AT - 1:
            # Keyed by the peer's rank id: positions change in the shrink.
            links_before = {
                (pg.members[p], rail): id(link) for (p, rail), link in pg.links.links().items()
            }
    links_after = {(pg.members[p], rail): id(link) for (p, rail), link in pg.links.links().items()}
    h = hashlib.sha256()
    for p in model.parameters():
        h.update(p.detach().numpy().tobytes())
    results.put(
        (rank, h.hexdigest(), session.replayed, pg.epoch, pg.members, session.shard,
         shards[steps - 1], links_before, links_after)
    )  # fmt: skip
    del session, train_step, ddp, opt
    dist.barrier()
    dist.destroy_process_group()


@pytest.mark.timeout(240)
def test_survivors_shrink_without_a_replacement_and_train_on_identically() -> None:
    ctx = mp.get_context("spawn")
    results: Any = ctx.Queue()
    port = free_port()
    procs = {r: ctx.Process(target=_worker, args=(r, port, results)) for r in range(WORLD)}
    for p in procs.values():
        p.start()
    out: dict[int, Any] = {}
    try:
        deadline = time.monotonic() + 180
        while len(out) < len(SURVIVORS) and time.monotonic() < deadline:
            if not any(p.is_alive() for p in procs.values()) and results.empty():
                break
            try:
                rank, *rest = results.get(timeout=0.2)
                if rank != "shrunk":
                    out[rank] = rest
            except queue.Empty:
                continue
        for p in procs.values():
            p.join(timeout=30)
    finally:
        for p in procs.values():
            if p.is_alive():
                p.kill()
                p.join(5)
    assert procs[VICTIM].exitcode == -signal.SIGKILL
    assert sorted(out) == list(SURVIVORS), out.keys()
    digests = {r: v[0] for r, v in out.items()}
    assert len(set(digests.values())) == 1, digests
    for rank, (_, replayed, epoch, members, shard, last_shards, before, after) in out.items():
        assert (replayed, epoch, members) == (1, 1, SURVIVORS), rank
        index = SURVIVORS.index(rank)
        assert shard == (index, 3)
        # Each keeps its own shard and trains a third of rank 2's rows.
        assert last_shards == [Piece(rank), Piece(VICTIM, index, 3)], rank
        # Survivor links are the same objects; links to the lost rank are gone.
        kept = {k: v for k, v in before.items() if k[0] != VICTIM}
        assert kept and all(after.get(k) == v for k, v in kept.items()), rank
        assert not any(k[0] == VICTIM for k in after), rank


def _late_replacement(world: int, victims: tuple[int, ...], late: int) -> dict[int, Any]:
    """``world`` ranks, ``victims`` killed at KILL_AT; once the survivors shrank, a
    replacement for ``late`` starts. Every rank's result once all finished."""
    ctx = mp.get_context("spawn")
    results: Any = ctx.Queue()
    port = free_port()
    steps = 60
    procs = [
        ctx.Process(target=_worker, args=(r, port, results, 0, steps, world, victims))
        for r in range(world)
    ]
    for p in procs:
        p.start()
    out: dict[int, Any] = {}
    expected = world - len(victims) + 1
    try:
        deadline = time.monotonic() + 180
        while len(out) < expected and time.monotonic() < deadline:
            if not any(p.is_alive() for p in procs) and results.empty():
                break
            try:
                rank, *rest = results.get(timeout=0.2)
            except queue.Empty:
                continue
            if rank == "shrunk" and len(procs) == world:
                args = (late, port, results, 1, steps, world, victims)
                procs.append(ctx.Process(target=_worker, args=args))
                procs[-1].start()
            elif rank != "shrunk":
                out[rank] = rest
        for p in procs:
            p.join(timeout=30)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
                p.join(5)
    assert all(procs[v].exitcode == -signal.SIGKILL for v in victims)
    assert len({v[0] for v in out.values()}) == 1, {r: v[0] for r, v in out.items()}
    return out


@pytest.mark.timeout(240)
def test_a_replacement_that_comes_late_grows_the_group_back() -> None:
    out = _late_replacement(WORLD, (VICTIM,), VICTIM)
    assert sorted(out) == list(range(WORLD)), out.keys()
    for rank, (_, _, epoch, members, shard, last_shards, _, _) in out.items():
        # Epoch 1: three ranks; epoch 2: the replacement is in and the shards are back.
        assert (epoch, members, shard, last_shards) == (
            2, tuple(range(WORLD)), (rank, 4), [Piece(rank)]
        )  # fmt: skip


@pytest.mark.timeout(240)
def test_a_group_that_grows_back_only_partly_stays_consistent() -> None:
    # Five ranks, 1 and 3 killed, only 3 comes back: still one short after the grow,
    # so every member (the newcomer too) keeps checking for joins before each step.
    out = _late_replacement(5, (1, 3), 3)
    assert sorted(out) == [0, 2, 3, 4], out.keys()
    for rank, (_, _, epoch, members, _, last_shards, _, _) in out.items():
        assert (epoch, members) == (2, (0, 2, 3, 4)), rank
        assert last_shards == [Piece(rank), Piece(1, members.index(rank), 4)], rank
