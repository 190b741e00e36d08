"""Byte views as messages: the mesh schedule posts slices of one byte view of its
buffer on socket links (resilient.collectives.mesh), and a link that takes tensors only (the
store's relay, gloo pairs) turns such a view back into the tensor over the same
memory (resilient.links.byte_views.as_tensor)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist

from resilient.collectives.relay import StoreLink
from resilient.links.byte_views import as_tensor, bytes_of

pytestmark = pytest.mark.timeout(30)


def test_a_byte_view_becomes_a_tensor_over_the_same_memory() -> None:
    x = torch.arange(8, dtype=torch.float32)
    view = bytes_of(x)[8:24]  # elements 2, 3, 4, 5
    t = as_tensor(view)
    assert t.dtype == torch.uint8 and t.numel() == 16
    t.view(torch.float32).fill_(-1.0)  # writes land in x
    assert x.tolist() == [0, 1, -1, -1, -1, -1, 6, 7]
    assert as_tensor(bytes_of(x)[4:4]).numel() == 0
    assert as_tensor(x) is x and bytes_of(view) is view


def _route(rank: int, store: dist.Store) -> SimpleNamespace:
    links = SimpleNamespace(rank=rank, name="data", epoch=0, device_type="cpu")
    return SimpleNamespace(links=links, seq=1, store=store, timeout_s=5.0)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.int64])
def test_byte_views_go_through_the_store_relay_into_the_right_elements(
    dtype: torch.dtype,
) -> None:
    store = dist.HashStore()
    src = torch.arange(1000).to(dtype)
    dst = torch.zeros(1000, dtype=dtype)
    e = src.element_size()
    sender = StoreLink(_route(0, store), 1, 0, 1, sender=True)  # type: ignore[arg-type]
    receiver = StoreLink(_route(1, store), 0, 0, 1, sender=False)  # type: ignore[arg-type]
    got = receiver.irecv(bytes_of(dst)[100 * e : 500 * e], 7)
    sender.wait(sender.isend(bytes_of(src)[100 * e : 500 * e], 7), 400 * e)
    receiver.wait(got, 400 * e)
    assert torch.equal(dst[100:500], src[100:500])
    assert not dst[:100].any() and not dst[500:].any()
