"""Moving a state over one data-plane link: a header, then tensors' raw bytes.

A state (see :mod:`recovery._wire`) travels as a small header (the state with
every tensor replaced by its shape and dtype) and the tensors themselves, sent
from where they lie and received straight into tensors the receiver allocated from
the header: no serialization of the bulk, no copy into one byte string and back.

On the wire: the header's length, the header, each tensor's bytes in chunks (all
posted at once, so the kernel keeps the link busy), then a SHA-256 over the header
and every tensor. Both ends hash while the bytes are in flight: the sender after
posting them, the receiver chunk by chunk as they land (hashlib releases the GIL
on large buffers; gloo moves the bytes in its own threads), so the checksum costs
the transfer almost no time. A digest that does not match is an error, never a
silent load.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from typing import Any, Final

import torch

from resilient.errors import LinkError, RecoveryError
from resilient.links.table import Link

__all__ = ["CHUNK_BYTES", "recv_state", "send_state"]

# Far above the tags collectives use (rail/generation shifts stay below 1 << 24).
_TAG: Final = 1 << 28
_HEADER_TAG: Final = _TAG + 1
_DATA_TAG: Final = _TAG + 2
_DIGEST_TAG: Final = _TAG + 3
CHUNK_BYTES: Final = 4 << 20
_DIGEST: Final = 32

# Receives the header; returns the tensors the bytes that follow go into, in order.
Allocate = Callable[[bytearray], Sequence[torch.Tensor]]


def _chunks(t: torch.Tensor) -> list[torch.Tensor]:
    """``t``'s bytes (contiguous, CPU) as uint8 views of at most CHUNK_BYTES."""
    raw = t.reshape(-1).view(torch.uint8)
    return [raw[off : off + CHUNK_BYTES] for off in range(0, raw.numel(), CHUNK_BYTES)]


def _check_plain(tensors: Sequence[torch.Tensor]) -> None:
    for t in tensors:
        if t.device.type != "cpu" or not t.is_contiguous():
            raise ValueError(
                "state tensors must be contiguous CPU tensors, got a "
                f"{'non-contiguous ' if not t.is_contiguous() else ''}{t.device.type} "
                f"{t.dtype} tensor of shape {tuple(t.shape)}"
            )


def _u8(buf: bytes | bytearray | memoryview) -> torch.Tensor:
    """A uint8 view of ``buf`` (a copy only for read-only ``bytes``)."""
    writable = buf if isinstance(buf, bytearray | memoryview) else bytearray(buf)
    return torch.frombuffer(writable, dtype=torch.uint8)


def send_state(
    link: Link, header: bytes | bytearray | memoryview, tensors: Sequence[torch.Tensor]
) -> None:
    """Send ``header`` and ``tensors`` to ``link.peer``, which calls :func:`recv_state`.

    Raises:
        ValueError: a tensor is not a contiguous CPU tensor (nothing was sent).
        RecoveryError: the link failed or missed its deadline (the cause attached).
    """
    _check_plain(tensors)
    if not len(header):
        raise ValueError("a state header must not be empty")
    pieces = [c for t in tensors for c in _chunks(t)]
    try:
        works: list[tuple[Any, int]] = [
            (link.isend(torch.tensor([len(header)], dtype=torch.int64), _TAG), 8),
            (link.isend(_u8(header), _HEADER_TAG), len(header)),
        ]
        works += [(link.isend(p, _DATA_TAG), p.numel()) for p in pieces]
        hasher = hashlib.sha256(header)
        for p in pieces:
            hasher.update(p.numpy().data)
        works.append((link.isend(_u8(hasher.digest()), _DIGEST_TAG), _DIGEST))
        for work, nbytes in works:
            link.wait(work, nbytes)
    except LinkError as exc:
        total = len(header) + sum(p.numel() for p in pieces)
        raise RecoveryError(f"sending {total} B of state over {link!r} failed") from exc


def recv_state(link: Link, allocate: Allocate) -> int:
    """Receive what the peer of ``link`` sends with :func:`send_state`: the header
    goes to ``allocate``, the bytes into the tensors it returns. Returns the bytes
    received.

    Raises:
        RecoveryError: the link failed, or the bytes do not match their digest.
        Whatever ``allocate`` raises (a header it cannot read), after which the
            link is not usable for another state: the peer's bytes are unread.
    """
    length = torch.empty(1, dtype=torch.int64)
    try:
        link.wait(link.irecv(length, _TAG), 8)
        header = bytearray(int(length[0]))
        link.wait(link.irecv(_u8(header), _HEADER_TAG), len(header))
    except LinkError as exc:
        raise RecoveryError(f"receiving a state header over {link!r} failed") from exc
    into = allocate(header)
    _check_plain(into)
    pieces = [c for t in into for c in _chunks(t)]
    hasher = hashlib.sha256(header)
    digest = bytearray(_DIGEST)
    try:
        works = [link.irecv(p, _DATA_TAG) for p in pieces]
        digest_work = link.irecv(_u8(digest), _DIGEST_TAG)
        for work, p in zip(works, pieces, strict=True):
            link.wait(work, p.numel())
            hasher.update(p.numpy().data)
        link.wait(digest_work, _DIGEST)
    except LinkError as exc:
        raise RecoveryError(f"receiving state over {link!r} failed") from exc
    total = len(header) + sum(p.numel() for p in pieces)
    if hasher.digest() != digest:
        raise RecoveryError(f"state received over {link!r} ({total} B) does not match its SHA-256")
    return total
