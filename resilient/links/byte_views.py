"""A buffer as bytes and back: what a link posts is a tensor or a byte view of one.

Socket links take byte views (:func:`bytes_of` makes one of a tensor without a
copy; the mesh schedule posts slices of one view of its buffer,
:mod:`resilient.collectives.mesh`); links whose group takes tensors only (gloo
pairs, the store's relay) turn a byte view back into a tensor with :func:`as_tensor`.
"""

from __future__ import annotations

from typing import Any

import torch

__all__ = ["as_tensor", "bytes_of"]


def bytes_of(tensor: torch.Tensor | memoryview) -> memoryview:
    """The bytes of a contiguous CPU tensor, without a copy (a byte view as it is:
    the mesh schedule posts slices of one view of its buffer, resilient.collectives.mesh)."""
    if type(tensor) is memoryview:
        return tensor
    try:  # dtypes numpy knows (all but bfloat16), no grad: the cheaper way
        array: Any = tensor.numpy()
    except (TypeError, RuntimeError):
        array = tensor.reshape(-1).view(torch.uint8).numpy()
    return memoryview(array).cast("B")


def as_tensor(buf: torch.Tensor | memoryview) -> torch.Tensor:
    """``buf`` as a tensor: a byte view (what the mesh schedule posts on socket
    links, resilient.collectives.mesh) becomes a uint8 tensor over the same memory, for a
    link whose group takes tensors only (gloo pairs, the store's relay)."""
    if type(buf) is not memoryview:
        return buf
    if not buf.nbytes:
        return torch.empty(0, dtype=torch.uint8)
    return torch.frombuffer(buf, dtype=torch.uint8)
