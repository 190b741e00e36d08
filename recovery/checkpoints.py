"""Distributed checkpoints (torch.distributed.checkpoint, "DCP") under one
directory, and the :class:`~recovery.restore.Rollback` that goes back to them.

::

    checkpoints = DcpCheckpoints(directory)
    state = {"train": ModelOptimizer(model, opt)}
    session = Session(pg, TrainState(model, opt), rollback=checkpoints.rollback(state))
    first = 0 if session.joining else checkpoints.resume(state)
    for step in session.steps(total, start=first):
        with session.step(step):
            ...
        if session.committed == step and (step + 1) % every == 0:
            checkpoints.save(step, state)

Step ``n``'s checkpoint is the directory ``step-<n>``, every rank writing its own
shards; a ``latest`` file names the newest one every rank finished writing. Old
checkpoints are kept: a rollback takes the newest step every member has (a rank
whose save did not end reads an older ``latest``), so that one must still exist.
Every rank must see the same directory (a shared filesystem across hosts).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict
from torch.distributed.checkpoint.state_dict_loader import load as dcp_load
from torch.distributed.checkpoint.state_dict_saver import save as dcp_save

from recovery.restore import Rollback
from resilient.errors import RecoveryError

__all__ = ["DcpCheckpoints", "ModelOptimizer"]

logger = logging.getLogger(__name__)

_LATEST = "latest"


class ModelOptimizer:
    """A model and its optimizer as one DCP ``Stateful``: torch's
    ``get_state_dict``/``set_state_dict`` (parameter names as keys, FSDP2's shards
    as DTensors), so a checkpoint loads into any sharding of the same model."""

    def __init__(self, model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> None:
        self.model, self.optimizer = model, optimizer

    def state_dict(self) -> dict[str, Any]:
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        set_state_dict(
            self.model, self.optimizer,
            model_state_dict=state["model"], optim_state_dict=state["optim"],
        )  # fmt: skip


class DcpCheckpoints:
    """The DCP checkpoints of one job under ``directory`` (see the module doc).

    ``group``: the process group DCP and the save's barriers run on (None: the
    default group). :meth:`save`, :meth:`load` and :meth:`resume` are collectives:
    every rank of ``group`` calls them with the same step and the same keys.
    A state dict's values may be DCP ``Stateful`` (:class:`ModelOptimizer`): those
    are loaded through their ``load_state_dict``; tensors are loaded in place and
    anything else is replaced in the dict (DCP's own rules).
    """

    def __init__(self, directory: str | os.PathLike[str], *, group: Any = None) -> None:
        self.directory = Path(directory)
        self.group = group

    def path(self, step: int) -> Path:
        """Where the checkpoint of ``step`` is (or goes)."""
        return self.directory / f"step-{step}"

    def latest(self) -> int:
        """The step of the newest checkpoint every rank finished writing (-1: none).

        Raises:
            RecoveryError: the ``latest`` file does not hold a step number.
            OSError: it could not be read.
        """
        marker = self.directory / _LATEST
        if not marker.exists():
            return -1
        text = marker.read_text()
        try:
            return int(text)
        except ValueError:
            raise RecoveryError(f"recovery: {marker} holds {text!r}, not a step number") from None

    def save(self, step: int, state_dict: dict[str, Any]) -> None:
        """Every rank writes its shards of ``state_dict`` as step ``step``'s checkpoint;
        once all did, the ``latest`` file names it (replaced atomically by the
        group's rank 0), and every rank sees that before this returns.

        Raises:
            torch.distributed.checkpoint.CheckpointException: a rank failed to write.
            OSError: the ``latest`` file could not be written.
            CommunicationError: a peer was lost in the barriers (resilient backend).
        """
        dcp_save(state_dict, checkpoint_id=self.path(step), process_group=self.group)
        dist.barrier(group=self.group)  # every rank's shards are written
        if dist.get_rank(self.group) == 0:
            tmp = self.directory / f".{_LATEST}-{os.getpid()}"
            tmp.write_text(str(step))
            os.replace(tmp, self.directory / _LATEST)
        dist.barrier(group=self.group)  # every rank reads the new latest()
        logger.info(
            "rank %d: checkpoint of step %d saved in %s", dist.get_rank(), step, self.path(step)
        )

    def load(self, step: int, state_dict: dict[str, Any]) -> None:
        """Load step ``step``'s checkpoint into ``state_dict`` on every rank.

        Raises:
            RecoveryError: there is no checkpoint of ``step``.
            torch.distributed.checkpoint.CheckpointException: a rank failed to
                read it (a key missing from it, a shape that differs).
        """
        where = self.path(step)
        if not where.is_dir():
            raise RecoveryError(f"recovery: no checkpoint of step {step} ({where} is missing)")
        dcp_load(state_dict, checkpoint_id=where, process_group=self.group)

    def resume(self, state_dict: dict[str, Any]) -> int:
        """Load the newest checkpoint into ``state_dict`` (none: leave it); the
        step to train from next (0 without one).

        Raises:
            the errors of :meth:`latest` and :meth:`load`.
        """
        step = self.latest()
        if step >= 0:
            self.load(step, state_dict)
        return step + 1

    def rollback(self, state_dict: dict[str, Any] | Callable[[], dict[str, Any]]) -> Rollback:
        """The :class:`~recovery.restore.Rollback` that loads these checkpoints into
        ``state_dict`` (or into what a callable returns when the rollback comes).

        Its ``latest`` and ``load`` raise what :meth:`latest` and :meth:`load` do.
        """

        def load(step: int) -> None:
            self.load(step, state_dict() if callable(state_dict) else state_dict)

        return Rollback(latest=self.latest, load=load)
