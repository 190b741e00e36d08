"""The in-process fault hook's matching and timing rules (pure logic)."""

from __future__ import annotations

import json

import pytest

from resilient.links.fault_hook import FaultHook, LinkFault


@pytest.mark.timeout(10)
def test_a_nic_fault_hits_every_link_of_that_rank_on_that_rail_only() -> None:
    f = LinkFault.from_json(json.dumps({"kind": "fail", "rank": 1, "rail": 0}))
    assert f.affects(1, 2, 0) and f.affects(0, 1, 0)  # both ends see it
    assert not f.affects(1, 2, 1)  # other rail
    assert not f.affects(0, 2, 0)  # a link without rank 1


@pytest.mark.timeout(10)
def test_a_partition_hits_only_the_pair() -> None:
    f = LinkFault.from_json(json.dumps({"kind": "fail", "rank": 1, "peer": 2, "rail": 0}))
    assert f.affects(1, 2, 0) and f.affects(2, 1, 0)
    assert not f.affects(1, 0, 0) and not f.affects(1, 2, 1)


@pytest.mark.timeout(10)
def test_throttle_stretches_an_op_to_the_rate_and_drop_delays_some() -> None:
    hook = FaultHook()
    hook.faults = (LinkFault(kind="throttle", rank=1, rail=0, rate_bps=8e6),)  # 1 MB/s
    assert hook.delay_s(0, 1, 0, 1_000_000, 0.25) == pytest.approx(0.75)
    assert hook.delay_s(0, 2, 0, 1_000_000, 0.0) == 0.0
    assert not hook.failed(0, 1, 0)
    hook.faults = (LinkFault(kind="drop", rank=1, rail=0, drop_p=1.0),)
    assert hook.delay_s(0, 1, 0, 10, 0.0) == pytest.approx(0.2)
    hook.faults = (LinkFault(kind="fail", rank=1, rail=0),)
    assert hook.failed(2, 1, 0) and not hook.failed(2, 0, 0)


@pytest.mark.timeout(10)
@pytest.mark.parametrize(
    "raw", ['{"kind": "explode", "rank": 1, "rail": 0}', '{"kind": "fail"}', "[1, 2]", "{"]
)
def test_malformed_records_are_refused(raw: str) -> None:
    with pytest.raises((ValueError, KeyError)):
        LinkFault.from_json(raw)
