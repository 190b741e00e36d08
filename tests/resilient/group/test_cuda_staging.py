"""CUDA tensors on socket links, staged through pinned host memory: the logic on CPU
(a stand-in says which tensors are "device" ones and pins nothing), the copies on a GPU."""

from __future__ import annotations

from typing import Any

import pytest
import torch
import torch.distributed as dist

from resilient.collectives.reduce_ops import Reduce
from resilient.collectives.ring_plan import Span
from resilient.group.cuda_staging import HostStaging, StagedEngine, cuda_devices
from tests._dist import run_world

pytestmark = pytest.mark.timeout(30)

needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _every_tensor(pinned: list[torch.Tensor] | None = None) -> HostStaging:
    """Staging that takes every tensor for a device one; ``pinned`` records the
    buffers it was asked to pin."""

    def pin(t: torch.Tensor) -> torch.Tensor:
        if pinned is not None:
            pinned.append(t)
        return t

    return HostStaging(rank=0, is_device=lambda t: True, pin=pin, max_buffers=3)


def test_buffers_are_reused_by_dtype_count_and_slot() -> None:
    pinned: list[torch.Tensor] = []
    staging = _every_tensor(pinned)
    a = staging.buffer(torch.empty(8))
    assert staging.buffer(torch.zeros(2, 4)) is a  # same dtype and count: same buffer
    assert staging.buffer(torch.empty(8), slot=1) is not a  # a second buffer of one call
    assert staging.buffer(torch.empty(8, dtype=torch.float16)) is not a
    assert (staging.made, staging.reused, len(pinned)) == (3, 1, 3)
    assert a.shape == (8,) and a.dtype == torch.float32
    # The least recently used goes first once more than max_buffers are kept.
    staging.buffer(torch.empty(8))  # a is now the most recent
    staging.buffer(torch.empty(3))
    assert staging.kept == 3
    assert staging.buffer(torch.empty(8)) is a
    assert staging.buffer(torch.empty(8), slot=1) is not pinned[1]  # let go, made again
    staging.close()
    assert staging.kept == 0


def test_host_tensors_pass_through_untouched() -> None:
    staging = HostStaging(rank=0)  # the default: only CUDA tensors need staging
    t = torch.arange(4.0)
    assert not staging.needs(t)
    with staging.staged(t) as host:
        assert host is t
    assert staging.made == 0 and staging.bytes_in == 0


def test_staged_copies_in_and_back_and_nothing_back_after_an_error() -> None:
    staging = _every_tensor()
    t = torch.arange(6, dtype=torch.int32)
    with staging.staged(t) as host:
        assert host is not t and host.tolist() == t.tolist()
        host.mul_(10)
        assert t.tolist() == [0, 1, 2, 3, 4, 5]  # not yet
    assert t.tolist() == [0, 10, 20, 30, 40, 50]
    assert staging.bytes_in == staging.bytes_out == 24
    with pytest.raises(RuntimeError, match="link failed"), staging.staged(t) as host:
        host.zero_()
        raise RuntimeError("link failed")
    assert t.tolist() == [0, 10, 20, 30, 40, 50]  # a failed call writes nothing back
    with staging.staged(t, back=False) as host:
        host.zero_()
    assert t.tolist() == [0, 10, 20, 30, 40, 50]
    with staging.staged(t, read=False) as host:  # an output: only written
        assert host.tolist() == [0, 0, 0, 0, 0, 0]  # the buffer as it was left
        host.fill_(7)
    assert t.tolist() == [7] * 6
    with pytest.raises(ValueError, match="contiguous"), staging.staged(torch.empty(4, 4).t()):
        pass


class _Engine:
    """Records what the CPU engine was given; doubles it (a stand-in for a collective)."""

    def __init__(self) -> None:
        self.given: list[tuple[str, torch.Tensor]] = []

    def all_reduce(self, flat: torch.Tensor, op: Reduce) -> None:
        self.given.append(("all_reduce", flat))
        flat.mul_(2)

    def reduce_scatter(self, flat: torch.Tensor, op: Reduce) -> Span:
        self.given.append(("reduce_scatter", flat))
        flat[:2].add_(100)
        return Span(0, 2)

    def all_gather(self, flat: torch.Tensor) -> None:
        self.given.append(("all_gather", flat))
        flat[2:] = flat[:2]

    def broadcast(self, flat: torch.Tensor, root: int) -> None:
        self.given.append(("broadcast", flat))
        flat.fill_(root)

    def barrier(self) -> None:
        self.given.append(("barrier", torch.empty(0)))


def test_the_engine_runs_on_the_host_copy_and_results_come_back() -> None:
    staging, engine = _every_tensor(), _Engine()
    staged = StagedEngine(engine, staging)  # type: ignore[arg-type]
    t = torch.tensor([1.0, 2.0, 3.0, 4.0])
    staged.all_reduce(t, Reduce.SUM)
    assert t.tolist() == [2.0, 4.0, 6.0, 8.0]
    assert staged.reduce_scatter(t, Reduce.SUM) == Span(0, 2)
    assert t.tolist() == [102.0, 104.0, 6.0, 8.0]
    staged.all_gather(t)
    assert t.tolist() == [102.0, 104.0, 102.0, 104.0]
    staged.broadcast(t, 3)
    assert t.tolist() == [3.0] * 4
    staged.barrier()
    ops = [(op, flat) for op, flat in engine.given if op != "barrier"]
    assert all(flat is not t for _, flat in ops)  # never the "device" tensor itself
    assert len({id(flat) for _, flat in ops}) == 1  # one pinned buffer, reused
    assert staging.made == 1 and staging.reused == 3


def test_cuda_devices_of_a_call() -> None:
    assert cuda_devices([torch.empty(1), torch.empty(1, device="meta")]) == []


def _staged_world(pg: Any, rank: int, world: int) -> list[list[float]]:
    """The real CPU engine under a staging that takes CPU tensors for device ones:
    every collective's result must equal the unstaged one's."""
    staged = StagedEngine(pg.engine, _every_tensor())
    out = []
    for engine in (pg.engine, staged):
        x = torch.arange(12, dtype=torch.float32) * (rank + 1)
        engine.all_reduce(x, Reduce.SUM)
        g = torch.zeros(world * 3)
        g[rank * 3 : rank * 3 + 3] = float(rank + 1)
        engine.all_gather(g)
        b = torch.full((5,), float(rank))
        engine.broadcast(b, 1)
        out.append(x.tolist() + g.tolist() + b.tolist())
    assert out[0] == out[1]
    return out[1]


@pytest.mark.timeout(120)
def test_staged_collectives_over_real_socket_links_equal_unstaged() -> None:
    results = run_world(_staged_world, 3)
    assert results[0] == results[1] == results[2]


# -- on a GPU --------------------------------------------------------------------------


@needs_cuda
def test_cuda_round_trip_through_pinned_memory() -> None:
    staging = HostStaging(rank=0)
    t = torch.arange(1 << 16, dtype=torch.float32, device="cuda")
    with staging.staged(t) as host:
        assert host.device.type == "cpu" and host.is_pinned()
        assert torch.equal(host, torch.arange(1 << 16, dtype=torch.float32))
        host.neg_()
    assert torch.equal(t.cpu(), -torch.arange(1 << 16, dtype=torch.float32))
    with staging.staged(t) as again:
        assert again.data_ptr() == host.data_ptr()  # reused
    assert cuda_devices([t, t.cpu()]) == [t.device]


def _shared_gpu_collectives(pg: Any, rank: int, world: int) -> list[float]:
    """Several ranks on one GPU: CUDA tensors over socket links, results equal to CPU's."""
    torch.cuda.set_device(0)
    out: list[list[float]] = []
    for device in ("cpu", "cuda"):
        x = (torch.arange(1000, dtype=torch.float32) * (rank + 1)).to(device)
        pg.allreduce([x]).wait()
        outs = [torch.empty(4, device=device) for _ in range(world)]
        pg.allgather([outs], [torch.full((4,), float(rank), device=device)]).wait()
        b = torch.full((3,), float(rank), device=device)
        pg.broadcast([b], dist.BroadcastOptions()).wait()
        r = torch.empty(2, device=device)
        whole = torch.arange(2.0 * world, device=device) + rank
        pg._reduce_scatter_base(r, whole, dist.ReduceScatterOptions()).wait()
        a = torch.empty(world, device=device)
        mine = torch.arange(float(world), device=device) + 10 * rank
        pg.alltoall_base(a, mine, [], [], dist.AllToAllOptions()).wait()
        out.append(
            x.cpu().tolist() + [float(o[0]) for o in outs] + b.cpu().tolist()
            + r.cpu().tolist() + a.cpu().tolist()
        )  # fmt: skip
    assert out[0] == out[1]
    return out[1]


@needs_cuda
@pytest.mark.timeout(180)
def test_ranks_sharing_one_gpu_over_socket_links_equal_cpu() -> None:
    results = run_world(_shared_gpu_collectives, 3, config={"cuda_transport": "socket"})
    assert results[0][:1000] == results[1][:1000] == results[2][:1000]  # the all_reduce
