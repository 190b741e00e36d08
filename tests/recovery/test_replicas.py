"""Which ranks hold the same shards (recovery.replicas), and sharded state on the
wire (recovery._wire): a DTensor travels as its local shard and comes back a
DTensor on the receiver's mesh."""

from __future__ import annotations

import multiprocessing as mp

import pytest

from recovery.replicas import Layout, layout_key, unreplicated

# A 2 x 2 (replicate x shard) mesh over ranks 0..3: rows {0, 1} and {2, 3}.
HSDP: Layout = ((2, 2), (0, 1, 2, 3), (1,))
FSDP: Layout = ((4,), (0, 1, 2, 3), (0,))
REPLICATED: Layout = ((4,), (0, 1, 2, 3), ())


def test_hsdp_pairs_each_rank_with_the_rank_of_its_column() -> None:
    keys = [layout_key([HSDP], r) for r in range(4)]
    assert keys[0] == keys[2] != keys[1] == keys[3]
    assert unreplicated([HSDP], 4) is None


def test_plain_fsdp_leaves_every_rank_without_a_replica() -> None:
    keys = [layout_key([FSDP], r) for r in range(4)]
    assert len(set(keys)) == 4
    assert unreplicated([FSDP], 4) == (0, keys[0])


def test_replicated_dtensors_and_no_dtensors_make_every_rank_alike() -> None:
    assert len({layout_key([REPLICATED], r) for r in range(4)}) == 1
    assert {layout_key([], r) for r in range(4)} == {""}
    assert unreplicated([], 4) is None


def test_every_layout_must_agree_and_a_rank_off_a_mesh_counts_apart() -> None:
    # Two layouts: rank 0 and 2 share the HSDP column but a 1-D FSDP layout over
    # ranks {0, 2} gives them different shards, so they are not replicas.
    other: Layout = ((2,), (0, 2), (0,))
    keys = [layout_key([HSDP, other], r) for r in range(4)]
    assert keys[0] != keys[2] and keys[1] == keys[3]
    assert unreplicated([HSDP, other], 4) == (0, keys[0])


def test_only_a_state_that_may_hold_dtensors_is_asked_for_its_state_dict(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    import sys
    from typing import Any

    import torch
    import torch.distributed.tensor  # as DDP's constructor does: past the first check

    from recovery.replicas import may_hold_dtensors
    from recovery.session import Session
    from recovery.state import TrainState

    calls: list[int] = []

    def plain() -> TrainState:
        model = torch.nn.Sequential(torch.nn.Linear(2, 2), torch.nn.BatchNorm1d(2))
        state = TrainState(model, torch.optim.AdamW(model.parameters()))
        original = state.state_dict
        state.state_dict = lambda: calls.append(1) or original()  # type: ignore[method-assign]
        return state

    class Hook:
        def state_dict(self) -> dict[str, Any]:
            calls.append(1)
            return {}

        def load_state_dict(self, _: Any) -> None:
            pass

    state = plain()
    assert not may_hold_dtensors(state) and may_hold_dtensors(Hook())
    session = Session(None, state)
    assert session._sharding(state, 0, 2) == "" and calls == []  # not even asked
    assert session._sharding(Hook(), 0, 2) == "" and calls == [1]  # a custom hook is
    # What could make a state dict other than the tensors: a hook, an override.
    hooked = plain()
    hooked.model[0]._register_state_dict_hook(lambda *_: None)
    assert may_hold_dtensors(hooked)
    hooked = plain()
    hooked.optimizer.register_state_dict_post_hook(lambda _o, sd: sd)
    assert may_hold_dtensors(hooked)

    class Own(torch.nn.Linear):
        def get_extra_state(self) -> Any:
            return {}

    own = Own(2, 2)
    assert may_hold_dtensors(TrainState(own, torch.optim.SGD(own.parameters())))
    sub = type("Sub", (TrainState,), {})  # a subclass's state_dict may add anything
    lin = torch.nn.Linear(2, 2)
    assert not may_hold_dtensors(TrainState(lin, torch.optim.SGD(lin.parameters())))
    assert may_hold_dtensors(sub(lin, torch.optim.SGD(lin.parameters())))
    # Never imported: no DTensor can exist, whatever the state.
    monkeypatch.delitem(sys.modules, "torch.distributed.tensor")
    assert not may_hold_dtensors(Hook())


def _one_rank(_: int) -> list[str]:
    import torch
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from recovery._wire import pack, unpack
    from recovery.replicas import check_replicas, may_hold_dtensors, replica_key
    from recovery.state import TrainState
    from resilient.errors import RecoveryError

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    out = []
    try:
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(4, 4))
        check_replicas(TrainState(model, torch.optim.SGD(model.parameters())).state_dict(), 1)
        out.append("replicated: accepted")
        mesh = init_device_mesh("cpu", (1,))
        fully_shard(model, mesh=mesh)
        opt = torch.optim.AdamW(model.parameters())
        model(torch.ones(2, 4)).sum().backward()
        opt.step()  # AdamW's moments: DTensors too
        state = TrainState(model, opt).state_dict()
        out.append(f"key {replica_key(state, 0)}")
        out.append(f"may hold {may_hold_dtensors(TrainState(model, opt))}")
        try:
            check_replicas(state, 1)
        except RecoveryError as exc:
            out.append(f"sharded: {exc}")
        packed = pack(state)
        # Received with no state alike: the mesh is unknown, said clearly.
        try:
            unpack(packed.header)
        except RecoveryError as exc:
            out.append(f"no mesh: {exc}")
        # A rank behind: other weights, no optimizer state yet.
        torch.manual_seed(1)
        behind = torch.nn.Sequential(torch.nn.Linear(4, 4))
        fully_shard(behind, mesh=mesh)
        target = TrainState(behind, torch.optim.AdamW(behind.parameters()))
        got, into = unpack(packed.header, like=target.state_dict())
        for src, dst in zip(packed.tensors, into, strict=True):
            dst.copy_(src)
        target.load_state_dict(got)
        moments = opt.state[model[0].weight]["exp_avg"]
        theirs = target.optimizer.state[behind[0].weight]["exp_avg"]
        out.append(
            f"{type(behind[0].weight).__name__} "
            f"{torch.equal(behind[0].weight.full_tensor(), model[0].weight.full_tensor())} "
            f"{type(theirs).__name__} {torch.equal(theirs.full_tensor(), moments.full_tensor())}"
        )
    finally:
        dist.destroy_process_group()
    return out


@pytest.mark.timeout(90)
def test_sharded_state_is_keyed_checked_and_travels_as_dtensors() -> None:
    # In a process of its own: a gloo group and FSDP state in pytest's process made
    # later fork()s of the launcher tests crash in the child.
    with mp.get_context("spawn").Pool(1) as pool:
        out = pool.map(_one_rank, [0], chunksize=1)[0]
    assert out[0] == "replicated: accepted"
    assert out[1] == "key [[0]]"
    assert out.pop(2) == "may hold True"
    assert out[2].startswith("sharded: recovery.Session: rank 0's shards (the DTensor at "
                             "/model/0.weight"), out[2]  # fmt: skip
    assert "have no replica" in out[2]
    assert out[3].startswith("no mesh: a state's DTensor lives on a mesh of ranks [0]"), out[3]
    assert out[4] == "DTensor True DTensor True"
