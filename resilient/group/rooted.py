"""reduce, gather and scatter: calls with a root (placeholder, being built)."""

from __future__ import annotations

from typing import Any

from resilient.group.epoch_control import EpochControl
from resilient.group.work import ResilientWork

__all__ = ["RootedCalls"]


class RootedCalls:
    def __init__(self, *, rank: int, size: int, epochs: EpochControl, submit: Any) -> None:
        self._rank, self._size, self._epochs, self._submit = rank, size, epochs, submit

    def reduce(self, tensors: Any, opts: Any = None) -> ResilientWork:
        raise NotImplementedError("resilient process group: 'reduce' is not supported yet")

    def gather(self, outputs: Any, inputs: Any, opts: Any = None) -> ResilientWork:
        raise NotImplementedError("resilient process group: 'gather' is not supported yet")

    def scatter(self, outputs: Any, inputs: Any, opts: Any = None) -> ResilientWork:
        raise NotImplementedError("resilient process group: 'scatter' is not supported yet")
