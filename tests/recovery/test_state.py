"""The DDP comm hook of recovery.state on a real resilient group: once the group
knows a peer is lost, the backward pass ends at the next bucket instead of
computing the rest of a step that is replayed anyway, and after the reducer's
reset DDP trains on with the bits of a run that never stopped."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch
from torch import nn

from tests._dist import run_world

pytestmark = pytest.mark.timeout(120)


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(
        nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, 4)
    )


def _train(pg: Any, rank: int, world: int, abort_at: int | None) -> dict[str, Any]:
    from recovery.state import average_over_members, reset_reducer
    from resilient.errors import PeerLost

    model = _model()
    # A small bucket cap: one bucket per layer, so the hook runs several times.
    ddp = nn.parallel.DistributedDataParallel(model, process_group=pg, bucket_cap_mb=0.01)
    average_over_members(ddp, pg, cut_backward=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    seen: dict[str, Any] = {}
    step = 0
    while step < 6:
        x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step))
        opt.zero_grad(set_to_none=True)
        if step == abort_at and "aborted" not in seen:
            pg.epochs.peer_loss.lost = PeerLost("rank 1 is gone (the test says so)", peer=1)
            try:
                ddp(x).square().mean().backward()
            except PeerLost:
                seen["aborted"] = True
            # The first layer's gradient comes last in backward: never computed.
            seen["first_layer_grad"] = model[0].weight.grad is not None
            pg.epochs.peer_loss.lost = None
            try:
                ddp(x).square().mean()
            except RuntimeError:
                seen["stuck_without_reset"] = True
            reset_reducer(ddp)
            continue  # the step is replayed
        ddp(x).square().mean().backward()
        opt.step()
        step += 1
    digest = hashlib.sha256()
    for p in model.parameters():
        digest.update(p.detach().numpy().tobytes())
    seen["params"] = digest.hexdigest()
    return seen


def test_a_lost_peer_ends_the_backward_early_and_the_replayed_run_keeps_the_bits() -> None:
    (cut,) = run_world(_train, 1, args=(2,))
    (whole,) = run_world(_train, 1, args=(None,))
    assert cut["aborted"] is True
    assert cut["first_layer_grad"] is False
    assert cut["stuck_without_reset"] is True  # why the session resets the reducer
    assert cut["params"] == whole["params"]


@pytest.mark.timeout(30)
def test_cut_forward_ends_a_forward_pass_at_the_next_module_once_a_peer_is_lost() -> None:
    from types import SimpleNamespace

    from recovery.state import cut_forward
    from resilient.errors import PeerLost

    ran: list[str] = []
    model = nn.Sequential(nn.Linear(4, 4), nn.ReLU(), nn.Linear(4, 2))
    for name, module in model.named_children():
        module.register_forward_hook(lambda *_, name=name: ran.append(name))
    pg = SimpleNamespace(lost=None)
    cut_forward(SimpleNamespace(module=model), pg)

    assert model(torch.ones(1, 4)).shape == (1, 2)
    assert ran == ["0", "1", "2"]
    ran.clear()
    # The loss becomes known while the first layer runs: the second never does.
    lose = PeerLost("rank 1 is gone", peer=1, epoch=0)
    model[0].register_forward_hook(lambda *_: setattr(pg, "lost", lose))
    with pytest.raises(PeerLost):
        model(torch.ones(1, 4))
    assert ran == ["0"]


class _Sharded(nn.Linear):
    """Stands in for a fully_shard-ed Linear: FSDP2's reset method is what marks one."""

    def reset_iter_state(self) -> None:
        pass


@pytest.mark.timeout(30)
def test_fsdp_names_the_modules_to_reset_where_the_root_is_not_fully_shard() -> None:
    from recovery.session import Session, TrainState
    from recovery.state import fsdp_roots
    from resilient.errors import ConfigError

    # The root is a plain Sequential: the default finds no FSDP2 root (as before).
    inner = nn.Sequential(_Sharded(4, 4), _Sharded(4, 4))
    model = nn.Sequential(_Sharded(4, 4), nn.ReLU(), inner, nn.Linear(4, 2))
    state = TrainState(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert fsdp_roots(state) == []
    # Named: the outermost FSDP2 modules under it, each once.
    roots = fsdp_roots(state, model)
    assert [id(m) for m in roots] == [id(model[0]), id(inner[0]), id(inner[1])]
    assert len(fsdp_roots(state, [model[0], model])) == 3

    # A custom StateHook (no .model) gets them too, through Session's fsdp=.
    class Hook:
        def state_dict(self) -> dict[str, Any]:
            return {}

        def load_state_dict(self, _: Any) -> None:
            pass

    assert fsdp_roots(Hook()) == []
    assert Session(None, Hook(), fsdp=inner[1])._fsdp == [inner[1]]
    # A fully_shard-ed root is found without naming it.
    whole = _Sharded(4, 4)
    assert fsdp_roots(TrainState(whole, torch.optim.SGD(whole.parameters()))) == [whole]
    with pytest.raises(ConfigError, match="holds no FSDP2 module"):
        fsdp_roots(state, model[3])


def _fsdp_one_rank(_: int) -> dict[str, Any]:
    import torch.distributed as dist
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    from recovery.session import TrainState
    from recovery.state import fsdp_roots, reset_fsdp

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    seen: dict[str, Any] = {}
    try:
        mesh = init_device_mesh("cpu", (1,))
        digests = {}
        for run in ("clean", "cut"):
            model = _model()
            for layer in model:
                if isinstance(layer, nn.Linear):
                    fully_shard(layer, mesh=mesh)  # and not the root
            opt = torch.optim.SGD(model.parameters(), lr=0.1)
            state = TrainState(model, opt)
            seen["default"] = len(fsdp_roots(state))
            roots = fsdp_roots(state, model)
            seen["named"] = [type(m).__name__ for m in roots]
            cut = {"on": run == "cut"}

            def lose_peer(grad: torch.Tensor, cut: dict[str, bool] = cut) -> torch.Tensor:
                if cut["on"]:
                    raise RuntimeError("a peer was lost (the test says so)")
                return grad

            def watch(_m: nn.Module, _i: Any, out: torch.Tensor) -> None:
                out.register_hook(lose_peer)

            # Mid-backward: the last layers' gradients went out, the first's never will.
            model[0].register_forward_hook(watch)
            step = 0
            while step < 3:
                x = torch.randn(8, 64, generator=torch.Generator().manual_seed(step))
                opt.zero_grad(set_to_none=True)
                try:
                    model(x).square().mean().backward()
                except RuntimeError:
                    cut["on"] = False
                    seen["stuck"] = type(model[0].weight).__name__  # left unsharded
                    for root in roots:
                        reset_fsdp(root)
                    seen["reset"] = type(model[0].weight).__name__
                    continue  # the step is replayed
                opt.step()
                step += 1
            digest = hashlib.sha256()
            for p in model.parameters():
                digest.update(p.full_tensor().detach().numpy().tobytes())
            digests[run] = digest.hexdigest()
        seen["same"] = digests["clean"] == digests["cut"]
    finally:
        dist.destroy_process_group()
    return seen


@pytest.mark.timeout(90)
def test_named_fsdp_modules_are_reset_after_a_cut_backward_and_keep_the_bits() -> None:
    import multiprocessing as mp

    # In a process of its own (see tests/recovery/test_replicas.py).
    with mp.get_context("spawn").Pool(1) as pool:
        seen = pool.map(_fsdp_one_rank, [0], chunksize=1)[0]
    assert seen["default"] == 0  # the root is not fully_shard-ed: nothing found alone
    assert seen["named"] == ["FSDPLinear"] * 3
    assert (seen["stuck"], seen["reset"]) == ("Parameter", "DTensor")
    assert seen["same"] is True
