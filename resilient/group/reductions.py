"""all_reduce, broadcast and barrier of the process group: :class:`ReduceCalls`
checks a call's tensors on the caller's thread and builds what runs it on the
communication thread. Calls of at most ``INLINE_BYTES`` travel inside their
signature exchange and need no data phase.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import torch
import torch.distributed as dist

from resilient.collectives import ring_gate
from resilient.collectives.engine import Reduce, RingEngine, fold_rows
from resilient.collectives.signature import INLINE_BYTES, Signature
from resilient.group.args import AllreduceCalls, check_tensors, reduce_op
from resilient.group.calls import CallRunner
from resilient.group.cuda_staging import cuda_devices
from resilient.group.epoch_control import EpochControl
from resilient.group.work import ResilientWork, _Flat, _packed

__all__ = ["ReduceCalls", "inline_rows"]


def inline_rows(table: torch.Tensor, like: torch.Tensor, nbytes: int | None = None) -> torch.Tensor:
    """Every rank's first ``nbytes`` inline bytes of the exchange ``table`` (default:
    ``like``'s size), a row each, in ``like``'s dtype."""
    if nbytes is None:
        nbytes = like.numel() * like.element_size()
    return table[:, :nbytes].contiguous().view(like.dtype)


class ReduceCalls:
    """all_reduce, broadcast and barrier of group rank ``rank`` in the epoch
    ``epochs`` runs, queued on ``calls``; ``elide``: all_reduce calls may run
    elided (the config's elide_every > 0)."""

    def __init__(self, *, rank: int, epochs: EpochControl, calls: CallRunner, elide: bool) -> None:
        self._rank, self._epochs, self._calls = rank, epochs, calls
        self._known = AllreduceCalls(elide=elide)

    def _inline(self, tensors: Sequence[torch.Tensor]) -> bool:
        """Small enough to travel inside the signature exchange (same verdict on all
        ranks once their signatures matched: it depends only on numel and dtype)."""
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        return self._epochs.checks is not None and nbytes <= INLINE_BYTES

    def allreduce(self, tensors: list[torch.Tensor], opts: Any = None) -> ResilientWork:
        """Reduce ``tensors`` (one flat buffer) across the members, in place.

        Raises:
            ValueError, TypeError, NotImplementedError: see check_tensors, reduce_op.
        """
        if tensors and tensors[0].is_sparse:
            return self._sparse_allreduce(tensors, opts)
        red, sig, digest = self._known.of(tensors, opts)
        inline = self._inline(tensors)

        def run(table: torch.Tensor | None) -> list[torch.Tensor]:
            with _Flat(tensors) as flat:
                buf = flat.buffer
                if inline and table is not None:
                    buf.copy_(fold_rows(inline_rows(table, buf), red))
                else:
                    engine = self._epochs.engine_for(buf)
                    if isinstance(engine, RingEngine):  # an elided call may gate there
                        ring_gate.all_reduce(engine, buf, red)
                    else:
                        engine.all_reduce(buf, red)
            return tensors

        payload = (lambda: _packed(tensors)) if inline else None
        digest = 0 if inline else digest
        return self._calls.submit(
            "allreduce", sig, run, payload=payload, digest=digest, devices=cuda_devices(tensors)
        )

    def _sparse_allreduce(self, tensors: list[torch.Tensor], opts: Any) -> ResilientWork:
        """The sum of one sparse COO tensor across the members, in place (as gloo's):
        every rank's indices and values are gathered (padded to the largest count)
        and coalesced in rank order, so every rank ends with the same bits.

        Raises:
            NotImplementedError: not one CPU COO tensor, or an op other than SUM.
            TypeError: the dtype; see check_tensors.
            MembershipError: the group shrank (the call needs every rank).
        """
        opts = opts or dist.AllreduceOptions()
        t = tensors[0]
        if len(tensors) != 1 or t.layout != torch.sparse_coo or t.device.type != "cpu":
            raise NotImplementedError("resilient allreduce: sparse needs one CPU COO tensor")
        if reduce_op("allreduce", opts) is not Reduce.SUM:
            raise NotImplementedError("resilient allreduce: sparse tensors take SUM only")
        check_tensors("allreduce", [t._values()])
        self._epochs.need_every_rank("sparse allreduce")
        sig = Signature.of("sparse_allreduce", [t], reduce=Reduce.SUM)

        def run(_: torch.Tensor | None) -> list[torch.Tensor]:
            t.copy_(self._sparse_sum(t.coalesce()))
            return tensors

        return self._calls.submit("sparse_allreduce", sig, run)

    def _sparse_sum(self, t: torch.Tensor) -> torch.Tensor:
        engine, size, me = self._epochs.engine, len(self._epochs.members), self._epochs.pos
        idx, val = t.indices(), t.values()
        counts = torch.zeros(size, dtype=torch.int64)
        counts[me] = idx.shape[1]
        engine.all_gather(counts)
        most = int(counts.max())
        row = int(math.prod(val.shape[1:]))  # elements per index (dense dimensions)
        idx_rows = torch.zeros((size, idx.shape[0] * most), dtype=torch.int64)
        val_rows = torch.zeros((size, row * most), dtype=val.dtype)
        idx_rows[me, : idx.numel()] = idx.reshape(-1)
        val_rows[me, : val.numel()] = val.reshape(-1)
        if most:
            engine.all_gather(idx_rows.view(-1))
            engine.all_gather(val_rows.view(-1))
        parts = [
            (
                idx_rows[r, : idx.shape[0] * int(n)].view(idx.shape[0], int(n)),
                val_rows[r, : row * int(n)].view(int(n), *val.shape[1:]),
            )
            for r, n in enumerate(counts.tolist())
        ]
        return torch.sparse_coo_tensor(
            torch.cat([i for i, _ in parts], dim=1), torch.cat([v for _, v in parts]), t.shape
        ).coalesce()

    def broadcast(self, tensors: list[torch.Tensor], opts: Any = None) -> ResilientWork:
        """Copy the root's ``tensors`` into every member's.

        Raises:
            ValueError, TypeError, NotImplementedError: see check_tensors.
            MembershipError: the root left the group (it shrank without it).
        """
        opts = opts or dist.BroadcastOptions()
        check_tensors("broadcast", tensors)
        root = int(opts.rootRank)
        at = self._epochs.position(root, "broadcast")  # the root's number in this epoch
        sig = Signature.of("broadcast", tensors, root=root)
        inline = self._inline(tensors)

        def run(table: torch.Tensor | None) -> list[torch.Tensor]:
            with _Flat(tensors) as flat:
                buf = flat.buffer
                if inline and table is not None:
                    buf.copy_(inline_rows(table, buf)[at])
                else:
                    self._epochs.engine_for(buf).broadcast(buf, at)
            return tensors

        # Only the root's bytes matter, but every rank waits for earlier calls alike.
        payload = (lambda: _packed(tensors) if self._rank == root else None) if inline else None
        return self._calls.submit(
            "broadcast", sig, run, payload=payload, after_previous=inline,
            devices=cuda_devices(tensors),
        )  # fmt: skip

    def barrier(self) -> ResilientWork:
        """Complete once every member has entered it, after its earlier calls."""
        sig = Signature.of("barrier", [])

        def run(table: torch.Tensor | None) -> list[torch.Tensor]:
            # The exchange ran only once every rank had finished its earlier calls
            # and entered: that already is a barrier. Without checks, run one.
            if table is None:
                self._epochs.engine.barrier()
            return []

        return self._calls.submit("barrier", sig, run, after_previous=True)
