"""Which ranks hold the same shards of a sharded state (FSDP2/HSDP DTensors), so a
rank behind is restored from a replica of its own shards and never from another
rank's.

A DTensor says how it is laid out: its device mesh (a grid of global ranks) and a
placement per mesh dimension. On a ``Shard`` dimension the ranks hold different
pieces; on a ``Replicate`` dimension they hold the same. So rank ``q`` holds the
pieces named by its coordinates on the shard dimensions, and two ranks hold the
same state when those coordinates agree for every layout in the state. Under HSDP
on a (replicate, shard) mesh that pairs each rank with the ranks of the same
column: its replicas. Under plain FSDP every rank's key is its own: no replica.

Pure functions of the state's layout: every rank computes every rank's key alike,
a replacement included (it builds the same model on the same mesh).
"""

from __future__ import annotations

import json
import sys
from collections.abc import Iterator, Mapping
from itertools import chain
from typing import Any

import torch

from recovery.state import StateHook, TrainState
from resilient.errors import RecoveryError

__all__ = [
    "Layout", "check_replicas", "layout_key", "may_hold_dtensors", "replica_key", "sharded_at",
    "unreplicated",
]  # fmt: skip

# A DTensor layout: (mesh shape, the mesh's ranks in row-major order, the Shard
# dimensions).
Layout = tuple[tuple[int, ...], tuple[int, ...], tuple[int, ...]]


def _is_dtensor(t: torch.Tensor) -> bool:
    return type(t).__name__ == "DTensor"


def _tensors(obj: Any, path: str = "") -> Iterator[tuple[str, torch.Tensor]]:
    if isinstance(obj, torch.Tensor):
        yield path, obj
        return
    items = obj.items() if isinstance(obj, Mapping) else enumerate(obj) if isinstance(
        obj, list | tuple
    ) else ()  # fmt: skip
    for key, value in items:
        yield from _tensors(value, f"{path}/{key}")


def sharded_at(state: Any) -> str | None:
    """The path of the first DTensor in ``state`` (a ``state_dict()``), or None."""
    return next((path for path, t in _tensors(state) if _is_dtensor(t)), None)


def may_hold_dtensors(state: StateHook) -> bool:
    """Whether ``state.state_dict()`` may hold a DTensor, told without calling it
    (a custom hook's may copy or gather; :class:`~recovery.session.Session` asks
    at setup). False only where none can be: DTensor was never imported, or a
    plain :class:`TrainState` whose model and optimizer hold none and have nothing
    that could make its state dict differ from its tensors (state_dict hooks or
    overrides: FSDP1's sharded state dicts are DTensors of plain parameters).
    The optimizer's state is made per parameter, so it holds DTensors only for
    DTensor parameters.
    """
    if "torch.distributed.tensor" not in sys.modules:
        return False  # no DTensor can exist (DDP's constructor imports it, though)
    if type(state) is not TrainState:
        return True  # only its own state_dict() can tell
    base, opt = torch.nn.Module, state.optimizer
    for m in state.model.modules():
        if (
            m._state_dict_hooks
            or m._state_dict_pre_hooks
            or any(
                getattr(type(m), f) is not getattr(base, f)
                for f in ("state_dict", "_save_to_state_dict", "get_extra_state")
            )
        ):
            return True
    params = chain(state.model.parameters(), state.model.buffers(),
                   (p for group in opt.param_groups for p in group["params"]))  # fmt: skip
    hooks = opt._optimizer_state_dict_pre_hooks or opt._optimizer_state_dict_post_hooks
    return bool(hooks) or any(_is_dtensor(t) for t in params) or sharded_at(state.extra) is not None


def _layouts(state: Any) -> list[Layout]:
    """The distinct layouts of the DTensors in ``state``.

    Raises:
        RecoveryError: a DTensor is Partial (a pending reduction is no state).
    """
    found: set[Layout] = set()
    for path, t in _tensors(state):
        if not _is_dtensor(t):
            continue
        placements = t.placements  # type: ignore[attr-defined]
        if any(p.is_partial() for p in placements):
            raise RecoveryError(f"recovery: the state's DTensor at {path} is Partial")
        mesh = t.device_mesh.mesh  # type: ignore[attr-defined]
        shard_dims = tuple(i for i, p in enumerate(placements) if p.is_shard())
        found.add((tuple(mesh.shape), tuple(int(r) for r in mesh.flatten()), shard_dims))
    return sorted(found)


def layout_key(layouts: list[Layout], rank: int) -> str:
    """``rank``'s coordinates on each layout's Shard dimensions, as one string
    (``""`` without layouts; ``null`` for a layout whose mesh lacks ``rank``)."""
    coords: list[list[int] | None] = []
    for shape, ranks, shard_dims in layouts:
        if rank not in ranks:
            coords.append(None)
            continue
        flat, where = ranks.index(rank), []
        for size in reversed(shape):
            where.append(flat % size)
            flat //= size
        where.reverse()
        coords.append([where[d] for d in shard_dims])
    return json.dumps(coords, separators=(",", ":")) if layouts else ""


def replica_key(state: Any, rank: int) -> str:
    """What identifies the shards ``rank`` holds in ``state`` (``""``: no DTensor,
    the state is whole on every rank). Equal keys: the same shards.

    Raises:
        RecoveryError: a DTensor is Partial.
    """
    return layout_key(_layouts(state), rank)


def check_replicas(state: Any, world: int) -> None:
    """Make sure every rank's shards have a replica on another rank.

    Raises:
        RecoveryError: a rank's shards are held by no other rank (plain FSDP): a
            lost rank could not be restored from a peer. Names the rank and where.
    """
    layouts = _layouts(state)
    missing = unreplicated(layouts, world)
    if missing is not None:
        rank, key = missing
        raise RecoveryError(
            f"recovery.Session: rank {rank}'s shards (the DTensor at {sharded_at(state)} and "
            f"the rest; shard coordinates {key}) have no replica on another rank, as under "
            "plain FSDP: a lost rank could not be restored from a peer. Use HSDP (a "
            "replicate mesh dimension of 2 or more), or give Session a rollback= "
            "(recovery.Rollback: every rank goes back to the last checkpoint; "
            "examples/train_fsdp.py --checkpoint-dir)"
        )


def unreplicated(layouts: list[Layout], world: int) -> tuple[int, str] | None:
    """The first rank (and its key) whose shards no other rank holds, or None."""
    if not layouts:
        return None
    keys = [layout_key(layouts, q) for q in range(world)]
    for q, key in enumerate(keys):
        if keys.count(key) < 2:
            return q, key
    return None
