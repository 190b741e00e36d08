"""all_to_all and all_to_all_single (placeholder, being built)."""

from __future__ import annotations

from typing import Any

from resilient.group.epoch_control import EpochControl
from resilient.group.work import ResilientWork

__all__ = ["AllToAllCalls"]


class AllToAllCalls:
    def __init__(self, *, rank: int, size: int, epochs: EpochControl, submit: Any) -> None:
        self._rank, self._size, self._epochs, self._submit = rank, size, epochs, submit

    def all_to_all(self, outputs: Any, inputs: Any, opts: Any = None) -> ResilientWork:
        raise NotImplementedError("resilient process group: 'all_to_all' is not supported yet")

    def all_to_all_single(
        self, output: Any, input: Any, out_splits: Any, in_splits: Any, opts: Any = None
    ) -> ResilientWork:
        raise NotImplementedError(
            "resilient process group: 'all_to_all_single' is not supported yet"
        )
