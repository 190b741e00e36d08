"""Moving a byte string (a serialized state) over one data-plane link.

The length goes first, then the payload in chunks that are all posted at once (so
the kernel keeps the link busy), then its SHA-256. Both ends hash while the bytes
are in flight: the sender after posting the chunks, the receiver chunk by chunk
as they land (hashlib releases the GIL on large buffers, gloo moves the bytes in
its own threads), so the checksum costs the transfer almost no time. The receiver
checks the digest: a corrupt or truncated state is an error, never a silent load.
"""

from __future__ import annotations

import hashlib
from typing import Final

import torch

from resilient.errors import LinkError, RecoveryError
from resilient.links import Link

__all__ = ["CHUNK_BYTES", "recv_bytes", "send_bytes"]

# Far above the tags collectives use (rail/generation shifts stay below 1 << 24).
_TAG: Final = 1 << 28
_DATA_TAG: Final = _TAG + 1
_DIGEST_TAG: Final = _TAG + 2
CHUNK_BYTES: Final = 4 << 20
_DIGEST: Final = 32


def _chunks(n: int) -> list[tuple[int, int]]:
    return [(off, min(off + CHUNK_BYTES, n)) for off in range(0, n, CHUNK_BYTES)]


def _as_tensor(payload: bytes | bytearray | memoryview) -> torch.Tensor:
    """A uint8 view of ``payload`` (a copy only for read-only ``bytes``: torch
    wraps writable buffers only)."""
    buf = payload if isinstance(payload, bytearray | memoryview) else bytearray(payload)
    return torch.frombuffer(buf, dtype=torch.uint8)


def send_bytes(link: Link, payload: bytes | bytearray | memoryview) -> None:
    """Send ``payload`` to ``link.peer``, which must call :func:`recv_bytes`.

    Raises:
        RecoveryError: the link failed or missed its deadline (the cause attached).
    """
    n = len(payload)
    length = torch.tensor([n], dtype=torch.int64)
    try:
        works = [(link.isend(length, _TAG), 8)]
        if n:
            data = _as_tensor(payload)
            works += [(link.isend(data[a:b], _DATA_TAG), b - a) for a, b in _chunks(n)]
        digest = torch.frombuffer(bytearray(hashlib.sha256(payload).digest()), dtype=torch.uint8)
        works.append((link.isend(digest, _DIGEST_TAG), _DIGEST))
        for work, nbytes in works:
            link.wait(work, nbytes)
    except LinkError as exc:
        raise RecoveryError(f"sending {n} B of state over {link!r} failed") from exc


def recv_bytes(link: Link) -> bytearray:
    """Receive what the peer of ``link`` sends with :func:`send_bytes`.

    Raises:
        RecoveryError: the link failed, or the bytes do not match their digest.
    """
    length = torch.empty(1, dtype=torch.int64)
    hasher = hashlib.sha256()
    try:
        link.wait(link.irecv(length, _TAG), 8)
        n = int(length[0])
        raw = bytearray(n)
        spans = _chunks(n)
        data = torch.frombuffer(raw, dtype=torch.uint8) if n else torch.empty(0, dtype=torch.uint8)
        works = [link.irecv(data[a:b], _DATA_TAG) for a, b in spans]
        digest = bytearray(_DIGEST)
        digest_work = link.irecv(torch.frombuffer(digest, dtype=torch.uint8), _DIGEST_TAG)
        view = memoryview(raw)
        for work, (a, b) in zip(works, spans, strict=True):
            link.wait(work, b - a)
            hasher.update(view[a:b])
        link.wait(digest_work, _DIGEST)
    except LinkError as exc:
        raise RecoveryError(f"receiving state over {link!r} failed") from exc
    if hasher.digest() != digest:
        raise RecoveryError(f"state received over {link!r} ({n} B) does not match its SHA-256")
    return raw
