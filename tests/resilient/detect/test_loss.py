"""A rail whose links retransmit is proposed slower, for a while, then recovers."""

from __future__ import annotations

import pytest

from resilient.detect.retransmits import HOLD_S, MIN_FACTOR, RailLoss


def test_loss_scales_the_rail_down_and_the_penalty_expires() -> None:
    totals = {0: (0, 0), 1: (0, 0)}
    loss = RailLoss(lambda: totals)
    assert loss.factor(0, now=0.0) == 1.0  # first reading: nothing to compare yet
    totals = {0: (50, 1000), 1: (0, 1000)}  # rail 0 lost 5 %, rail 1 nothing
    assert loss.factor(0, now=0.2) == pytest.approx(MIN_FACTOR)
    assert loss.factor(1, now=0.2) == 1.0
    totals = {0: (55, 2000), 1: (0, 2000)}  # 0.5 %: a lighter penalty
    light = loss.factor(0, now=0.4)
    assert MIN_FACTOR < light < 1.0
    totals = {0: (55, 2005), 1: (0, 2005)}  # too few segments to say anything
    assert loss.factor(0, now=0.6) == light
    assert loss.factor(0, now=0.4 + HOLD_S + 0.1) == 1.0  # no loss seen since: back


def test_a_reset_counter_is_not_read_as_loss() -> None:
    totals = {0: (100, 10_000)}
    loss = RailLoss(lambda: totals)
    loss.factor(0, now=0.0)
    totals = {0: (0, 30)}  # the link was rebuilt: its counters start again
    assert loss.factor(0, now=0.2) == 1.0
