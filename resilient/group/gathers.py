"""The gather and scatter collectives of the process group (all_gather,
all_gather_into_tensor, reduce_scatter, reduce_scatter_tensor and their coalesced
forms): :class:`GatherCalls` checks a call's tensors and builds what runs it; the
group's own methods, which torch calls, hand their calls here.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
import torch.distributed as dist

from resilient.collectives.engine import Reduce, RingEngine
from resilient.collectives.signature import Signature
from resilient.collectives.solo import SoloEngine
from resilient.group.args import check_tensors, reduce_op
from resilient.group.calls import Submit
from resilient.group.cuda_staging import StagedEngine, cuda_devices
from resilient.group.work import ResilientWork

__all__ = ["GatherCalls"]

# Queues a call on the group's communication thread: (op, signature, what runs it).


class GatherCalls:
    """Gather and scatter calls over ``size`` ranks, this one ``rank``.

    ``need_every_rank(op)`` raises for an op the current members cannot run (after
    a shrink), ``engine_for(tensor)`` gives the engine for a tensor's device, and
    ``submit`` queues the call (see :class:`~resilient.group.calls.Submit`).
    """

    def __init__(
        self,
        *,
        rank: int,
        size: int,
        need_every_rank: Callable[[str], None],
        engine_for: Callable[[torch.Tensor], RingEngine | SoloEngine | StagedEngine],
        submit: Submit,
    ) -> None:
        self._rank, self._size = rank, size
        self._need_every_rank, self._engine_for, self._submit = (
            need_every_rank, engine_for, submit,
        )  # fmt: skip

    def allgather(
        self,
        output_tensors: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> ResilientWork:
        """Gather every rank's one input into ``output_tensors[0]`` (one per rank).

        Raises:
            NotImplementedError: more than one input; see check_tensors.
            ValueError, TypeError: outputs not one per rank shaped like the input;
                see check_tensors.
            MembershipError: the group shrank (the op needs every rank).
        """
        if len(input_tensors) != 1 or len(output_tensors) != 1:
            raise NotImplementedError("resilient allgather: exactly one input tensor per rank")
        outs, inp = output_tensors[0], input_tensors[0]
        check_tensors("allgather", [inp, *outs])
        self._need_every_rank("allgather")
        if len(outs) != self._size or any(o.shape != inp.shape for o in outs):
            raise ValueError(
                f"resilient allgather: need {self._size} outputs shaped {tuple(inp.shape)}"
            )
        sig = Signature.of("allgather", [inp])

        def run(_: torch.Tensor | None) -> list[list[torch.Tensor]]:
            buf = self._gather_buffer(inp)
            for i, out in enumerate(outs):
                out.copy_(buf[i].view_as(out))
            return output_tensors

        return self._submit("allgather", sig, run, devices=cuda_devices([inp, *outs]))

    def all_gather_into_tensor(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> ResilientWork:
        """Gather every rank's ``input`` into ``output`` (rank after rank).

        Raises:
            NotImplementedError, TypeError: see check_tensors.
            ValueError: ``output`` is not ranks times ``input``; see check_tensors.
            MembershipError: the group shrank (the op needs every rank).
        """
        check_tensors("all_gather_into_tensor", [output, input])
        self._need_every_rank("all_gather_into_tensor")
        if output.numel() != input.numel() * self._size:
            raise ValueError(
                f"resilient all_gather_into_tensor: output has {output.numel()} elements, "
                f"need {input.numel() * self._size}"
            )
        sig = Signature.of("all_gather_into_tensor", [input])

        def run(_: torch.Tensor | None) -> list[torch.Tensor]:
            buf = self._gather_buffer(input)
            output.copy_(buf.view_as(output))
            return [output]

        return self._submit(
            "all_gather_into_tensor", sig, run, devices=cuda_devices([output, input])
        )

    def _gather_buffer(self, inp: torch.Tensor) -> torch.Tensor:
        n = inp.numel()
        buf = torch.empty((self._size, n), dtype=inp.dtype, device=inp.device)
        buf[self._rank].copy_(inp.reshape(-1))
        self._engine_for(buf).all_gather(buf.view(-1))
        return buf

    def reduce_scatter(
        self,
        output_tensors: list[torch.Tensor],
        input_tensors: list[list[torch.Tensor]],
        opts: Any = None,
    ) -> ResilientWork:
        """Reduce ``input_tensors[0]`` (one per rank) across ranks; this rank's
        share lands in ``output_tensors[0]``.

        Raises:
            NotImplementedError: more than one output, or the reduce op; see
                check_tensors.
            ValueError, TypeError: inputs not one per rank shaped like the output;
                see check_tensors.
            MembershipError: the group shrank (the op needs every rank).
        """
        opts = opts or dist.ReduceScatterOptions()
        if len(output_tensors) != 1 or len(input_tensors) != 1:
            raise NotImplementedError("resilient reduce_scatter: exactly one output per rank")
        out, ins = output_tensors[0], input_tensors[0]
        check_tensors("reduce_scatter", [out, *ins])
        self._need_every_rank("reduce_scatter")
        if len(ins) != self._size or any(i.shape != out.shape for i in ins):
            raise ValueError(
                f"resilient reduce_scatter: need {self._size} inputs shaped {tuple(out.shape)}"
            )
        red = reduce_op("reduce_scatter", opts, [out])
        sig = Signature.of("reduce_scatter", [out], reduce=red)

        def run(_: torch.Tensor | None) -> list[torch.Tensor]:
            buf = torch.cat([i.reshape(-1) for i in ins])
            self._scatter_into(buf, out, red)
            return output_tensors

        return self._submit("reduce_scatter", sig, run, devices=cuda_devices([out, *ins]))

    def reduce_scatter_tensor(
        self, output: torch.Tensor, input: torch.Tensor, opts: Any = None
    ) -> ResilientWork:
        """Reduce ``input`` across ranks; this rank's share lands in ``output``.

        Raises:
            NotImplementedError: the reduce op; see check_tensors.
            ValueError, TypeError: ``input`` is not ranks times ``output``; see
                check_tensors.
            MembershipError: the group shrank (the op needs every rank).
        """
        opts = opts or dist.ReduceScatterOptions()
        check_tensors("reduce_scatter_tensor", [output, input])
        self._need_every_rank("reduce_scatter_tensor")
        if input.numel() != output.numel() * self._size:
            raise ValueError(
                f"resilient reduce_scatter_tensor: input has {input.numel()} elements, "
                f"need {output.numel() * self._size}"
            )
        red = reduce_op("reduce_scatter_tensor", opts, [output])
        sig = Signature.of("reduce_scatter_tensor", [output], reduce=red)

        def run(_: torch.Tensor | None) -> list[torch.Tensor]:
            self._scatter_into(input.reshape(-1).clone(), output, red)
            return [output]

        return self._submit(
            "reduce_scatter_tensor", sig, run, devices=cuda_devices([output, input])
        )

    def _scatter_into(self, buf: torch.Tensor, out: torch.Tensor, red: Reduce) -> None:
        mine = self._engine_for(buf).reduce_scatter(buf, red)
        out.copy_(buf[mine.start : mine.stop].view_as(out))

    def allgather_coalesced(
        self,
        output_lists: list[list[torch.Tensor]],
        input_tensors: list[torch.Tensor],
        opts: Any = None,
    ) -> ResilientWork:
        """all_gather of each input: ``output_lists[r][i]`` receives rank r's input
        i. Runs as one all_gather per input, in order; the last call's work.

        Raises:
            ValueError: no inputs, or not one output list per rank holding one
                output per input; as allgather.
        """
        if len(output_lists) != self._size or any(
            len(outs) != len(input_tensors) for outs in output_lists
        ):
            raise ValueError(
                f"resilient allgather_coalesced: need {self._size} output lists (one per "
                f"rank) of {len(input_tensors)} tensors (one per input)"
            )
        return self._last(
            [
                self.allgather([[outs[i] for outs in output_lists]], [inp], opts)
                for i, inp in enumerate(input_tensors)
            ]
        )

    def all_gather_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> ResilientWork:
        """all_gather_into_tensor of each pair, in order; the last call's work.

        Raises:
            ValueError: no pairs, or as all_gather_into_tensor.
        """
        return self._last(
            [self.all_gather_into_tensor(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        )

    def reduce_scatter_coalesced(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> ResilientWork:
        """reduce_scatter_tensor of each pair, in order; the last call's work.

        Raises:
            ValueError: no pairs, or as reduce_scatter_tensor.
        """
        return self._last(
            [self.reduce_scatter_tensor(o, i, opts) for o, i in zip(outputs, inputs, strict=True)]
        )

    @staticmethod
    def _last(works: list[ResilientWork]) -> ResilientWork:
        """Works run in order on one thread: the last one completes after the others."""
        if not works:
            raise ValueError("resilient: a coalesced call needs at least one tensor pair")
        return works[-1]
