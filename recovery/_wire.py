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

A DTensor (FSDP2/HSDP) travels as its local shard, in a marker dict that keeps
its placements, global shape and stride and its mesh's ranks; :func:`unpack`
makes it a DTensor again on the receiver's mesh of the same ranks (found in the
receiver's own state). The donor must hold the receiver's shards
(:mod:`recovery.replicas`).
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


def _map(
    obj: Any,
    fn: Callable[[torch.Tensor], Any],
    marker: Callable[[dict[str, Any]], Any] | None = None,
) -> Any:
    """``obj`` with ``fn`` applied to every tensor in it (and ``marker`` to every
    DTensor marker dict, when given); containers are copied (the same order on
    both ends: insertion order, then position)."""
    if isinstance(obj, torch.Tensor):
        return fn(obj)
    if isinstance(obj, dict):
        if marker is not None and _DTENSOR in obj:
            return marker(obj)
        out = copy.copy(obj)  # keeps the subclass and its attributes
        for key, value in obj.items():
            out[key] = _map(value, fn, marker)
        return out
    if isinstance(obj, list):
        return [_map(v, fn, marker) for v in obj]
    if isinstance(obj, tuple):
        return tuple(_map(v, fn, marker) for v in obj)
    return obj


def size_of(state: Any) -> int:
    """The bytes of the tensors in ``state`` (nothing is copied)."""
    sizes: list[int] = []

    def count(t: torch.Tensor) -> torch.Tensor:
        sizes.append(t.nbytes)
        return t

    _map(state, count)
    return sum(sizes)


_DTENSOR = "__dtensor__"


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


def _placement(p: Any) -> list[Any]:
    if p.is_shard():
        return ["S", int(p.dim)]
    if p.is_replicate():
        return ["R"]
    raise RecoveryError(f"a state's DTensor has placement {p} (only Shard and Replicate travel)")


def _marker(t: Any, local: torch.Tensor) -> dict[str, Any]:
    """What stands for DTensor ``t`` in a header: its local shard (a meta tensor)
    and what rebuilds it (plain values: the header loads with ``weights_only``)."""
    mesh = t.device_mesh.mesh
    return {
        _DTENSOR: local,
        "placements": [_placement(p) for p in t.placements],
        "shape": list(t.shape),
        "stride": list(t.stride()),
        "mesh": [list(mesh.shape), [int(r) for r in mesh.flatten()]],
    }


def pack(state: Any) -> Packed:
    """Split ``state`` into a header and its tensors (CUDA or non-contiguous ones
    are copied into contiguous CPU tensors; the rest are sent from where they are,
    so ``state`` must not change until they are sent). DTensors send their local
    shard.

    Raises:
        RecoveryError: a DTensor placement other than Shard or Replicate.
    """
    tensors: list[torch.Tensor] = []

    def take(t: torch.Tensor) -> Any:
        if _is_dtensor(t):
            local = t.to_local().detach()  # type: ignore[attr-defined]
            tensors.append(local.cpu().contiguous())
            return _marker(t, local.to("meta"))
        plain = t.detach()
        tensors.append(plain.cpu().contiguous())
        return plain.to("meta")

    skeleton = _map(state, take)
    buf = io.BytesIO()
    torch.save(skeleton, buf)
    return Packed(header=buf.getbuffer(), tensors=tuple(tensors))


def _walk(obj: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], torch.Tensor]]:
    """``(path, tensor)`` for every tensor of ``obj``, in :func:`_map`'s order."""
    if isinstance(obj, torch.Tensor) and _is_dtensor(obj):
        yield (*path, _DTENSOR), obj.to_local()  # type: ignore[attr-defined]
    elif isinstance(obj, torch.Tensor):
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

    DTensors are rebuilt on the mesh of the same ranks that ``like`` holds.

    Raises:
        RecoveryError: ``header`` is not one :func:`pack` wrote, or it holds a
            DTensor on a mesh ``like`` has none of.
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

    return _rebuild(_map(skeleton, make), _meshes(like)), into


def _meshes(like: Any) -> dict[tuple[tuple[int, ...], tuple[int, ...]], Any]:
    """The device meshes of ``like``'s DTensors, by (shape, ranks)."""
    found = {}
    stack = [like]
    while stack:
        obj = stack.pop()
        if isinstance(obj, torch.Tensor):
            if _is_dtensor(obj):
                mesh = obj.device_mesh  # type: ignore[attr-defined]
                key = (tuple(mesh.mesh.shape), tuple(int(r) for r in mesh.mesh.flatten()))
                found[key] = mesh
        elif isinstance(obj, dict):
            stack.extend(obj.values())
        elif isinstance(obj, list | tuple):
            stack.extend(obj)
    return found


def _rebuild(obj: Any, meshes: dict[tuple[tuple[int, ...], tuple[int, ...]], Any]) -> Any:
    """``obj`` with every DTensor marker made a DTensor again (see :func:`_marker`)."""

    def dtensor(found: dict[str, Any]) -> Any:
        from torch.distributed.tensor import DTensor, Replicate, Shard

        shape, ranks = found["mesh"]
        mesh = meshes.get((tuple(shape), tuple(ranks)))
        if mesh is None:
            raise RecoveryError(
                f"a state's DTensor lives on a mesh of ranks {ranks} (shape {shape}) that "
                "the receiving rank's own state does not use"
            )
        placements = [Shard(p[1]) if p[0] == "S" else Replicate() for p in found["placements"]]
        return DTensor.from_local(
            found[_DTENSOR], mesh, placements, run_check=False,
            shape=torch.Size(found["shape"]), stride=tuple(found["stride"]),
        )  # fmt: skip

    return _map(obj, lambda t: t, dtensor)
