"""Subgroups, DeviceMesh dimensions and FSDP2/HSDP on the ``"resilient"`` backend.

Every group is made through torch's own calls (``new_group``, ``init_device_mesh``,
``fully_shard``) after ``init_process_group("resilient")``, as a user's script does.
The world group holds the rank's membership in etcd; a subgroup must not join a
second time (that used to fail with "rank 0 is held by incarnation 0").
"""

from __future__ import annotations

import contextlib
import time
import uuid
from typing import Any

import pytest

from resilient.config import EtcdConfig
from tests._dist import run_dist

WORLD = 4


def _subgroups(rank: int, world: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    out: dict[str, Any] = {"world_joined": dist.group.WORLD.membership is not None}
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mine = pairs[rank // 2]
    t = torch.arange(5, dtype=torch.float32) + 10 * rank
    dist.all_reduce(t, group=mine)
    out["pair_sum"] = t.tolist()
    out["pair_member_joined"] = mine.membership is not None
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
    rep, shard = mesh.get_group("rep"), mesh.get_group("shard")
    out["names"] = (rep.group_name, shard.group_name, dist.group.WORLD.group_name)
    x = torch.full((3,), float(rank + 1), dtype=torch.float64)
    dist.all_reduce(x, op=dist.ReduceOp.MAX, group=rep)
    out["rep_max"] = x.tolist()
    gathered = torch.empty(4, dtype=torch.int64)
    dist.all_gather_into_tensor(gathered, torch.tensor([rank, -rank]), group=shard)
    out["shard_gather"] = gathered.tolist()
    flat = init_device_mesh("cpu", (world,))
    y = torch.ones(2, dtype=torch.bfloat16) * (rank + 1)
    dist.all_reduce(y, group=flat.get_group())
    out["flat_sum"] = y.float().tolist()
    dist.barrier()
    return out


@pytest.mark.timeout(180)
def test_new_group_and_device_mesh_dims_run_without_a_second_membership_join(
    etcd_config: EtcdConfig,
) -> None:
    env = {
        "RESILIENT_ETCD": ",".join(etcd_config.endpoints),
        "RESILIENT_TOKEN": "subgroup-secret",
        "RESILIENT_JOB": f"test-{uuid.uuid4().hex[:12]}",
    }
    results = run_dist(_subgroups, WORLD, env=env, timeout_s=150)
    for rank, r in enumerate(results):
        assert r["world_joined"] is True, rank
        assert r["pair_member_joined"] is False, rank
        lo = 2 * (rank // 2)
        assert r["pair_sum"] == [float(2 * i + 10 * lo + 10 * (lo + 1)) for i in range(5)], rank
        # mesh (2, 2): rank = 2 * rep_index + shard_index; "rep" joins ranks {s, s + 2}.
        assert r["rep_max"] == [float((rank % 2) + 3)] * 3, rank
        base = 2 * (rank // 2)
        assert r["shard_gather"] == [base, -base, base + 1, -(base + 1)], rank
        assert r["flat_sum"] == [10.0, 10.0], rank
        assert len(set(r["names"])) == 3, r["names"]


def _train(rank: int, world: int, hsdp: bool, steps: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = torch.nn.Sequential(
        torch.nn.Linear(16, 32), torch.nn.ReLU(), torch.nn.Linear(32, 33), torch.nn.Tanh(),
        torch.nn.Linear(33, 4),
    )  # fmt: skip
    mesh = (
        init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard"))
        if hsdp
        else init_device_mesh("cpu", (world,))
    )
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    gen = torch.Generator().manual_seed(100 + rank)
    losses = []
    for _ in range(steps):
        x = torch.randn(8, 16, generator=gen)
        loss = (model(x) - 1.0).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    # numpy arrays travel by value (a tensor would travel as shared memory that
    # vanishes with this process).
    full = {k: v.full_tensor().detach().numpy().copy() for k, v in model.state_dict().items()}
    dist.barrier()
    return {"losses": losses, "params": full, "backend": dist.get_backend()}


@pytest.mark.timeout(300)
@pytest.mark.parametrize("hsdp", [False, True], ids=["fsdp-1d", "hsdp-2x2"])
def test_fsdp2_trains_as_on_gloo(hsdp: bool) -> None:
    import numpy as np

    ours = run_dist(_train, WORLD, args=(hsdp, 3), timeout_s=240)
    ref = run_dist(_train, WORLD, backend="gloo", args=(hsdp, 3), timeout_s=240)
    assert {r["backend"] for r in ours} == {"resilient"}
    for rank in range(WORLD):
        # Every rank ends with the same full parameters (they are one model).
        for k, v in ours[rank]["params"].items():
            assert np.array_equal(v, ours[0]["params"][k]), (rank, k)
        for a, b in zip(ours[rank]["losses"], ref[rank]["losses"], strict=True):
            assert abs(a - b) <= 1e-6 * max(1.0, abs(b)), (rank, a, b)
    for k, v in ours[0]["params"].items():
        want = ref[0]["params"][k]
        assert np.allclose(v, want, rtol=1e-6, atol=1e-7), (k, np.abs(v - want).max())


def _made_in_different_orders(rank: int, world: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    from resilient.errors import CollectiveMismatch

    # Rank 0 thinks the first subgroup is {0, 1}; ranks 1 and 2 think it is {1, 2}.
    # torch gives both the same name, so they would share one store prefix.
    ranks = [0, 1] if rank == 0 else [1, 2]
    out: dict[str, Any] = {}
    start = time.monotonic()
    try:
        dist.new_group(ranks)
        out["error"] = None
    except CollectiveMismatch as exc:
        out["error"] = str(exc)
    out["took_s"] = time.monotonic() - start
    # The world group is untouched and still works.
    t = torch.ones(4) * (rank + 1)
    dist.all_reduce(t)
    out["world_sum"] = t.tolist()
    return out


@pytest.mark.timeout(120)
def test_subgroups_made_in_different_orders_fail_on_every_member_and_the_world_works() -> None:
    results = run_dist(_made_in_different_orders, 3, timeout_s=100)
    # Rank 0's view conflicts with the others' under one group name: it always fails.
    # Ranks 1 and 2 agree with each other; they may form their group or, having seen
    # rank 0's conflict first, fail too. Nobody waits for the 60 s connect timeout.
    assert results[0]["error"] is not None and "different orders" in results[0]["error"]
    for rank, r in enumerate(results):
        assert r["error"] is None or "different orders" in r["error"], (rank, r)
        assert r["took_s"] < 20.0, (rank, r["took_s"])
        assert r["world_sum"] == [6.0] * 4, rank


def _dcp_round_trip(rank: int, world: int, directory: str) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("rep", "shard"))

    def build(seed: int) -> tuple[Any, Any]:
        torch.manual_seed(seed)
        model = torch.nn.Sequential(torch.nn.Linear(8, 24), torch.nn.ReLU(), torch.nn.Linear(24, 5))
        for layer in model:
            if isinstance(layer, torch.nn.Linear):
                fully_shard(layer, mesh=mesh)
        fully_shard(model, mesh=mesh)
        return model, torch.optim.AdamW(model.parameters(), lr=1e-2)

    model, opt = build(0)
    model(torch.randn(4, 8, generator=torch.Generator().manual_seed(rank))).sum().backward()
    opt.step()
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=directory)
    saved = {k: v.full_tensor().numpy().copy() for k, v in model.state_dict().items()}
    fresh, fresh_opt = build(1)  # other initial values, no optimizer state yet
    fmsd, fosd = get_state_dict(fresh, fresh_opt)
    state = {"model": fmsd, "optim": fosd}
    dcp.load(state, checkpoint_id=directory)
    set_state_dict(
        fresh, fresh_opt, model_state_dict=state["model"], optim_state_dict=state["optim"]
    )
    loaded = {k: v.full_tensor().numpy().copy() for k, v in fresh.state_dict().items()}
    dist.barrier()
    return {"saved": saved, "loaded": loaded, "backend": dist.get_backend()}


@pytest.mark.timeout(240)
def test_dcp_save_and_load_of_an_hsdp_model(tmp_path: Any) -> None:
    import numpy as np

    results = run_dist(_dcp_round_trip, WORLD, args=(str(tmp_path / "ckpt"),), timeout_s=200)
    assert (tmp_path / "ckpt" / ".metadata").exists()
    for rank, r in enumerate(results):
        assert r["backend"] == "resilient"
        assert r["saved"].keys() == r["loaded"].keys()
        for k, v in r["saved"].items():
            assert np.array_equal(v, r["loaded"][k]), (rank, k)
            assert np.array_equal(v, results[0]["saved"][k]), (rank, k)


def _lost_in_every_group(rank: int, world: int) -> dict[str, Any]:
    import os

    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    from resilient.errors import PeerLost

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
    groups = {"rep": mesh.get_group("rep"), "shard": mesh.get_group("shard")}
    for g in (None, *groups.values()):
        dist.all_reduce(torch.ones(4), group=g)
    dist.barrier()
    if rank == 3:
        os._exit(0)  # the process is gone: its sockets close
    out: dict[str, Any] = {}
    try:
        dist.all_reduce(torch.ones(1000))
        out["world"] = "no error"
    except PeerLost as exc:
        out["world"] = exc.peer
    for name, g in groups.items():
        ranks = dist.get_process_group_ranks(g)
        # Told by the world group, before this group made any call of its own.
        deadline = time.monotonic() + 2.0
        while g.lost is None and 3 in ranks and time.monotonic() < deadline:
            time.sleep(0.01)
        told = g.lost is not None
        start = time.monotonic()
        try:
            t = torch.ones(3) * (rank + 1)
            dist.all_reduce(t, group=g)
            result: Any = t.tolist()
        except PeerLost as exc:
            result = ("PeerLost", dist.get_process_group_ranks(g)[0], exc.peer)
        out[name] = (ranks, told, result, time.monotonic() - start)
    return out


@pytest.mark.timeout(180)
def test_a_lost_rank_fails_every_subgroup_holding_it_at_once_and_spares_the_others() -> None:
    results = run_dist(_lost_in_every_group, WORLD, timeout_s=150, dead=frozenset({3}))
    for rank in range(3):
        r = results[rank]
        assert r["world"] == 3, (rank, r)
        for name in ("rep", "shard"):
            ranks, told, result, took = r[name]
            if 3 in ranks:
                assert told, (rank, name)  # before any call of that group
                assert result[0] == "PeerLost" and result[2] == ranks.index(3), (rank, name)
                assert took < 1.0, (rank, name, took)  # at once, no deadline waited for
            else:
                assert not told, (rank, name)
                assert result == [float(sum(x + 1 for x in ranks))] * 3, (rank, name, result)


def _sockets() -> int:
    """This process's open sockets (TCP connections, listeners, the store's)."""
    import os

    count = 0
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):
            count += os.readlink(f"/proc/self/fd/{fd}").startswith("socket:")
    return count


def _link_kinds(group: Any) -> set[str]:
    return {
        type(link).__name__ for table in group.epochs.tables() for link in table.links().values()
    }


def _borrowing(rank: int, world: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh

    warm = torch.ones(4096) * rank
    # One rail, a call too large to travel in the call check's rows: the mesh, data
    # links to every peer.
    dist.all_reduce(warm)
    # And point-to-point in the world group, with its connections of its own.
    buf = torch.full((10,), float(rank))
    peer = rank ^ 1
    if rank % 2 == 0:
        dist.send(buf, dst=peer)
    else:
        dist.recv(buf, src=peer)
    dist.barrier()
    pairs = [dist.new_group([0, 1]), dist.new_group([2, 3])]
    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("rep", "shard"))
    before = _sockets()
    mine = pairs[rank // 2]
    t = torch.arange(5, dtype=torch.float32) + 10 * rank
    for _ in range(3):
        dist.all_reduce(t, group=mine)
    x = torch.full((300_000,), float(rank + 1))
    dist.all_reduce(x, group=mesh.get_group("rep"))
    g = torch.empty(4, dtype=torch.int64)
    dist.all_gather_into_tensor(g, torch.tensor([rank, -rank]), group=mesh.get_group("shard"))
    # Point-to-point in a subgroup (group ranks): it borrows the world's
    # point-to-point connection (never a collectives' one).
    if rank % 2 == 0:
        dist.recv(buf, group_src=1, group=mine)
    else:
        dist.send(buf + 100, group_dst=0, group=mine)
    after = _sockets()
    world_p2p = dist.group.WORLD.p2p.link_to(peer, 0)
    sub_p2p = mine.p2p.link_to(1 - mine.rank(), 0)
    out = {
        "before": before,
        "after": after,
        "pair": _link_kinds(mine),
        "rep": _link_kinds(mesh.get_group("rep")),
        "shard": _link_kinds(mesh.get_group("shard")),
        "p2p": (type(world_p2p).__name__, type(sub_p2p).__name__),
        "t": t.tolist(),
        "x": x[:2].tolist(),
        "g": g.tolist(),
        "buf": buf[:2].tolist(),
    }
    dist.barrier()
    return out


@pytest.mark.timeout(180)
def test_subgroups_ride_on_the_world_groups_connections() -> None:
    """No second connection where one exists: once the world group has links to its
    peers, its subgroups' data, control and point-to-point links borrow them."""
    results = run_dist(_borrowing, WORLD, timeout_s=150)
    for rank, r in enumerate(results):
        for group in ("pair", "rep", "shard"):
            assert r[group] == {"BorrowedLink"}, (rank, group, r[group])
        assert r["p2p"] == ("SocketLink", "BorrowedLink"), rank
        if rank != 0:  # rank 0 also serves the TCPStore, whose clients come and go
            assert r["after"] == r["before"], rank
        lo = 2 * (rank // 2)
        t0 = [float(i + 10 * lo) for i in range(5)]
        t1 = [float(i + 10 * (lo + 1)) for i in range(5)]
        want = [a + b for a, b in zip(t0, t1, strict=True)]
        for _ in range(2):
            want = [2 * v for v in want]
        assert r["t"] == want, rank
        assert r["x"] == [float(rank % 2 + 1 + rank % 2 + 3)] * 2, rank
        base = 2 * (rank // 2)
        assert r["g"] == [base, -base, base + 1, -(base + 1)], rank
        # The odd rank got the even one's tensor, and sent it back plus 100.
        assert r["buf"] == [float(lo + 100 * (rank % 2 == 0))] * 2, rank


def _cut_under_a_subgroup(rank: int, world: int) -> dict[str, Any]:
    import torch
    import torch.distributed as dist

    big = torch.ones(1 << 18) * (rank + 1)  # split across both rails
    dist.all_reduce(big)
    sub = dist.new_group([0, 1])
    y = torch.ones(1 << 18) * (rank + 1)
    dist.all_reduce(y, group=sub)
    kinds = _link_kinds(sub)
    dist.barrier()
    # The world's connection on rail 0 breaks (as when its cable is pulled): the
    # subgroup's link over it fails too, and its calls go on over rail 1.
    dist.group.WORLD.links.get(1 - rank, 0).abort("test: the connection broke")
    z = torch.ones(1 << 18) * (rank + 1)
    for _ in range(3):
        dist.all_reduce(z, group=sub)
    w = torch.ones(1 << 18) * (rank + 1)
    dist.all_reduce(w)
    return {"kinds": kinds, "y": y[0].item(), "z": z[0].item(), "w": w[0].item()}


@pytest.mark.timeout(180)
def test_a_broken_world_connection_fails_the_subgroup_over_to_another_rail() -> None:
    env = {"RESILIENT_RAILS": "127.0.1.{r},127.0.2.{r}"}
    results = run_dist(_cut_under_a_subgroup, 2, env=env, timeout_s=150)
    for rank, r in enumerate(results):
        assert r["kinds"] == {"BorrowedLink"}, rank
        assert (r["y"], r["z"], r["w"]) == (3.0, 3.0 * 2**2, 3.0), rank
