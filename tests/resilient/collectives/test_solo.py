"""A replacement's calls before it is admitted: local, and bounded outside a warm-up."""

from __future__ import annotations

import pytest
import torch

from resilient.collectives.engine import Reduce
from resilient.collectives.solo import FREE_CALLS, SoloEngine
from resilient.errors import RecoveryError

pytestmark = pytest.mark.timeout(10)


def test_calls_run_as_if_this_rank_were_alone() -> None:
    engine = SoloEngine(rank=1, world=3)
    flat = torch.tensor([0.0, 0.0, 5.0, 6.0, 0.0, 0.0])
    engine.all_gather(flat)
    assert flat.tolist() == [5.0, 6.0, 5.0, 6.0, 5.0, 6.0]
    mine = engine.reduce_scatter(torch.arange(6.0), Reduce.SUM)
    assert (mine.start, mine.stop) == (2, 4)
    t = torch.ones(3)
    engine.all_reduce(t, Reduce.AVG)
    engine.broadcast(t, 0)
    assert t.tolist() == [1.0, 1.0, 1.0]


def test_a_replacement_that_never_joins_fails_instead_of_training_alone() -> None:
    engine = SoloEngine(rank=0, world=2)
    for _ in range(FREE_CALLS):
        engine.barrier()
    with pytest.raises(RecoveryError):
        engine.all_reduce(torch.ones(1), Reduce.SUM)


def test_the_session_warm_up_is_not_counted() -> None:
    engine = SoloEngine(rank=0, world=2)
    engine.warming = True
    for _ in range(FREE_CALLS * 4):
        engine.all_reduce(torch.ones(1), Reduce.SUM)
    engine.warming = False
    engine.barrier()  # the free calls are still all there
