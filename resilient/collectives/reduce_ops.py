"""The reduction ops of the collectives, and the rank-order fold they all follow."""

from __future__ import annotations

import enum
from collections.abc import Callable

import torch

__all__ = ["REDUCERS", "Reduce", "Reducer", "finish_avg", "fold_rows"]

# Folds its second operand into its first, in place.
Reducer = Callable[[torch.Tensor, torch.Tensor], None]


class Reduce(enum.Enum):
    SUM = "sum"
    AVG = "avg"
    PRODUCT = "product"
    MIN = "min"
    MAX = "max"


def _sum(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.add_(src)


def _prod(dst: torch.Tensor, src: torch.Tensor) -> None:
    dst.mul_(src)


def _min(dst: torch.Tensor, src: torch.Tensor) -> None:
    torch.minimum(dst, src, out=dst)


def _max(dst: torch.Tensor, src: torch.Tensor) -> None:
    torch.maximum(dst, src, out=dst)


REDUCERS: dict[Reduce, Reducer] = {
    Reduce.SUM: _sum,
    Reduce.AVG: _sum,
    Reduce.PRODUCT: _prod,
    Reduce.MIN: _min,
    Reduce.MAX: _max,
}


def finish_avg(t: torch.Tensor, op: Reduce, world: int) -> None:
    """Turn a SUM into the AVG in place when ``op`` is AVG (integers truncate)."""
    if op is Reduce.AVG:
        if t.is_floating_point():
            t.div_(world)
        else:
            t.copy_(torch.div(t, world, rounding_mode="trunc"))


def fold_rows(rows: torch.Tensor, op: Reduce) -> torch.Tensor:
    """Reduce ``rows[0] op rows[1] op ...`` in rank order (the mesh order, bit for bit).

    AVG divides the sum by the number of rows, as the collectives do.
    """
    acc = rows[0].clone()
    for row in rows[1:]:
        REDUCERS[op](acc, row)
    finish_avg(acc, op, rows.shape[0])
    return acc
