"""all_to_all and all_to_all_single (equal or uneven splits) of the process group.

:class:`AllToAllCalls` checks a call's tensors on the caller's thread, then queues
it. Ranks legitimately differ in their splits, so the signature checks only what
must be equal (op, dtype); every rank's split sizes travel as the call's inline
payload through the signature exchange (or a small all_gather when checks are
off), and every rank checks the whole table before any data moves: rank i's
output from rank j must be as large as rank j's input for rank i. A table that
disagrees raises the same ValueError on every rank, and the group stays usable.
The data moves in one pairwise exchange (:mod:`resilient.collectives.alltoall`).

all_to_all_single with equal splits (the same block to and from every rank) may
run *elided*, as all_reduce does (:mod:`resilient.collectives.digest_check`):
no exchange, the block size and dtype in a digest that the pairwise exchange's
gate checks against every peer's before any data is read. A peer whose call
differs makes every rank refuse it at its gate and fall back to the full
exchange, which raises the same error as a checked call, with nothing written.
Every ``elide_every``-th call keeps its exchange, and only its verdict (equal
splits everywhere, a quiet group) lets the next calls elide.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch

from resilient.collectives.alltoall import all_to_all, sizes_of, sizes_payload, spans_of
from resilient.collectives.digest_check import digest_of
from resilient.collectives.engine import RingEngine
from resilient.collectives.signature import INLINE_BYTES, Signature
from resilient.errors import RecoveryError
from resilient.group.args import check_tensors
from resilient.group.calls import Submit
from resilient.group.cuda_staging import StagedEngine, cuda_devices
from resilient.group.epoch_control import EpochControl
from resilient.group.work import ResilientWork

__all__ = ["AllToAllCalls"]

# Mismatched pairs named in the error (all of them would make a long message).
_NAMED = 6
# Checked all_to_all_single calls kept (a job makes a few distinct ones; one whose
# shapes vary every call gains nothing from the cache), and digests by (dtype, block).
_KNOWN_CALLS = 64


def _flat_out(t: torch.Tensor) -> torch.Tensor:
    """``t`` as a flat contiguous buffer to receive into: itself if it can be."""
    return t.view(-1) if t.is_contiguous() else torch.empty(t.numel(), dtype=t.dtype)


class AllToAllCalls:
    """all_to_all calls over ``size`` ranks, this one ``rank``, in the epoch
    ``epochs`` runs; ``submit`` queues a call (see :class:`Submit`)."""

    def __init__(self, *, rank: int, size: int, epochs: EpochControl, submit: Submit) -> None:
        self._rank, self._size, self._epochs, self._submit = rank, size, epochs, submit
        self._digests: dict[tuple[torch.dtype, int], int] = {}
        self._known: dict[tuple[Any, ...], tuple[list[int], list[int], int]] = {}
        self._sigs: dict[tuple[str, torch.dtype], Signature] = {}

    def _check(self, op: str, tensors: Sequence[torch.Tensor]) -> None:
        """Raises TypeError, ValueError, NotImplementedError (CPU only) or
        MembershipError (the group shrank) for a call's ``tensors``."""
        check_tensors(op, tensors)
        for t in tensors:
            if t.device.type != "cpu":
                raise NotImplementedError(f"resilient {op}: CPU tensors only (got {t.device})")
            if t.dtype != tensors[0].dtype:
                raise TypeError(
                    f"resilient {op}: tensors of one call must share a dtype "
                    f"({tensors[0].dtype} and {t.dtype})"
                )
        self._epochs.need_every_rank(op)

    def all_to_all(
        self, outputs: list[torch.Tensor], inputs: list[torch.Tensor], opts: Any = None
    ) -> ResilientWork:
        """Send ``inputs[j]`` to rank ``j``; receive rank ``i``'s into ``outputs[i]``.

        Raises:
            ValueError: not one input and one output per rank, or (from ``wait``)
                sizes that disagree with the peers'; see check_tensors.
            TypeError, NotImplementedError, MembershipError: see _check.
        """
        op = "all_to_all"
        if len(inputs) != self._size or len(outputs) != self._size:
            raise ValueError(
                f"resilient {op}: need {self._size} inputs and {self._size} outputs "
                f"(got {len(inputs)} and {len(outputs)})"
            )
        self._check(op, [*inputs, *outputs])
        send = [t.numel() for t in inputs]
        recv = [t.numel() for t in outputs]

        def run(table: torch.Tensor | None) -> list[torch.Tensor]:
            src = torch.cat([t.reshape(-1) for t in inputs])
            dst = torch.empty(sum(recv), dtype=src.dtype)
            self._exchange(op, table, src, dst, send, recv)
            for out, span in zip(outputs, spans_of(recv), strict=True):
                out.copy_(dst[span.start : span.stop].view_as(out))
            return outputs

        return self._queue(
            op, inputs[0].dtype, send, recv, run, devices=cuda_devices([*inputs, *outputs])
        )

    def all_to_all_single(
        self,
        output: torch.Tensor,
        input: torch.Tensor,
        out_splits: Sequence[int],
        in_splits: Sequence[int],
        opts: Any = None,
    ) -> ResilientWork:
        """Send rows ``in_splits[j]`` of ``input`` (along dim 0) to rank ``j``;
        receive rank ``i``'s into rows ``out_splits[i]`` of ``output``. Empty
        splits mean equal ones.

        Raises:
            ValueError: splits that are not one per rank, negative or do not add up
                to dim 0, dim 0 not divisible by the ranks (equal splits), or (from
                ``wait``) sizes that disagree with the peers'; see check_tensors.
            TypeError, NotImplementedError, MembershipError: see _check.
        """
        op = "all_to_all_single"
        send, recv, digest = self._single_of(op, output, input, out_splits, in_splits)

        def run(table: torch.Tensor | None) -> list[torch.Tensor]:
            src = input.reshape(-1).contiguous()
            dst = _flat_out(output)
            self._exchange(op, table, src, dst, send, recv)
            if not output.is_contiguous():  # received into a flat copy
                output.copy_(dst.view(output.shape))
            return [output]

        return self._queue(
            op, input.dtype, send, recv, run, digest=digest, devices=cuda_devices([input, output])
        )

    def _single_of(
        self,
        op: str,
        output: torch.Tensor,
        input: torch.Tensor,
        out_splits: Sequence[int],
        in_splits: Sequence[int],
    ) -> tuple[list[int], list[int], int]:
        """A call's checked (send sizes, receive sizes, digest), kept for the calls
        seen before: a job repeats a few (a loop's), and on a host whose cores the
        ranks share, the checks' Python on the caller's thread cost ~0.2 ms a call.

        Raises:
            ValueError, TypeError, NotImplementedError, MembershipError: see
                all_to_all_single.
        """
        self._epochs.need_every_rank(op)  # the members may change between calls
        key = (
            input.dtype, input.shape, input.device, output.dtype, output.shape, output.device,
            tuple(out_splits), tuple(in_splits),
        )  # fmt: skip
        known = self._known.get(key)
        if known is not None:
            return known
        self._check(op, [input, output])
        send = self._elements(op, "input", input, in_splits)
        recv = self._elements(op, "output", output, out_splits)
        if len(self._known) >= _KNOWN_CALLS:
            self._known.clear()
        known = self._known[key] = (send, recv, self._digest(op, input.dtype, send, recv))
        return known

    def _digest(self, op: str, dtype: torch.dtype, send: list[int], recv: list[int]) -> int:
        """The digest of an equal-split call (one block size to and from every
        rank), which may then run elided; 0 for any other. Equal digests on every
        rank mean equal blocks everywhere: every size agrees."""
        block = send[0]
        if any(n != block for n in send) or any(n != block for n in recv):
            return 0
        if 2 * self._size * 8 > INLINE_BYTES:  # the sizes travel in an all_gather
            return 0
        digest = self._digests.get((dtype, block))
        if digest is None:
            if len(self._digests) >= _KNOWN_CALLS:
                self._digests.clear()
            sig = Signature(0, op, None, dtype, 1, block, -1, (block,), 0)
            digest = self._digests[(dtype, block)] = digest_of(sig)
        return digest

    def _elements(self, op: str, what: str, t: torch.Tensor, splits: Sequence[int]) -> list[int]:
        """Elements per rank of ``t`` cut along dim 0 by ``splits`` (empty: equally).

        Raises:
            ValueError: see all_to_all_single.
        """
        if t.dim() == 0:
            raise ValueError(f"resilient {op}: the {what} needs at least one dimension")
        rows, row = t.shape[0], math.prod(t.shape[1:])
        if not splits:
            if rows % self._size:
                raise ValueError(
                    f"resilient {op}: the {what}'s dim 0 ({rows}) does not divide into "
                    f"{self._size} equal splits"
                )
            return [rows // self._size * row] * self._size
        sizes = [int(s) for s in splits]
        if len(sizes) != self._size or any(s < 0 for s in sizes) or sum(sizes) != rows:
            raise ValueError(
                f"resilient {op}: {what} splits {sizes} must be {self._size} sizes >= 0 "
                f"adding up to its dim 0 ({rows})"
            )
        return [s * row for s in sizes]

    def _queue(
        self,
        op: str,
        dtype: torch.dtype,
        send: list[int],
        recv: list[int],
        run: Any,
        *,
        digest: int = 0,
        devices: list[torch.device] | None = None,
    ) -> ResilientWork:
        """Queue ``run`` with this rank's sizes as its payload (when rows can hold
        every rank's: two int64 per rank); ``digest``: see _digest; ``devices``: the
        call's CUDA devices."""
        # Only op and dtype must match: sizes differ between ranks by design.
        sig = self._sigs.get((op, dtype))
        if sig is None:  # kept: a tensor and a CRC per call cost the caller's thread
            sig = self._sigs[(op, dtype)] = Signature.of(op, [torch.empty(0, dtype=dtype)])
        devices = devices or []
        if 2 * self._size * 8 > INLINE_BYTES:
            return self._submit(op, sig, run, devices=devices)
        # Made only when a row is (an elided call needs none unless it falls back).
        return self._submit(
            op, sig, run, payload=lambda: sizes_payload(send, recv), digest=digest,
            devices=devices,
        )  # fmt: skip

    def _sizes(self, table: torch.Tensor | None, send: list[int], recv: list[int]) -> torch.Tensor:
        """Every rank's (send sizes, receive sizes) as a (ranks, 2 * ranks) table:
        from the exchange's payloads, or an all_gather (checks off, or too many ranks)."""
        if table is not None and table.numel():
            return sizes_of(table, self._size)
        rows = torch.zeros((self._size, 2 * self._size), dtype=torch.int64)
        rows[self._rank] = sizes_payload(send, recv)
        self._engine(rows, "all_to_all").all_gather(rows.view(-1))
        return rows

    def _engine(self, t: torch.Tensor, op: str) -> RingEngine:
        """The engine for ``t``. Raises RecoveryError for a replacement not yet
        admitted (an exchange with peers cannot run alone)."""
        engine = self._epochs.engine_for(t)
        if isinstance(engine, StagedEngine):  # the caller staged its tensors (_exchange)
            engine = engine.engine
        if not isinstance(engine, RingEngine):
            raise RecoveryError(
                f"rank {self._rank}: {op} cannot run alone (a replacement not admitted yet)"
            )
        return engine

    def _exchange(
        self,
        op: str,
        table: torch.Tensor | None,
        src: torch.Tensor,
        dst: torch.Tensor,
        send: list[int],
        recv: list[int],
    ) -> None:
        """Check every rank's sizes, then move ``src`` (flat, contiguous) to ``dst``.

        Raises:
            ValueError: some rank's sizes disagree with its peers' (on every rank alike).
        """
        staged = self._epochs.engine_for(src)
        if isinstance(staged, StagedEngine):  # CUDA tensors over the CPU links
            with (
                staged.staging.staged(src) as host_src,
                staged.staging.staged(dst, slot=1, read=False) as host_dst,
            ):
                self._exchange(op, table, host_src, host_dst, send, recv)
            return
        engine = self._engine(src, op)
        if engine.elided is None:  # an elided call's sizes are checked at its gate
            self._agree(op, self._sizes(table, send, recv).tolist())
        e = src.element_size()
        all_to_all(
            engine,
            src.view(torch.uint8),
            dst.view(torch.uint8),
            spans_of([n * e for n in send]),
            spans_of([n * e for n in recv]),
        )

    def _agree(self, op: str, sizes: list[list[int]]) -> None:
        """Check every rank's ``sizes`` (see _sizes) against its peers'.

        Raises:
            ValueError: some rank's sizes disagree with its peers' (on every rank alike).
        """
        size = self._size
        bad = [
            (i, j, sizes[i][j], sizes[j][size + i])
            for i in range(size)
            for j in range(size)
            if sizes[i][j] != sizes[j][size + i]
        ]
        if bad:
            named = "; ".join(
                f"rank {i} sends {s} to rank {j}, which expects {r} from it"
                for i, j, s, r in bad[:_NAMED]
            )
            more = f" (and {len(bad) - _NAMED} more)" if len(bad) > _NAMED else ""
            raise ValueError(
                f"resilient {op}: the ranks' split sizes disagree (elements): {named}{more}"
            )
