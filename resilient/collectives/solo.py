"""Collectives of a rank that was not admitted yet: run as if the world were this rank.

A replacement process (incarnation > 0) builds its model and wraps it in DDP
before the running ranks can admit it. DDP's constructor and its first two
iterations issue collectives the running ranks never issue again (a parameter
check, a broadcast of rank 0's parameters, a broadcast of the rebuilt bucket
order). The joiner runs those locally: its parameters are replaced by a donor's
state anyway, and the bucket order DDP derives alone is the order every rank
derives from the same model. :class:`recovery.Session` admits the rank afterwards.

Outside the session's warm-up (:attr:`SoloEngine.warming`), only
:data:`FREE_CALLS` calls run alone (DDP's constructor needs three or four, one
more per 250 MB of parameters): a replacement whose script never joins must fail,
not train alone and diverge.
"""

from __future__ import annotations

import logging

import torch

from resilient.collectives.reduce_ops import Reduce
from resilient.collectives.ring_plan import Span, even_bounds
from resilient.errors import RecoveryError

__all__ = ["FREE_CALLS", "SoloEngine"]

FREE_CALLS = 32

logger = logging.getLogger(__name__)


class SoloEngine:
    """The :class:`~resilient.collectives.engine.RingEngine` calls, done by this rank alone."""

    def __init__(self, rank: int, world: int) -> None:
        self.rank, self.world = rank, world
        self._warned = False
        self.warming = False  # set by recovery.Session while it runs the warm-up
        self._free = FREE_CALLS

    def _note(self, op: str) -> None:
        """Raises RecoveryError once the calls allowed outside a warm-up are spent."""
        if not self.warming:
            self._free -= 1
            if self._free < 0:
                raise RecoveryError(
                    f"rank {self.rank} is a replacement (RESILIENT_INCARNATION > 0) that was "
                    f"never admitted: {op} cannot run alone; train under recovery.Session, "
                    "which brings a replacement into the running job"
                )
        if not self._warned:
            self._warned = True
            logger.warning(
                "rank %d (epoch -, step -): not admitted to the job yet; %s and later "
                "collectives run on this rank alone until recovery.Session admits it",
                self.rank, op,
            )  # fmt: skip

    def all_reduce(self, flat: torch.Tensor, op: Reduce) -> None:
        self._note("all_reduce")

    def reduce_scatter(self, flat: torch.Tensor, op: Reduce) -> Span:
        self._note("reduce_scatter")
        return even_bounds(flat.numel(), self.world)[self.rank]

    def all_gather(self, flat: torch.Tensor) -> None:
        self._note("all_gather")
        mine = even_bounds(flat.numel(), self.world)[self.rank]
        block = flat[mine.start : mine.stop]
        for span in even_bounds(flat.numel(), self.world):
            if span != mine:
                flat[span.start : span.stop].copy_(block)

    def broadcast(self, flat: torch.Tensor, root: int) -> None:
        self._note("broadcast")

    def barrier(self) -> None:
        self._note("barrier")

    def close(self, *, wait: bool = True) -> None:
        pass
