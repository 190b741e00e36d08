"""A state split into a header and its tensors, and put back together (pure logic:
the link in between is tested in tests/resilient/links/test_transfer.py)."""

from __future__ import annotations

import pytest
import torch

from recovery._wire import pack, size_of, unpack
from resilient.errors import RecoveryError

pytestmark = pytest.mark.timeout(30)


def _state() -> dict[str, object]:
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    model(torch.randn(4, 5)).sum().backward()
    opt.step()  # momentum buffers: tensors inside the optimizer's nested state
    return {
        "step": 7,
        "model": model.state_dict(),
        "optimizer": opt.state_dict(),
        "rng": torch.get_rng_state(),
        "extra": {"pos": (3, torch.tensor(11)), "tags": ["a", (1, torch.ones(2, 2).t())]},
        "odd": [torch.zeros(0), torch.tensor(True), torch.ones(3, dtype=torch.bfloat16)],
    }


def _receive(state: object) -> object:
    """What a receiver ends with: the header unpacked, each tensor's bytes copied in."""
    packed = pack(state)
    rebuilt, into = unpack(bytes(packed.header))
    assert len(into) == len(packed.tensors)
    for dst, src in zip(into, packed.tensors, strict=True):
        dst.copy_(src)
    return rebuilt


def _same(a: object, b: object) -> bool:
    if isinstance(a, torch.Tensor):
        return (
            isinstance(b, torch.Tensor)
            and a.dtype == b.dtype
            and a.shape == b.shape
            and torch.equal(a, b)
        )
    if isinstance(a, dict):
        return type(a) is type(b) and list(a) == list(b) and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, list | tuple):
        return type(a) is type(b) and len(a) == len(b) and all(map(_same, a, b))
    return bool(a == b)


def test_a_state_comes_back_equal_with_its_containers_and_metadata() -> None:
    state = _state()
    back = _receive(state)
    assert _same(state, back)
    assert back["model"]._metadata == state["model"]._metadata  # type: ignore[index]
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))
    model.load_state_dict(back["model"])  # type: ignore[index]
    assert torch.equal(model[0].weight, state["model"]["0.weight"])  # type: ignore[index]


def test_the_header_carries_no_tensor_data() -> None:
    big = {"w": torch.zeros(1 << 20)}  # 4 MiB of float32
    packed = pack(big)
    assert len(packed.header) < 4096
    assert packed.nbytes == len(packed.header) + (4 << 20)
    assert size_of(big) == 4 << 20
    # Contiguous CPU tensors are sent from where they lie, not copied.
    assert packed.tensors[0].data_ptr() == big["w"].data_ptr()


def test_non_contiguous_tensors_are_sent_as_contiguous_copies() -> None:
    t = torch.arange(6.0).reshape(2, 3).t()
    packed = pack({"t": t})
    assert packed.tensors[0].is_contiguous() and torch.equal(packed.tensors[0], t)


def test_a_header_that_is_not_one_raises_recovery_error() -> None:
    with pytest.raises(RecoveryError):
        unpack(b"not a torch archive")
    # A header that carries data, not meta tensors, is not one pack() wrote.
    import io

    buf = io.BytesIO()
    torch.save({"w": torch.ones(2)}, buf)
    with pytest.raises(RecoveryError):
        unpack(buf.getvalue())


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_tensors_travel_as_cpu_copies() -> None:
    packed = pack({"w": torch.ones(3, device="cuda")})
    assert packed.tensors[0].device.type == "cpu"


def test_the_bytes_land_in_the_receivers_own_tensors_where_they_fit() -> None:
    donor = _state()
    # A replacement: the same model, fresh; its optimizer has no momentum yet, and
    # one tensor of its "extra" has another shape than the donor's.
    model = torch.nn.Sequential(torch.nn.Linear(5, 3), torch.nn.Linear(3, 2))
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    mine = {"model": model.state_dict(), "optimizer": opt.state_dict(),
            "extra": {"pos": (3, torch.tensor([1, 2]))}}  # fmt: skip
    packed = pack(donor)
    rebuilt, into = unpack(bytes(packed.header), like=mine)
    for dst, src in zip(into, packed.tensors, strict=True):
        dst.copy_(src)
    assert _same(donor, rebuilt)
    ptrs = {t.data_ptr() for t in into}
    assert model[0].weight.data_ptr() in ptrs and model[1].bias.data_ptr() in ptrs
    assert torch.equal(model[0].weight, donor["model"]["0.weight"])  # type: ignore[index]
    # No buffer of the receiver held the momentum or the reshaped tensor: fresh ones.
    assert mine["extra"]["pos"][1].shape == (2,)  # type: ignore[index]
    assert rebuilt["extra"]["pos"][1].shape == ()  # type: ignore[index]
    momentum = rebuilt["optimizer"]["state"][0]["momentum_buffer"]  # type: ignore[index]
    assert momentum.data_ptr() not in {p.data_ptr() for p in model.parameters()}
