"""A state as it travels from a donor to a rank behind: a header and its tensors.

:func:`pack` walks a state (nested dicts, lists and tuples, as ``state_dict()``
returns) and takes every tensor out, leaving a meta tensor of the same shape and
dtype in its place; the header is ``torch.save`` of that skeleton (kilobytes),
and the tensors go over the link as they are (:mod:`resilient.links.transfer`).
:func:`unpack` loads the header, allocates a tensor for each meta tensor, and
returns the state that the received bytes complete. For 100 MB of parameters
this skips serializing the bulk on the donor (which every survivor did while
waiting, in case it became the donor) and deserializing it on the receiver.

Dict subclasses keep their type and attributes (``state_dict()``'s
``_metadata``, which ``load_state_dict`` reads).
"""

from __future__ import annotations

import copy
import io
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch

from resilient.errors import RecoveryError

__all__ = ["Packed", "pack", "size_of", "unpack"]


@dataclass(frozen=True, slots=True)
class Packed:
    """A state ready to send: the header and the tensors, in walk order."""

    header: memoryview
    tensors: tuple[torch.Tensor, ...]

    @property
    def nbytes(self) -> int:
        return len(self.header) + sum(t.nbytes for t in self.tensors)


def _map(obj: Any, fn: Callable[[torch.Tensor], torch.Tensor]) -> Any:
    """``obj`` with ``fn`` applied to every tensor in it; containers are copied
    (the same order on both ends: insertion order, then position)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps the subclass and its attributes
        for key, value in obj.items():
            out[key] = _map(value, fn)
        return out
    if isinstance(obj, list):
        return [_map(v, fn) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_map(v, fn) for v in obj)
    return obj


def size_of(state: Any) -> int:
    """The bytes of the tensors in ``state`` (nothing is copied)."""
    sizes: list[int] = []

    def count(t: torch.Tensor) -> torch.Tensor:
        sizes.append(t.nbytes)
        return t

    _map(state, count)
    return sum(sizes)


def pack(state: Any) -> Packed:
    """Split ``state`` into a header and its tensors (CUDA or non-contiguous ones
    are copied into contiguous CPU tensors; the rest are sent from where they are,
    so ``state`` must not change until they are sent)."""
    tensors: list[torch.Tensor] = []

    def take(t: torch.Tensor) -> torch.Tensor:
        plain = t.detach()
        tensors.append(plain.cpu().contiguous())
        return plain.to("meta")

    skeleton = _map(state, take)
    buf = io.BytesIO()
    torch.save(skeleton, buf)
    return Packed(header=buf.getbuffer(), tensors=tuple(tensors))


def _walk(obj: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], torch.Tensor]]:
    """``(path, tensor)`` for every tensor of ``obj``, in :func:`_map`'s order."""
    if isinstance(obj, torch.Tensor):
        yield path, obj
    elif isinstance(obj, dict):
        for key, value in obj.items():
            yield from _walk(value, (*path, key))
    elif isinstance(obj, list | tuple):
        for i, value in enumerate(obj):
            yield from _walk(value, (*path, i))


def _in_place(skeleton: Any, like: Any) -> list[torch.Tensor | None]:
    """Per tensor of ``skeleton``, the tensor of ``like`` it can be received into:
    at the same path (keys and positions), CPU, contiguous, same shape and dtype
    (None: allocate one; e.g. optimizer state the receiver does not have yet)."""
    have = dict(_walk(like))
    out: list[torch.Tensor | None] = []
    for path, w in _walk(skeleton):
        h = have.get(path)
        fits = h is not None and h.device.type == "cpu" and h.is_contiguous()
        out.append(
            h.detach()
            if h is not None and fits and (h.shape, h.dtype) == (w.shape, w.dtype)
            else None
        )
    return out


def unpack(
    header: bytes | bytearray | memoryview, like: Any = None
) -> tuple[Any, list[torch.Tensor]]:
    """The state ``header`` describes, and the tensors in it to receive into.

    ``like``: the receiver's own state of the same layout (``state_dict()``); its
    tensors are received into where they fit, so the bytes land in the model's
    parameters directly: no second copy of the state in memory, no copy when it
    is loaded (``load_state_dict`` of a tensor into itself does nothing). The
    receiver's state is then overwritten as the bytes arrive, so a transfer that
    fails leaves it partly written: use it only where the old state is given up
    anyway (a rank behind loads the donor's or stops).

    Raises:
        RecoveryError: ``header`` is not one :func:`pack` wrote.
    """
    try:
        skeleton = torch.load(io.BytesIO(header), weights_only=True)
    except Exception as exc:  # torch raises several types for a corrupt archive
        raise RecoveryError(f"a state header of {len(header)} B could not be read") from exc
    into: list[torch.Tensor] = []
    reuse = iter(_in_place(skeleton, like) if like is not None else ())

    def make(t: torch.Tensor) -> torch.Tensor:
        if t.device.type != "meta":
            raise RecoveryError(f"a state header holds data ({t.dtype} {tuple(t.shape)})")
        mine = next(reuse, None)
        into.append(mine if mine is not None else torch.empty(t.shape, dtype=t.dtype))
        return into[-1]

    return _map(skeleton, make), into
