"""Moving a state over one data-plane link (real processes, real links): the
header and the tensors arrive whole, whatever their sizes (empty, less than a
chunk, several chunks and a tail), and a digest that does not match is an error,
never a silent load."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch

from resilient.errors import RecoveryError
from resilient.links import transfer
from tests._dist import run_world

pytestmark = pytest.mark.timeout(120)

SIZES = (0, 1000, 3 * transfer.CHUNK_BYTES + 12345)
DTYPES = (torch.float32, torch.bfloat16, torch.int64, torch.uint8)


def _tensors() -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(7)
    out = []
    for size, dtype in zip(SIZES, DTYPES, strict=False):
        numel = size // torch.empty(0, dtype=dtype).element_size()
        out.append(torch.randint(0, 100, (numel,), generator=gen).to(dtype))
    out.append(torch.tensor(2.5, dtype=torch.float64))  # 0-dim
    return out


def _digest(tensors: list[torch.Tensor]) -> str:
    h = hashlib.sha256()
    for t in tensors:
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def _move(pg: Any, rank: int, world: int) -> dict[str, Any]:
    link = pg.links.get(1 - rank, 0)
    header = b"shapes and dtypes of what follows"
    if rank == 0:
        transfer.send_state(link, memoryview(bytearray(header)), _tensors())
        return {}
    seen: list[bytes] = []
    into: list[torch.Tensor] = []

    def allocate(got: bytearray) -> list[torch.Tensor]:
        seen.append(bytes(got))
        into.extend(torch.empty_like(t) for t in _tensors())
        return into

    nbytes = transfer.recv_state(link, allocate)
    return {"header": seen, "digest": _digest(into), "nbytes": nbytes}


def test_a_header_and_tensors_of_any_size_arrive_whole() -> None:
    _, got = run_world(_move, 2)
    expected = _tensors()
    assert got["header"] == [b"shapes and dtypes of what follows"]
    assert got["digest"] == _digest(expected)
    assert got["nbytes"] == 33 + sum(t.numel() * t.element_size() for t in expected)


def _corrupt(pg: Any, rank: int, world: int) -> str:
    link = pg.links.get(1 - rank, 0)
    data = torch.arange(5000, dtype=torch.int32)
    header = b"h"
    if rank == 0:
        # What send_state puts on the wire, with one byte changed after hashing.
        digest = hashlib.sha256(header)
        digest.update(data.view(torch.uint8).numpy().tobytes())
        bad = data.clone()
        bad[17] += 1
        works = [
            link.isend(torch.tensor([1], dtype=torch.int64), transfer._TAG),
            link.isend(
                torch.frombuffer(bytearray(header), dtype=torch.uint8), transfer._HEADER_TAG
            ),
            link.isend(bad.view(torch.uint8), transfer._DATA_TAG),
            link.isend(
                torch.frombuffer(bytearray(digest.digest()), dtype=torch.uint8),
                transfer._DIGEST_TAG,
            ),
        ]
        for work in works:
            link.wait(work, 20000)
        return "sent"
    try:
        transfer.recv_state(link, lambda h: [torch.empty_like(data)])
    except RecoveryError:
        return "refused"
    return "loaded"


def test_bytes_that_do_not_match_their_digest_are_refused() -> None:
    assert run_world(_corrupt, 2) == ["sent", "refused"]


def test_only_contiguous_cpu_tensors_are_sent() -> None:
    # Checked before anything is posted: the link is not touched (None here).
    with pytest.raises(ValueError):
        transfer.send_state(None, b"h", [torch.zeros(4, 4).t()])  # type: ignore[arg-type]
