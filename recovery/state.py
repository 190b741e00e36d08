"""What a recovery saves and restores (:class:`StateHook`, :class:`TrainState`),
and the DDP comm hook that averages over the members of a shrunk group."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any, Protocol, TypeAlias, runtime_checkable

import torch

from resilient.errors import ConfigError, PeerLost

__all__ = [
    "FsdpModules",
    "StateHook",
    "TrainState",
    "average_over_members",
    "cut_forward",
    "fsdp_roots",
    "reset_fsdp",
    "reset_reducer",
]


# What ``Session(fsdp=...)`` takes: the FSDP2 module(s) to reset (fsdp_roots).
FsdpModules: TypeAlias = torch.nn.Module | Sequence[torch.nn.Module]


@runtime_checkable
class StateHook(Protocol):
    """What a recovery saves on a donor and loads on a rank that is behind."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: Mapping[str, Any]) -> None: ...


class TrainState:
    """A :class:`StateHook` for a model and its optimizer, plus torch's RNG state
    and ``extra`` (a dict of plain values: a data position, a sampler epoch).

    :meth:`commit` runs ``optimizer.step()``: the session calls it when a step's
    block finished without an error.
    """

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        *,
        extra: dict[str, Any] | None = None,
    ) -> None:
        self.model, self.optimizer = model, optimizer
        self.extra = extra if extra is not None else {}

    def state_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.state_dict(),
            "optimizer": self.optimizer.state_dict(),
            "rng": torch.get_rng_state(),
            "extra": dict(self.extra),
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.optimizer.load_state_dict(state["optimizer"])
        torch.set_rng_state(state["rng"])
        self.extra.clear()
        self.extra.update(state["extra"])

    def commit(self) -> None:
        self.optimizer.step()


def fsdp_roots(state: StateHook, fsdp: FsdpModules | None = None) -> list[torch.nn.Module]:
    """The FSDP2 root modules a recovery resets (:func:`reset_fsdp`) before the
    replayed step.

    ``fsdp`` names where they are (``Session(fsdp=...)``), for a :class:`StateHook`
    that is not a :class:`TrainState` or a model whose root is not ``fully_shard``-ed:
    a module or a sequence of them, each standing for its outermost FSDP2 modules
    (itself if ``fully_shard``-ed; else each FSDP2 submodule with no FSDP2 module
    above it inside the named one: FSDP2 makes each of those a root). Name roots
    or modules above them: ``reset_iter_state`` on a non-root FSDP2 module raises
    (torch's RuntimeError). Without ``fsdp``: a TrainState's model if it is an FSDP2
    module, else none.

    Raises:
        ConfigError: a named module holds no FSDP2 module (nothing would be reset:
            most likely the wrong module was named).
    """
    if fsdp is None:
        model = getattr(state, "model", None)
        return [model] if model is not None and _is_fsdp(model) else []
    roots: list[torch.nn.Module] = []
    for named in [fsdp] if isinstance(fsdp, torch.nn.Module) else list(fsdp):
        found = _outermost_fsdp(named)
        if not found:
            raise ConfigError(
                f"recovery: fsdp= names a {type(named).__name__} that holds no FSDP2 module "
                "(fully_shard): name the module(s) fully_shard was applied to"
            )
        roots += [m for m in found if all(m is not r for r in roots)]
    return roots


def _is_fsdp(module: Any) -> bool:
    # FSDPModule's own method (fully_shard makes the module's class a subclass).
    return hasattr(module, "reset_iter_state")


def _outermost_fsdp(module: torch.nn.Module) -> list[torch.nn.Module]:
    if _is_fsdp(module):
        return [module]
    return [m for child in module.children() for m in _outermost_fsdp(child)]


def reset_fsdp(root: Any) -> None:
    """Bring FSDP2 modules out of a step a lost peer ended mid-way, so the next
    forward starts clean (``FSDPModule.reset_iter_state``: reshard, drop the
    iteration's gradient reductions).

    ``reset_iter_state`` waits on a pending all-gather's Work; a Work that failed
    (the lost peer) raises on every wait, so those are dropped first: their
    result is given up with the step anyway. That reads FSDP2's param groups
    (``_get_fsdp_state``, ``_fsdp_param_groups``, ``_all_gather_result``): there
    is no public way to discard a failed prefetch (torch 2.13).
    """
    for module in root.modules():
        get_state = getattr(module, "_get_fsdp_state", None)
        if get_state is None:
            continue
        for group in getattr(get_state(), "_fsdp_param_groups", ()):
            result = getattr(group, "_all_gather_result", None)
            work = getattr(result, "all_gather_work", None)
            if work is not None and work.is_completed() and not work.is_success():
                group._all_gather_result = None
    root.reset_iter_state()


def average_over_members(ddp: Any, pg: Any, *, cut_backward: bool = False) -> None:
    """Make ``ddp`` average gradients over the group's members of the moment.

    DDP divides by the world size it saw at construction; after a shrink that
    would scale every update by (members / world). This comm hook scales by
    1/members instead, before a sum all_reduce, exactly as DDP's own default
    scales by 1/world, so while every rank takes part the bits are the same as
    without it.

    With ``cut_backward``, once the group knows a peer is lost, the hook raises
    :class:`PeerLost` for the next bucket, which ends the backward pass there
    instead of computing the rest of a step that is replayed anyway; DDP's reducer
    must then be reset with :func:`reset_reducer` on every member of the next epoch
    (the session does both, in jobs that cannot shrink).

    Raises:
        RuntimeError: (from DDP) a comm hook was already registered, or training
            already started.
    """
    import torch.distributed as dist

    def hook(_: Any, bucket: Any) -> Any:
        lost = pg.lost if cut_backward else None
        if lost is not None:
            raise PeerLost(str(lost), peer=lost.peer, epoch=lost.epoch)
        buf = bucket.buffer()
        buf.mul_(1.0 / len(pg.members))
        work = dist.all_reduce(buf, group=pg, async_op=True)
        return work.get_future().then(lambda fut: fut.value()[0])

    # DDP rejects a hook whose annotations are not its own types; under postponed
    # evaluation they are strings, so the hook shows none.
    hook.__annotations__.clear()
    ddp.register_comm_hook(None, hook)


def cut_forward(ddp: Any, pg: Any) -> None:
    """Once the group knows a peer is lost, end ``ddp``'s forward pass at the next
    submodule with :class:`PeerLost`, instead of computing the rest of a step that
    is replayed anyway (with the launcher's announcement a loss is known within
    milliseconds, mid-forward: resilient.detect.announcements). Costs one attribute read per
    submodule and forward. Like ``cut_backward``, the session then resets DDP's
    reducer on entering the next epoch."""

    def hook(_: Any, __: Any) -> None:
        lost = pg.lost
        if lost is not None:
            raise PeerLost(str(lost), peer=lost.peer, epoch=lost.epoch)

    for module in ddp.module.modules():
        module.register_forward_pre_hook(hook)


def reset_reducer(ddp: Any) -> None:
    """Clear what DDP's reducer kept of an iteration that ended in an error.

    A backward pass cut short by the comm hook leaves the reducer waiting for the
    rest of its buckets, and DDP's next forward fails ("Expected to have finished
    reduction in the prior iteration"). The reset (DDP's own, used when its process
    group changes) also has the reducer rebuild its buckets after the next
    iteration, with one broadcast of the bucket order from rank 0 (so rank 0 must
    be a member); the bucket layout comes out the same (the same parameters become
    ready in the same order), so the bits of later steps do too. Every member must
    reset at the same step: the session does it on entering an epoch.
    """
    reducer = getattr(ddp, "reducer", None)
    if reducer is not None:
        reducer._reset_state()
