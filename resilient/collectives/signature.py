"""Call signatures exchanged before each collective, so mismatched calls fail everywhere.

Each rank encodes what it was asked to do into a fixed-size int64 row; one small
all-gather gives every rank every row. All ranks then see the same table, so they
all reach the same verdict: either proceed, or raise
:class:`~resilient.errors.CollectiveMismatch` without moving any data.

Each row also has room for :data:`INLINE_BYTES` of payload. Collectives that small
travel inside the signature exchange itself and need no data phase. The row width
is the same for every call, whatever its size: a message size that differed between
ranks would make gloo abort the process.
"""

from __future__ import annotations

import zlib
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import numpy as np
import torch

from resilient.errors import CollectiveMismatch

if TYPE_CHECKING:
    from resilient.collectives.reduce_ops import Reduce

__all__ = [
    "WIDTH",
    "Exchange",
    "Signature",
    "exchange_of",
    "signature_table",
]

_OPS = (
    "allreduce",
    "broadcast",
    "allgather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "barrier",
    # Appended, not inserted: an op's number in the rows is its index here.
    "reduce",
    "gather",
    "scatter",
    "all_to_all",
    "all_to_all_single",
    "sparse_allreduce",
)
_DTYPES = (
    None,
    torch.float32,
    torch.float64,
    torch.float16,
    torch.bfloat16,
    torch.int32,
    torch.int64,
    # Appended, not inserted: a dtype's number in the rows is its index here.
    torch.uint8,
    torch.int8,
    torch.int16,
    torch.bool,
)
_REDUCES = (None, "sum", "avg", "product", "min", "max")
SUPPORTED_DTYPES = tuple(d for d in _DTYPES if d is not None)
_MAX_DIMS = 8
_HEADER = 8 + _MAX_DIMS
# After the header: each rank's measured rate of each rail (bytes/s), for the
# learned rail weights. Not part of the signature: ranks legitimately differ there.
MAX_RAILS = 8
# Then the rank's exchange clock, in us since its channel started: time spent
# waiting inside exchanges for the other ranks, and all the rest ("active": its own
# compute and data). What straggler detection compares across ranks.
_CLOCK = _HEADER + MAX_RAILS
# Then who held the rank's latest measured reduction up: peer (-1: none), the
# permille of the op spent waiting for it, reductions measured (resilient.detect.slow_rank).
_LAG = _CLOCK + 3
# Then up to MAX_STAGED rebuilt links waiting to go into service, each as (table
# code, peer, rail, generation), peer -1 where unused (see resilient.links.repair).
_STAGED = _LAG + 3
MAX_STAGED = 4
# Then up to MAX_CUT peers the rank reaches on no rail now (resilient.collectives.reorder), -1
# where unused: every rank orders its rings around those pairs.
_CUT = _STAGED + 4 * MAX_STAGED
MAX_CUT = 4
INLINE_BYTES = 2048
_BODY = _CUT + MAX_CUT
WIDTH = _BODY + INLINE_BYTES // 8
_FIELDS = ("seq", "op", "reduce", "dtype", "tensors", "numel", "root", "shape")


@dataclass(frozen=True, slots=True)
class Signature:
    """What one rank was asked to do in one collective."""

    seq: int
    op: str
    reduce: str | None
    dtype: torch.dtype | None
    tensors: int
    numel: int
    root: int
    shape: tuple[int, ...]
    shapes_crc: int

    @classmethod
    def of(
        cls,
        op: str,
        tensors: Sequence[torch.Tensor],
        *,
        reduce: Reduce | None = None,
        root: int = -1,
    ) -> Signature:
        shapes = [tuple(t.shape) for t in tensors]
        return cls(
            seq=0,
            op=op,
            reduce=reduce.value if reduce is not None else None,
            dtype=tensors[0].dtype if tensors else None,
            tensors=len(tensors),
            numel=sum(t.numel() for t in tensors),
            root=root,
            shape=shapes[0] if shapes else (),
            shapes_crc=zlib.crc32(repr(shapes).encode()),
        )

    def with_seq(self, seq: int) -> Signature:
        # Not dataclasses.replace: it runs on the caller's thread for every call, and
        # its field walk cost 2 us warm, ~50 us cold (a thread just woken).
        return Signature(
            seq, self.op, self.reduce, self.dtype, self.tensors, self.numel, self.root,
            self.shape, self.shapes_crc,
        )  # fmt: skip

    def header(self) -> list[int]:
        """The row's first ``_HEADER`` ints (what must match across ranks)."""
        dims = list(self.shape[:_MAX_DIMS]) + [-1] * (_MAX_DIMS - min(len(self.shape), _MAX_DIMS))
        return [
            self.seq,
            _OPS.index(self.op),
            _REDUCES.index(self.reduce),
            _DTYPES.index(self.dtype),
            self.tensors,
            self.numel,
            self.root,
            len(self.shape) * (1 << 32) + self.shapes_crc,
            *dims,
        ]

    def encode(self) -> torch.Tensor:
        return torch.tensor(self.header(), dtype=torch.int64)

    def describe(self) -> str:
        parts = [self.op]
        if self.dtype is not None:
            parts.append(str(self.dtype).removeprefix("torch."))
        parts.append(f"shape {self.shape}")
        if self.tensors != 1:
            parts.append(f"{self.tensors} tensors, {self.numel} elements")
        if self.reduce:
            parts.append(f"op {self.reduce}")
        if self.root >= 0:
            parts.append(f"root {self.root}")
        return " ".join(parts) + f" (call #{self.seq})"

    @classmethod
    def decode(cls, row: Sequence[int]) -> Signature:
        ndim = min(row[7] >> 32, _MAX_DIMS)
        return cls(
            seq=row[0],
            op=_OPS[row[1]],
            reduce=_REDUCES[row[2]],
            dtype=_DTYPES[row[3]],
            tensors=row[4],
            numel=row[5],
            root=row[6],
            shape=tuple(row[8 : 8 + ndim]),
            shapes_crc=row[7] & 0xFFFFFFFF,
        )


def _differences(rows: list[list[int]]) -> list[str]:
    fields = [name for i, name in enumerate(_FIELDS) if len({r[i] for r in rows}) > 1]
    if any(r[8:] != rows[0][8:] for r in rows) and "shape" not in fields:
        fields.append("shape")
    return fields or ["shape"]


@dataclass(frozen=True, slots=True)
class Exchange:
    """What one signature exchange agreed on.

    ``inline``: every rank's payload bytes, ``(world, INLINE_BYTES)`` uint8 (zero
    rows where none was given), or None: :meth:`payloads` then reads them from
    ``table``; ``rates``: every rank's measured rail rates;
    ``clocks``: every rank's ``(active_us, waited_us, stolen_us)`` totals when it began this
    exchange (see :class:`~resilient.check.exchange.CallChecks`); ``lagging``:
    every rank's ``(peer, permille, count)``: who held its latest measured reduction
    up, and how many it measured; ``staged``: every rank's staged rebuilt links as
    ``(table code, peer, rail, generation)``; ``cut``: every rank's peers it
    reaches on no rail.
    """

    seq: int
    inline: torch.Tensor | None  # None: read from ``table`` when asked (payloads())
    rates: list[list[int]]
    clocks: list[tuple[int, int, int]] = field(default_factory=list)
    lagging: list[tuple[int, int, int]] = field(default_factory=list)
    staged: list[list[tuple[int, int, int, int]]] = field(default_factory=list)
    cut: list[list[int]] = field(default_factory=list)
    table: torch.Tensor | None = None  # the int64 rows it was decided from

    def payloads(self) -> torch.Tensor:
        """``inline``, or the table's payload columns when it was not given (made only
        for calls that carry payloads: a view of the table costs ~2.4 us warm)."""
        if self.inline is not None:
            return self.inline
        assert self.table is not None
        return self.table[:, _BODY:].view(torch.uint8)

    def cut_pairs(self) -> frozenset[tuple[int, int]]:
        """Pairs (low, high) that one of their ends reaches on no rail."""
        return frozenset((min(r, p), max(r, p)) for r, peers in enumerate(self.cut) for p in peers)


_NO_STAGED = [0, -1, 0, 0] * MAX_STAGED  # a row's staged columns with none staged
_NO_NEWS = _NO_STAGED + [-1] * MAX_CUT  # ... and its cut columns with no peer cut off


def signature_table(
    world: int,
    sig: Signature,
    rank: int,
    payload: torch.Tensor | None = None,
    rates: Sequence[float] = (),
    clock: tuple[int, int, int] = (0, 0, 0),
    lagging: tuple[int, int, int] = (-1, 0, 0),
    staged: Sequence[tuple[int, int, int, int]] = (),
    cut: Sequence[int] = (),
) -> torch.Tensor:
    """A ``(world, WIDTH)`` exchange table with row ``rank`` holding ``sig``, rail
    ``rates``, the exchange ``clock``, ``lagging``, ``staged`` links, ``cut`` peers
    (the first MAX_CUT) and up to INLINE_BYTES of ``payload``; the other rows zero.

    Raises:
        ValueError: the payload is larger than INLINE_BYTES.
    """
    # The row before the payload is built as one list and written once: this runs
    # for every collective, and each small tensor op costs microseconds.
    row = sig.header()
    row += [int(r) for r in rates[:MAX_RAILS]] + [0] * (MAX_RAILS - min(len(rates), MAX_RAILS))
    row += [*clock, *lagging]
    if not staged and not cut:  # the usual row: nothing staged, every peer reached
        row += _NO_NEWS
    else:
        for i in range(MAX_STAGED):
            row += staged[i] if i < len(staged) else (0, -1, 0, 0)
        peers = list(cut)[:MAX_CUT]
        row += peers + [-1] * (MAX_CUT - len(peers))
    # Built in numpy and shared with torch: torch.zeros, torch.tensor and an indexed
    # copy cost 11 us warm, this 2.4 us.
    array = np.zeros((world, WIDTH), dtype=np.int64)
    array[rank, :_BODY] = row
    table = torch.from_numpy(array)
    if payload is not None:
        raw = payload.detach().reshape(-1).contiguous().cpu().view(torch.uint8)
        if raw.numel() > INLINE_BYTES:
            raise ValueError(f"inline payload of {raw.numel()} B exceeds {INLINE_BYTES} B")
        table[rank, _BODY:].view(torch.uint8)[: raw.numel()].copy_(raw)
    return table


def _staged_of(row: list[int]) -> list[tuple[int, int, int, int]]:
    return [
        (row[i], row[i + 1], row[i + 2], row[i + 3])
        for i in range(_STAGED, _CUT, 4)
        if row[i + 1] >= 0
    ]


def exchange_of(table: torch.Tensor, seq: int) -> Exchange:
    """The verdict of a complete table: every rank's row (see :func:`signature_table`),
    all-gathered.

    Raises:
        CollectiveMismatch: names the ranks of each distinct call and the fields.
    """
    rows = table.numpy()[:, :_BODY].tolist()  # numpy's tolist: a third of torch's cost
    heads = [r[:_HEADER] for r in rows]
    if heads.count(heads[0]) == len(heads):  # every row equal (compared in C)
        return Exchange(
            seq=seq,
            table=table,
            inline=None,
            rates=[r[_HEADER:_CLOCK] for r in rows],
            clocks=[(r[_CLOCK], r[_CLOCK + 1], r[_CLOCK + 2]) for r in rows],
            lagging=[(r[_LAG], r[_LAG + 1], r[_LAG + 2]) for r in rows],
            staged=[_staged_of(r) if r[_STAGED:_CUT] != _NO_STAGED else [] for r in rows],
            cut=[[p for p in r[_CUT:_BODY] if p >= 0] if r[_CUT] >= 0 else [] for r in rows],
        )
    groups: dict[tuple[int, ...], list[int]] = {}
    for r, head in enumerate(heads):
        groups.setdefault(tuple(head), []).append(r)
    described = "; ".join(
        f"rank{'s' if len(ranks) > 1 else ''} {','.join(map(str, ranks))}: "
        f"{Signature.decode(list(row)).describe()}"
        for row, ranks in groups.items()
    )
    fields = _differences(heads)
    raise CollectiveMismatch(
        f"ranks called different collectives ({', '.join(fields)} differ): {described}",
        calls={r: Signature.decode(head).describe() for r, head in enumerate(heads)},
        fields=tuple(fields),
    )
