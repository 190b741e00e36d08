"""Argument checks of the process group's collectives (raised on the caller's thread)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from resilient.collectives.digest_check import digest_of
from resilient.collectives.engine import Reduce
from resilient.collectives.signature import SUPPORTED_DTYPES, Signature

__all__ = ["AllreduceCalls", "check_tensors", "reduce_op"]

# Distinct allreduce calls kept checked (DDP makes a few buckets; anything more is
# a program whose shapes vary, which gains nothing from the cache).
_KNOWN_CALLS = 64

_REDUCE_OPS = {
    dist.ReduceOp.SUM: Reduce.SUM,
    dist.ReduceOp.AVG: Reduce.AVG,
    dist.ReduceOp.PRODUCT: Reduce.PRODUCT,
    dist.ReduceOp.MIN: Reduce.MIN,
    dist.ReduceOp.MAX: Reduce.MAX,
}


def check_tensors(op: str, tensors: Sequence[torch.Tensor]) -> None:
    """Raises ValueError (several devices), TypeError (dtype) or NotImplementedError
    (a device or a CUDA build this group cannot serve), naming the op."""
    if len(tensors) > 1:  # one tensor (a DDP bucket) is the usual case
        devices = {t.device for t in tensors}
        if len(devices) > 1:
            names = sorted(map(str, devices))
            raise ValueError(f"resilient {op}: tensors on several devices {names}")
    for t in tensors:
        if t.dtype not in SUPPORTED_DTYPES:
            raise TypeError(f"resilient {op}: dtype {t.dtype} is not supported")
        if t.device.type == "cuda" and not dist.is_nccl_available():
            raise NotImplementedError(
                f"resilient {op}: CUDA tensors need NCCL, which this torch build lacks"
            )
        if t.device.type not in ("cpu", "cuda"):
            raise NotImplementedError(
                f"resilient {op}: {t.device.type} tensors are not supported (cpu, cuda)"
            )


def reduce_op(op: str, opts: Any, tensors: Sequence[torch.Tensor] = ()) -> Reduce:
    """The :class:`Reduce` of ``opts.reduceOp``.

    Raises:
        NotImplementedError: the reduce op is not supported.
        TypeError: AVG of bool ``tensors`` (an average of truth values is not one).
    """
    # opts.reduceOp is a ReduceOp wrapper (or the bare enum); key on the enum.
    red = _REDUCE_OPS.get(getattr(opts.reduceOp, "op", opts.reduceOp))
    if red is None:
        raise NotImplementedError(f"resilient {op}: reduce op {opts.reduceOp} is not supported")
    if red is Reduce.AVG and any(t.dtype == torch.bool for t in tensors):
        raise TypeError(f"resilient {op}: AVG of bool tensors is not defined (use MAX or MIN)")
    return red


class AllreduceCalls:
    """The checked reduce op, signature and digest of allreduce calls, kept for the
    calls seen before. ``elide``: calls may run elided (the config's elide_every)."""

    def __init__(self, *, elide: bool) -> None:
        self._elide = elide
        # Checked calls by (dtype, shape, device, reduce op).
        self._known: dict[tuple[Any, ...], tuple[Reduce, Signature, int]] = {}

    def of(self, tensors: list[torch.Tensor], opts: Any) -> tuple[Reduce, Signature, int]:
        """The checked reduce op, signature and digest of an allreduce call (the
        digest 0 unless the call may run elided: CPU tensors, calls elided here).

        One tensor is the usual call (a DDP bucket, the same few every step): its
        checks and signature are kept by dtype, shape, device and reduce op. They
        take ~6 us warm, but on a host where the training thread shares its cores
        with the other ranks every microsecond of Python costs several: keeping
        them took ~20 us of its CPU off each DDP bucket (docs/BENCHMARKS.md).

        Raises:
            ValueError, TypeError, NotImplementedError: see check_tensors, reduce_op.
        """
        key = None
        if len(tensors) == 1 and opts is not None:
            t = tensors[0]
            key = (t.dtype, t.shape, t.device, getattr(opts.reduceOp, "op", opts.reduceOp))
            known = self._known.get(key)
            if known is not None:
                return known
        opts = opts or dist.AllreduceOptions()
        check_tensors("allreduce", tensors)
        red = reduce_op("allreduce", opts, tensors)
        sig = Signature.of("allreduce", tensors, reduce=red)
        elide = self._elide and all(t.device.type == "cpu" for t in tensors)
        known = (red, sig, digest_of(sig) if elide else 0)
        if key is not None:
            if len(self._known) >= _KNOWN_CALLS:
                self._known.clear()
            self._known[key] = known
        return known
