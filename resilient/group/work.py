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

__all__ = ["Failed", "ResilientWork"]


class Failed:
    """A collective's exception, carried as the value of its root future."""

    __slots__ = ("exc",)

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __reduce__(self) -> tuple[Any, ...]:
        # torch pickles the value of a future with CUDA devices to find its tensors;
        # an error holds none, and its arguments need not pickle.
        return (Failed, (RuntimeError(str(self.exc)),))


def _unwrap(fut: Future[Any]) -> Any:
    value = fut.value()
    if isinstance(value, Failed):
        raise value.exc
    return value


class ResilientWork(Work):
    """Completes when its collective does; ``wait`` re-raises the collective's error.

    ``root`` is completed by the communication thread with the result or a
    :class:`Failed`. ``wait`` raises the error with its :mod:`resilient.errors` type.
    ``get_future`` hands out a ``then`` child of ``root`` whose C++ future is marked
    failed on error (a callback that raises does that), which is what C++ consumers
    such as DDP's reducer understand. ``Future.set_exception`` would only store the
    exception as a *value*: the reducer then reads a Python object as tensors in a
    thread without the GIL and the process dies with SIGSEGV (seen on a peer kill).
    Python waiters on that child see the error wrapped in a RuntimeError.
    """

    def __init__(self, root: Future[Any], op: str, timeout: timedelta | None = None) -> None:
        super().__init__()
        self._root = root
        # Made on first ask: most works (a p2p ping-pong's) are only waited for, and a
        # child future costs as much as the rest of a small op's bookkeeping.
        self._future: Future[Any] | None = None
        self._op = op
        self._timeout = timeout  # the group's (init_process_group's timeout=)

    def wait(self, timeout: timedelta | None = None) -> bool:
        """Wait for the op (at most ``timeout``, default the group's timeout).

        Raises:
            CollectiveTimeout: not complete in time (the op itself goes on).
            ResilientError: the op's own error (LinkError, PeerLost, ...).
        """
        timeout = timeout if timeout is not None else self._timeout
        if timeout is not None and timeout.total_seconds() > 0 and not self._root.done():
            done = threading.Event()
            self._root.add_done_callback(lambda _: done.set())
            if not done.wait(timeout.total_seconds()):
                raise CollectiveTimeout(
                    f"resilient {self._op}: not complete within its timeout of {timeout} "
                    "(init_process_group's timeout=, or wait's)"
                )
        value = self._root.wait()
        if isinstance(value, Failed):
            raise value.exc
        return True

    def is_completed(self) -> bool:
        return bool(self._root.done())

    def is_success(self) -> bool:
        return bool(self._root.done()) and not isinstance(self._root.value(), Failed)

    def get_future(self) -> Future[Any]:
        if self._future is None:
            self._future = self._root.then(_unwrap)
        return self._future

    def result(self) -> list[torch.Tensor]:
        value = self._root.value()
        if isinstance(value, Failed):
            raise value.exc
        return list(value)


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
