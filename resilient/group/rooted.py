"""reduce, gather and scatter: the collectives with a root rank.

:class:`RootedCalls` checks a call's tensors on the caller's thread and builds what
runs it on the group's communication thread, over the engine's primitives:

* reduce: an all_reduce of a scratch copy, written to the root's tensor only;
* gather: an all_gather, which the root copies into its outputs;
* scatter: a broadcast of the root's inputs laid end to end, of which every rank
  keeps its own block.

A call small enough (:data:`~resilient.collectives.signature.INLINE_BYTES`) travels
inside the signature exchange instead and needs no data phase, as with all_reduce.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from resilient.collectives.engine import fold_rows
from resilient.collectives.signature import INLINE_BYTES, Signature
from resilient.group.args import check_tensors, reduce_op
from resilient.group.calls import Submit
from resilient.group.cuda_staging import cuda_devices
from resilient.group.epoch_control import EpochControl
from resilient.group.reductions import inline_rows
from resilient.group.work import ResilientWork, _packed

__all__ = ["RootedCalls"]


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class RootedCalls:
    """reduce, gather and scatter over ``size`` ranks, this one ``rank``, in the
    epoch ``epochs`` runs; ``submit`` queues a call (see :class:`Submit`)."""

    def __init__(self, *, rank: int, size: int, epochs: EpochControl, submit: Submit) -> None:
        self._rank, self._size, self._epochs, self._submit = rank, size, epochs, submit

    def _root(self, op: str, root: int) -> int:
        """``root``, checked. Raises ValueError when it names no rank of the group."""
        root = int(root)
        if not 0 <= root < self._size:
            raise ValueError(
                f"resilient {op}: root rank {root} is out of range (the group has ranks "
                f"0..{self._size - 1})"
            )
        return root

    def _inline(self, nbytes: int) -> bool:
        """Small enough to travel in the signature rows (alike on every rank once the
        signatures matched: it follows from shapes and dtype)."""
        return self._epochs.checks is not None and nbytes <= INLINE_BYTES

    def reduce(self, tensors: list[torch.Tensor], opts: Any = None) -> ResilientWork:
        """Reduce ``tensors[0]`` across ranks into the root's tensor; the others'
        are left as they were.

        Raises:
            NotImplementedError: not exactly one tensor, or the reduce op; see
                check_tensors.
            ValueError: the root is out of range; see check_tensors.
            TypeError: the dtype, or AVG of bools.
            MembershipError: the root left the group (it shrank without it).
        """
        opts = opts or dist.ReduceOptions()
        if len(tensors) != 1:
            raise NotImplementedError("resilient reduce: exactly one tensor per rank")
        t = tensors[0]
        check_tensors("reduce", [t])
        red = reduce_op("reduce", opts, [t])
        root = self._root("reduce", opts.rootRank)
        self._epochs.position(root, "reduce")  # the root must still be a member
        sig = Signature.of("reduce", [t], reduce=red, root=root)
        inline, mine = self._inline(_nbytes(t)), self._rank == root

        def run(table: torch.Tensor | None) -> list[torch.Tensor]:
            if inline and table is not None:
                if mine:
                    t.copy_(fold_rows(inline_rows(table, t, _nbytes(t)), red).view_as(t))
                return tensors
            # A scratch copy: only the root's tensor may change.
            buf = t.detach().reshape(-1).clone()
            self._epochs.engine_for(buf).all_reduce(buf, red)
            if mine:
                t.copy_(buf.view_as(t))
            return tensors

        # The payload reads the caller's tensor: not before earlier calls wrote it.
        payload = (lambda: _packed([t])) if inline else None
        return self._submit(
            "reduce", sig, run, payload=payload, after_previous=inline, devices=cuda_devices([t])
        )

    def _root_list(
        self, op: str, lists: Sequence[Sequence[torch.Tensor]], root: int
    ) -> list[torch.Tensor]:
        """The root's one list of per-rank tensors (checked), or [] elsewhere.

        Raises:
            ValueError: the root passes not one list of one tensor per rank, or another
                rank passes tensors.
        """
        if self._rank != root:
            if any(len(x) for x in lists):
                raise ValueError(f"resilient {op}: only the root rank {root} passes a tensor list")
            return []
        if len(lists) != 1 or len(lists[0]) != self._size:
            raise ValueError(
                f"resilient {op}: the root needs one list of {self._size} tensors (one per rank)"
            )
        return list(lists[0])

    @staticmethod
    def _alike(op: str, one: torch.Tensor, others: Sequence[torch.Tensor]) -> None:
        """Raises TypeError / ValueError unless ``others`` have ``one``'s dtype and shape."""
        for i, o in enumerate(others):
            if o.dtype != one.dtype:
                raise TypeError(f"resilient {op}: tensor {i} is {o.dtype}, need {one.dtype}")
            if o.shape != one.shape:
                raise ValueError(
                    f"resilient {op}: tensor {i} has shape {tuple(o.shape)}, "
                    f"need {tuple(one.shape)}"
                )

    def gather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> ResilientWork:
        """Gather every rank's ``input_tensors[0]`` into the root's
        ``output_tensors[0]`` (one per rank; other ranks pass no outputs).

        Raises:
            NotImplementedError: not exactly one input; see check_tensors.
            ValueError: the root is out of range, outputs not one per rank shaped like
                the input, or outputs on another rank; see check_tensors.
            TypeError: the dtype, or outputs of another dtype.
            MembershipError: the group shrank (the op needs every rank).
        """
        opts = opts or dist.GatherOptions()
        if len(input_tensors) != 1:
            raise NotImplementedError("resilient gather: exactly one input tensor per rank")
        inp = input_tensors[0]
        root = self._root("gather", opts.rootRank)
        outs = self._root_list("gather", output_tensors, root)
        check_tensors("gather", [inp, *outs])
        self._alike("gather", inp, outs)
        self._epochs.need_every_rank("gather")
        sig = Signature.of("gather", [inp], root=root)
        inline = self._inline(_nbytes(inp))

        def run(table: torch.Tensor | None) -> list[list[torch.Tensor]]:
            if inline and table is not None:
                rows = inline_rows(table, inp, _nbytes(inp))
            else:
                rows = torch.empty((self._size, inp.numel()), dtype=inp.dtype)
                rows[self._rank].copy_(inp.reshape(-1))
                self._epochs.engine_for(rows).all_gather(rows.view(-1))
            for i, out in enumerate(outs):
                out.copy_(rows[i].view_as(out))
            return output_tensors

        payload = (lambda: _packed([inp])) if inline else None
        return self._submit(
            "gather", sig, run, payload=payload, after_previous=inline,
            devices=cuda_devices([inp, *outs]),
        )  # fmt: skip

    def scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> ResilientWork:
        """Give every rank its block of the root's ``input_tensors[0]`` (one per
        rank; other ranks pass no inputs) in ``output_tensors[0]``.

        Raises:
            NotImplementedError: not exactly one output; see check_tensors.
            ValueError: the root is out of range, inputs not one per rank shaped like
                the output, or inputs on another rank; see check_tensors.
            TypeError: the dtype, or inputs of another dtype.
            MembershipError: the group shrank (the op needs every rank).
        """
        opts = opts or dist.ScatterOptions()
        if len(output_tensors) != 1:
            raise NotImplementedError("resilient scatter: exactly one output tensor per rank")
        out = output_tensors[0]
        root = self._root("scatter", opts.rootRank)
        ins = self._root_list("scatter", input_tensors, root)
        check_tensors("scatter", [out, *ins])
        self._alike("scatter", out, ins)
        self._epochs.need_every_rank("scatter")
        sig = Signature.of("scatter", [out], root=root)
        n, size = out.numel(), self._size
        inline = self._inline(_nbytes(out) * size)

        def run(table: torch.Tensor | None) -> list[torch.Tensor]:
            if inline and table is not None:
                whole = inline_rows(table, out, _nbytes(out) * size)[root]
            else:
                whole = _packed(ins) if ins else torch.empty(n * size, dtype=out.dtype)
                whole = whole.contiguous()
                self._epochs.engine_for(whole).broadcast(whole, root)
            out.copy_(whole[self._rank * n : (self._rank + 1) * n].view_as(out))
            return output_tensors

        payload = (lambda: _packed(ins) if ins else None) if inline else None
        return self._submit(
            "scatter", sig, run, payload=payload, after_previous=inline,
            devices=cuda_devices([out, *ins]),
        )  # fmt: skip
