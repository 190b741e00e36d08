"""Argument checks of the process group's collectives (raised on the caller's thread)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from resilient.collectives.engine import Reduce
from resilient.collectives.signature import SUPPORTED_DTYPES

__all__ = ["check_tensors", "reduce_op"]

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


def reduce_op(op: str, opts: Any) -> Reduce:
    """The :class:`Reduce` of ``opts.reduceOp``; NotImplementedError if unsupported."""
    # opts.reduceOp is a ReduceOp wrapper (or the bare enum); key on the enum.
    red = _REDUCE_OPS.get(getattr(opts.reduceOp, "op", opts.reduceOp))
    if red is None:
        raise NotImplementedError(f"resilient {op}: reduce op {opts.reduceOp} is not supported")
    return red
