"""Moving a state's bytes over one data-plane link (real processes, real gloo links):
the bytes arrive whole, of any size (none, less than a chunk, several chunks and a
tail), and a digest that does not match is an error, never a silent load."""

from __future__ import annotations

import hashlib
from typing import Any

import pytest
import torch

from resilient import _transfer
from resilient.errors import RecoveryError
from tests._dist import run_world

pytestmark = pytest.mark.timeout(120)

SIZES = (0, 1000, 3 * _transfer.CHUNK_BYTES + 12345)


def _payload(size: int) -> bytes:
    gen = torch.Generator().manual_seed(size)
    return torch.randint(0, 256, (size,), dtype=torch.uint8, generator=gen).numpy().tobytes()


def _move(pg: Any, rank: int, world: int) -> list[str]:
    link = pg.links.get(1 - rank, 0)
    digests = []
    for size in SIZES:
        if rank == 0:
            # Every kind of buffer the session hands over: a writable view of
            # torch.save's buffer, or plain bytes.
            payload = _payload(size)
            _transfer.send_bytes(link, memoryview(bytearray(payload)) if size else payload)
        else:
            got = _transfer.recv_bytes(link)
            digests.append(f"{len(got)}:{hashlib.sha256(got).hexdigest()}")
    return digests


def test_bytes_of_any_size_arrive_whole() -> None:
    _, got = run_world(_move, 2)
    assert got == [f"{n}:{hashlib.sha256(_payload(n)).hexdigest()}" for n in SIZES]


def _corrupt(pg: Any, rank: int, world: int) -> str:
    link = pg.links.get(1 - rank, 0)
    payload = _payload(5000)
    if rank == 0:
        # What send_bytes puts on the wire, with one byte changed after hashing.
        bad = bytearray(payload)
        bad[17] ^= 0xFF
        works = [
            link.isend(torch.tensor([len(payload)], dtype=torch.int64), _transfer._TAG),
            link.isend(torch.frombuffer(bad, dtype=torch.uint8), _transfer._DATA_TAG),
            link.isend(
                torch.frombuffer(bytearray(hashlib.sha256(payload).digest()), dtype=torch.uint8),
                _transfer._DIGEST_TAG,
            ),
        ]
        for work in works:
            link.wait(work, len(payload))
        return "sent"
    try:
        _transfer.recv_bytes(link)
    except RecoveryError:
        return "refused"
    return "loaded"


def test_bytes_that_do_not_match_their_digest_are_refused() -> None:
    assert run_world(_corrupt, 2) == ["sent", "refused"]
