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
