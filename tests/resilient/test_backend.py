"""The backend factory torch calls: the world group or a subgroup, and what each may do."""

from __future__ import annotations

from datetime import timedelta
from types import SimpleNamespace

import pytest
import torch.distributed as dist

from resilient.backend import create_group
from resilient.errors import RecoveryError


@pytest.mark.timeout(30)
def test_a_replacement_cannot_make_a_subgroup(monkeypatch: pytest.MonkeyPatch) -> None:
    # A replacement (incarnation 1) making a subgroup would wait for survivors that
    # made theirs long ago: it is refused at once, before the store is touched.
    monkeypatch.setenv("RESILIENT_INCARNATION", "1")
    store = dist.HashStore()
    options = SimpleNamespace(
        store=store, group_rank=1, group_size=2, timeout=timedelta(seconds=5),
        global_ranks_in_group=[2, 3],
    )  # fmt: skip
    with pytest.raises(RecoveryError, match=r"rank 3 \(incarnation 1\).*ranks \[2, 3\]"):
        create_group(options)
    assert store.num_keys() == 0


@pytest.mark.timeout(30)
def test_the_backend_is_registered_with_torchs_extended_api() -> None:
    import resilient

    resilient.torch_autoload()
    plugin = dist.Backend._plugins["RESILIENT"]
    # The extended API hands the factory the job ranks of a subgroup.
    assert plugin.extended_api is True
