"""CUDA tensors on socket links, staged through pinned host memory.

With ``RESILIENT_CUDA_TRANSPORT=socket`` a collective on CUDA tensors runs on the
group's CPU engine (its socket links, failover, digests and repairs alike): the
flat device buffer is copied into a pinned host buffer, the CPU engine runs the
collective on that, and the result is copied back. Several ranks may then share one
GPU (NCCL takes one per rank), which is how the CUDA path is tested on a one-GPU
machine, and it is the fallback where NCCL is unavailable.

* :class:`HostStaging` holds the pinned buffers, reused by (dtype, element count,
  slot): a DDP job's few bucket sizes pin their memory once. It copies with
  ``non_blocking`` copies on a stream of its own and waits for that stream before
  the host bytes are read or the device bytes handed back. Before reading a device
  tensor it waits for the device (``torch.cuda.synchronize``): the communication
  thread cannot know which stream of the caller's produced the tensor.
* :class:`StagedEngine` gives the engine's calls (all_reduce, reduce_scatter,
  all_gather, broadcast, barrier) on device tensors, staged.

What a tensor needs staging and how host memory is pinned are parameters, so the
logic (buffer reuse, what is copied which way, nothing copied back after a failure)
is tested on CPU; the CUDA copies only on a GPU. One :class:`HostStaging` serves
one communication thread (not thread-safe).
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from resilient.collectives.engine import RingEngine
from resilient.collectives.reduce_ops import Reduce
from resilient.collectives.ring_plan import Span
from resilient.collectives.solo import SoloEngine

__all__ = ["HostStaging", "StagedEngine", "cuda_devices"]

logger = logging.getLogger(__name__)

Key = tuple[torch.dtype, int, int]  # dtype, element count, slot


def cuda_devices(tensors: Iterable[torch.Tensor]) -> list[torch.device]:
    """The distinct CUDA devices of ``tensors``, in first-seen order (what a
    ``torch.futures.Future(devices=...)`` of their call should carry)."""
    seen: list[torch.device] = []
    for t in tensors:
        if t.device.type == "cuda" and t.device not in seen:
            seen.append(t.device)
    return seen


def _on_cuda(t: torch.Tensor) -> bool:
    return t.device.type == "cuda"


def _pinned(t: torch.Tensor) -> torch.Tensor:
    return t.pin_memory()


class HostStaging:
    """Pinned host buffers and the copies of one communication thread's device tensors.

    ``is_device(t)``: whether ``t`` needs staging (default: a CUDA tensor); ``pin(t)``:
    ``t`` (a new host tensor) in pinned memory (default ``Tensor.pin_memory``). At most
    ``max_buffers`` buffers are kept, the least recently used let go first.
    ``rank``/``epoch`` label the log lines.
    """

    def __init__(
        self,
        *,
        rank: int,
        epoch: int = 0,
        is_device: Callable[[torch.Tensor], bool] = _on_cuda,
        pin: Callable[[torch.Tensor], torch.Tensor] = _pinned,
        max_buffers: int = 16,
    ) -> None:
        if max_buffers < 1:
            raise ValueError(f"max_buffers={max_buffers}: must be >= 1")
        self.rank, self.epoch = rank, epoch
        self._is_device, self._pin, self._max = is_device, pin, max_buffers
        self._buffers: OrderedDict[Key, torch.Tensor] = OrderedDict()
        self._streams: dict[torch.device, Any] = {}
        # Counters (tests and figures): buffers made and reused, bytes each way.
        self.made = self.reused = 0
        self.bytes_in = self.bytes_out = 0

    def needs(self, t: torch.Tensor) -> bool:
        """Whether ``t`` is a device tensor the CPU engine cannot take as it is."""
        return bool(self._is_device(t))

    def buffer(self, like: torch.Tensor, slot: int = 0) -> torch.Tensor:
        """A pinned flat host buffer of ``like``'s dtype and element count: the same one
        for the same (dtype, count, slot) while it is kept. ``slot`` tells apart the
        buffers one call needs at once (an exchange's send and receive sides)."""
        key = (like.dtype, like.numel(), slot)
        buf = self._buffers.get(key)
        if buf is not None:
            self._buffers.move_to_end(key)
            self.reused += 1
            return buf
        buf = self._pin(torch.empty(like.numel(), dtype=like.dtype))
        self._buffers[key] = buf
        self.made += 1
        while len(self._buffers) > self._max:
            (dtype, numel, _), _ = self._buffers.popitem(last=False)
            logger.debug("rank %d (epoch %d): pinned buffer of %d %s let go (%d kept)",
                         self.rank, self.epoch, numel, dtype, self._max)  # fmt: skip
        return buf

    @property
    def kept(self) -> int:
        """How many buffers are kept now."""
        return len(self._buffers)

    def _stream(self, device: torch.device) -> Any:
        stream = self._streams.get(device)
        if stream is None:
            stream = self._streams[device] = torch.cuda.Stream(device)  # type: ignore[no-untyped-call]
        return stream

    def _copy(self, dst: torch.Tensor, src: torch.Tensor, device: torch.device) -> None:
        """``dst.copy_(src)``; across a CUDA device, non-blocking on this staging's
        stream, waited for before returning (the bytes are then where they go)."""
        if device.type != "cuda":
            dst.copy_(src)
            return
        stream = self._stream(device)
        with torch.cuda.stream(stream):
            dst.copy_(src, non_blocking=True)
        stream.synchronize()

    def stage_in(self, t: torch.Tensor, slot: int = 0, *, read: bool = True) -> torch.Tensor:
        """``t``'s host buffer (see :meth:`buffer`) holding ``t``'s values (with
        ``read``; else as it is: ``t`` is only written to).

        Raises:
            ValueError: ``t`` is not contiguous (engines take flat contiguous buffers).
        """
        if not t.is_contiguous():
            raise ValueError("resilient: a staged tensor must be contiguous")
        host = self.buffer(t, slot)
        if not read:
            return host
        if t.device.type == "cuda":
            # Whichever stream of the caller's wrote t, its kernels are done after this.
            torch.cuda.synchronize(t.device)
        self._copy(host, t.view(-1), t.device)
        self.bytes_in += t.numel() * t.element_size()
        return host

    def stage_out(self, host: torch.Tensor, t: torch.Tensor) -> None:
        """Copy ``host`` (from :meth:`stage_in`) back into ``t``."""
        self._copy(t.view(-1), host, t.device)
        self.bytes_out += t.numel() * t.element_size()

    @contextmanager
    def staged(
        self, t: torch.Tensor, *, slot: int = 0, read: bool = True, back: bool = True
    ) -> Iterator[torch.Tensor]:
        """``t`` itself when it needs no staging; else its host copy (``t``'s values
        copied in with ``read``), copied back into ``t`` on a clean exit with ``back``
        (nothing is copied back after an error: ``t`` keeps its values).

        Raises:
            ValueError: ``t`` needs staging and is not contiguous.
        """
        if not self.needs(t):
            yield t
            return
        host = self.stage_in(t, slot, read=read)
        yield host
        if back:
            self.stage_out(host, t)

    def close(self) -> None:
        """Let every buffer go (pinned memory goes back to the allocator's cache)."""
        self._buffers.clear()
        self._streams.clear()


class StagedEngine:
    """The calls of ``engine`` (the group's CPU engine) on tensors that ``staging``
    stages: each runs on the host copy, and the result is copied back.

    Raises what ``engine`` raises (LinkError, PeerLost, ...); the device tensor then
    keeps its values.
    """

    def __init__(self, engine: RingEngine | SoloEngine, staging: HostStaging) -> None:
        self.engine, self.staging = engine, staging

    def all_reduce(self, flat: torch.Tensor, op: Reduce) -> None:
        with self.staging.staged(flat) as host:
            self.engine.all_reduce(host, op)

    def reduce_scatter(self, flat: torch.Tensor, op: Reduce) -> Span:
        """This rank's reduced span of ``flat``; the whole buffer is copied back (the
        other spans hold partial sums, as with the CPU engine)."""
        with self.staging.staged(flat) as host:
            return self.engine.reduce_scatter(host, op)

    def all_gather(self, flat: torch.Tensor) -> None:
        with self.staging.staged(flat) as host:
            self.engine.all_gather(host)

    def broadcast(self, flat: torch.Tensor, root: int) -> None:
        with self.staging.staged(flat) as host:
            self.engine.broadcast(host, root)

    def barrier(self) -> None:
        self.engine.barrier()
