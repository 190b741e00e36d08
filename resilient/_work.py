"""Work objects and tensor packing of the resilient process group."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from datetime import timedelta
from typing import Any

import torch
from torch._C._distributed_c10d import Work
from torch.futures import Future

from resilient.errors import CollectiveTimeout

__all__ = ["ResilientWork"]


class ResilientWork(Work):
    """Completes when its collective does; ``wait`` re-raises the collective's error.

    Errors keep their :mod:`resilient.errors` type when waited on from Python.
    """

    def __init__(self, future: Future[Any], op: str) -> None:
        super().__init__()
        self._future = future
        self._op = op

    def wait(self, timeout: timedelta | None = None) -> bool:
        if timeout is not None and timeout.total_seconds() > 0:
            done = threading.Event()
            self._future.add_done_callback(lambda _: done.set())
            if not done.wait(timeout.total_seconds()):
                raise CollectiveTimeout(f"{self._op} not complete after {timeout}")
        self._future.wait()  # raises the collective's exception
        return True

    def is_completed(self) -> bool:
        return bool(self._future.done())

    def is_success(self) -> bool:
        if not self._future.done():
            return False
        try:
            self._future.value()
        except Exception:
            return False
        return True

    def get_future(self) -> Future[Any]:
        return self._future

    def result(self) -> list[torch.Tensor]:
        return list(self._future.value())


def _packed(tensors: Sequence[torch.Tensor]) -> torch.Tensor:
    """The tensors' values as one flat buffer (read when the exchange runs)."""
    if len(tensors) == 1:
        return tensors[0].reshape(-1)
    return torch.cat([t.reshape(-1) for t in tensors])


class _Flat:
    """A flat contiguous view of ``tensors`` (all one dtype), copied back on exit.

    A single contiguous tensor is used in place; anything else goes through one
    packed buffer.
    """

    def __init__(self, tensors: Sequence[torch.Tensor]) -> None:
        self.tensors = list(tensors)
        dtypes = {t.dtype for t in self.tensors}
        if len(dtypes) > 1:
            raise TypeError(f"resilient: tensors of one call must share a dtype, got {dtypes}")
        self.inplace = len(self.tensors) == 1 and self.tensors[0].is_contiguous()
        if self.inplace:
            self.buffer = self.tensors[0].view(-1)
        else:
            self.buffer = torch.cat([t.reshape(-1) for t in self.tensors])

    def __enter__(self) -> _Flat:
        return self

    def __exit__(self, exc_type: object, *rest: object) -> None:
        if exc_type is not None or self.inplace:
            return
        offset = 0
        for t in self.tensors:
            n = t.numel()
            t.copy_(self.buffer[offset : offset + n].view_as(t))
            offset += n
