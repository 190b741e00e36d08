"""Signatures: encode/decode round trip and descriptions (no processes needed)."""

from __future__ import annotations

import pytest
import torch

from resilient.collectives.engine import Reduce
from resilient.collectives.signature import Signature


@pytest.mark.timeout(10)
def test_round_trip() -> None:
    sig = Signature.of("allreduce", [torch.zeros(3, 4, dtype=torch.bfloat16)], reduce=Reduce.MAX)
    sig = sig.with_seq(7)
    back = Signature.decode([int(v) for v in sig.encode().tolist()])
    assert back == sig
    text = back.describe()
    assert "bfloat16" in text and "(3, 4)" in text and "max" in text and "#7" in text


@pytest.mark.timeout(10)
def test_shapes_with_equal_numel_differ() -> None:
    a = Signature.of("allreduce", [torch.zeros(2, 6)]).encode()
    b = Signature.of("allreduce", [torch.zeros(3, 4)]).encode()
    assert not torch.equal(a, b)


@pytest.mark.timeout(10)
def test_barrier_has_no_tensors() -> None:
    sig = Signature.of("barrier", [])
    assert Signature.decode([int(v) for v in sig.encode().tolist()]).op == "barrier"


def test_exchange_names_the_pairs_any_row_reports_cut_off() -> None:
    from resilient.collectives.signature import Exchange

    ex = Exchange(seq=3, inline=torch.zeros(0), rates=[], cut=[[2], [], [0], [1, 0]])
    assert ex.cut_pairs() == frozenset({(0, 2), (1, 3), (0, 3)})
    assert Exchange(seq=1, inline=torch.zeros(0), rates=[]).cut_pairs() == frozenset()
