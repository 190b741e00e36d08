"""send and recv between two ranks of a group (placeholder, being built)."""

from __future__ import annotations

from typing import Any

from resilient.group.epoch_control import EpochControl
from resilient.group.work import ResilientWork

__all__ = ["PointToPoint"]


class PointToPoint:
    def __init__(self, *, rank: int, size: int, epochs: EpochControl) -> None:
        self._rank, self._size, self._epochs = rank, size, epochs

    def send(self, tensors: Any, dst: int, tag: int) -> ResilientWork:
        raise NotImplementedError("resilient process group: 'send' is not supported yet")

    def recv(self, tensors: Any, src: int, tag: int) -> ResilientWork:
        raise NotImplementedError("resilient process group: 'recv' is not supported yet")

    def recv_anysource(self, tensors: Any, tag: int) -> ResilientWork:
        raise NotImplementedError("resilient process group: recv from any source is not supported")
