"""Moving a byte string (a serialized state) over one data-plane link.

A header (length and SHA-256) goes first, then the payload in chunks that are all
posted at once, so the kernel keeps the link busy. The receiver checks the digest:
a corrupt or truncated state is an error, never a silent load.
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
CHUNK_BYTES: Final = 4 << 20
_DIGEST: Final = 32


def _chunks(n: int) -> list[tuple[int, int]]:
    return [(off, min(off + CHUNK_BYTES, n)) for off in range(0, n, CHUNK_BYTES)]


def send_bytes(link: Link, payload: bytes) -> None:
    """Send ``payload`` to ``link.peer``, which must call :func:`recv_bytes`.

    Raises:
        RecoveryError: the link failed or missed its deadline (the cause attached).
    """
    header = torch.tensor([len(payload), *hashlib.sha256(payload).digest()], dtype=torch.int64)
    data = torch.frombuffer(bytearray(payload), dtype=torch.uint8) if payload else None
    try:
        works = [(link.isend(header, _TAG), header.numel() * 8)]
        if data is not None:
            works += [(link.isend(data[a:b], _TAG + 1), b - a) for a, b in _chunks(len(payload))]
        for work, nbytes in works:
            link.wait(work, nbytes)
    except LinkError as exc:
        raise RecoveryError(f"sending {len(payload)} B of state over {link!r} failed") from exc


def recv_bytes(link: Link) -> bytes:
    """Receive what the peer of ``link`` sends with :func:`send_bytes`.

    Raises:
        RecoveryError: the link failed, or the bytes do not match their digest.
    """
    header = torch.empty(1 + _DIGEST, dtype=torch.int64)
    try:
        link.wait(link.irecv(header, _TAG), header.numel() * 8)
        n = int(header[0])
        data = torch.empty(n, dtype=torch.uint8)
        works = [(link.irecv(data[a:b], _TAG + 1), b - a) for a, b in _chunks(n)]
        for work, nbytes in works:
            link.wait(work, nbytes)
    except LinkError as exc:
        raise RecoveryError(f"receiving state over {link!r} failed") from exc
    payload = data.numpy().tobytes()
    want = bytes(int(x) for x in header[1:])
    if hashlib.sha256(payload).digest() != want:
        raise RecoveryError(f"state received over {link!r} ({n} B) does not match its SHA-256")
    return payload
