"""The deferred pump wake-ups (resilient.group.p2p_late_wakes), with channels that
count their kicks (pure logic; the channels' use of it runs in test_p2p.py)."""

from __future__ import annotations

import threading
import time

import pytest

from resilient.group.p2p_late_wakes import LateWakes

pytestmark = pytest.mark.timeout(30)


class _Chan:
    def __init__(self, wakes: bool = True) -> None:
        self.kicks = 0
        self._wakes = wakes
        self.kicked = threading.Event()

    def kick(self) -> bool:
        self.kicks += 1
        self.kicked.set()
        return self._wakes


def test_a_deferred_channel_is_kicked_after_the_grace_and_only_once() -> None:
    late = LateWakes(grace_s=0.01, max_s=0.02)
    chan = _Chan()
    began = time.monotonic()
    late.defer(chan)
    late.defer(chan)  # deferred twice before its kick: one kick
    assert chan.kicked.wait(5.0)
    assert time.monotonic() - began >= 0.01
    time.sleep(0.1)
    assert chan.kicks == 1
    late.close()


def test_flush_kicks_every_other_channel_at_once() -> None:
    late = LateWakes(grace_s=5.0, max_s=5.0)  # the ticker would take 5 s
    mine, other, third = _Chan(), _Chan(), _Chan()
    for chan in (mine, other, third):
        late.defer(chan)
    late.flush(mine)
    assert (mine.kicks, other.kicks, third.kicks) == (0, 1, 1)
    late.close()  # what is still deferred is kicked at close
    assert mine.kicks == 1


def test_ticks_back_off_while_nothing_needs_waking() -> None:
    late = LateWakes(grace_s=0.002, max_s=0.016)
    quiet = _Chan(wakes=False)  # every kick finds its ops driven by their waiter
    for _ in range(20):
        quiet.kicked.clear()
        late.defer(quiet)
        assert quiet.kicked.wait(5.0)
    assert late._period_s == 0.016  # backed off to the cap
    woken = _Chan(wakes=True)
    late.defer(woken)
    assert woken.kicked.wait(5.0)
    time.sleep(0.05)
    assert late._period_s == 0.002  # a kick that woke a pump: short again
    late.close()


def test_a_closed_instance_kicks_at_once_and_bad_bounds_are_refused() -> None:
    late = LateWakes()
    late.close()
    chan = _Chan()
    late.defer(chan)
    assert chan.kicks == 1
    with pytest.raises(ValueError, match="grace_s"):
        LateWakes(grace_s=0.0)
    with pytest.raises(ValueError, match="grace_s"):
        LateWakes(grace_s=0.1, max_s=0.01)
