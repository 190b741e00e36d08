"""The backend factory torch calls: the world group or a subgroup, and what each may do."""

from __future__ import annotations

import multiprocessing as mp
from datetime import timedelta
from types import SimpleNamespace
from typing import Any

import pytest
import torch.distributed as dist

from resilient.backend import create_group


def _replacements_subgroup(_: int) -> tuple[Any, ...]:
    import os

    os.environ["RESILIENT_INCARNATION"] = "1"
    os.environ["RESILIENT_RAILS"] = "127.0.1.4"
    store = dist.HashStore()
    store.set("resilient/roster/0", "2:2,3")  # the survivor's claim, made long ago
    options = SimpleNamespace(
        store=store, group_rank=1, group_size=2, timeout=timedelta(seconds=5),
        global_ranks_in_group=[2, 3], group_id="1",
    )  # fmt: skip
    pg = create_group(options)
    try:
        return (pg.is_subgroup, pg.joining, pg.membership, pg.job_ranks, pg.incarnation,
                store.get("resilient/roster/1"))  # fmt: skip
    finally:
        pg.shutdown()


@pytest.mark.timeout(60)
def test_a_replacements_subgroup_waits_for_admission() -> None:
    # A replacement (incarnation 1) meets the survivors' subgroup of the same name:
    # their claims are in the store, and it runs its calls alone (joining) until
    # recovery.Session admits it (recovery.subgroups). In a process of its own: a
    # group's threads in pytest's process would be there at later tests' forks.
    with mp.get_context("spawn").Pool(1) as pool:
        got = pool.map(_replacements_subgroup, [0], chunksize=1)[0]
    assert got == (True, True, None, (2, 3), 1, b"3:2,3")


@pytest.mark.timeout(30)
def test_the_backend_is_registered_with_torchs_extended_api() -> None:
    import resilient

    resilient.torch_autoload()
    plugin = dist.Backend._plugins["RESILIENT"]
    # The extended API hands the factory the job ranks of a subgroup.
    assert plugin.extended_api is True
