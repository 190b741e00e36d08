"""Rail weights learned from measured rail rates, agreed by every rank.

Each rank measures, per rail, how fast its part of each collective went (bytes /
seconds, smoothed) and puts those rates in its signature row. Every rank sees the
same table, so :func:`agreed_weights` gives every rank the same weights for that
collective: slices always match across ranks (a size mismatch would make gloo
abort), and results stay bitwise identical because they do not depend on weights.

A rail of a ring is as fast as its slowest link, so each rail's rate is the
minimum over ranks. Weights are proportional to rates, quantised to 1/1024; a rail
under :data:`DROP_SHARE` gets nothing at all (outside probes): even a small share
makes every call wait for that rail, and on a lossy rail a few bytes can cost a
200 ms retransmission. The most this gives away is the bandwidth of rails 16x
slower than the rest.
Every :data:`PROBE_EVERY`-th call (by sequence number, the same on every rank)
lifts each rail to at least :data:`PROBE_SHARE`, so a rail that recovered shows
its speed again. No state is kept between calls, so a
restarted rank agrees with the others at once.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Final

from resilient import events

if TYPE_CHECKING:
    from resilient.collectives.signature import Exchange

__all__ = [
    "DOWN",
    "DROP_SHARE",
    "PROBE_EVERY",
    "PROBE_SHARE",
    "QUANTUM",
    "WeightLearner",
    "agreed_backups",
    "agreed_weights",
]

logger = logging.getLogger(__name__)

QUANTUM: Final = 1024
PROBE_EVERY: Final = 64
PROBE_SHARE: Final = 1 / 16
DROP_SHARE: Final = 1 / 16
CONFIRM_CALLS: Final = 5
# The rate a rank proposes for a rail it cannot use (NIC down, a link broken).
DOWN: Final = -1.0


def agreed_weights(
    rates: Sequence[Sequence[int]], static: Sequence[float], seq: int
) -> tuple[float, ...]:
    """The rail weights of call ``seq`` from every rank's measured ``rates`` (bytes/s).

    ``rates[rank][rail]`` is 0 where a rank has no measurement yet; then (or with a
    single rail) the ``static`` weights are used.
    """
    n = len(static)
    if n <= 1 or not rates:
        return tuple(static)
    per_rail = [min(int(row[r]) for row in rates) for r in range(n)]
    down = [rate < 0 for rate in per_rail]
    if all(down):
        return tuple(static)  # nothing better to offer: the collectives fail over or fail
    if any(down):
        # A rail dead anywhere carries nothing, probes included, until it is repaired.
        alive = [0.0 if d else w for d, w in zip(down, static, strict=True)]
        if min(r for r, d in zip(per_rail, down, strict=True) if not d) <= 0:
            return tuple(alive)
        per_rail = [0 if d else r for r, d in zip(per_rail, down, strict=True)]
        return _shares(per_rail, seq, probe_ok=False)
    if min(per_rail) <= 0:
        return tuple(static)
    return _shares(per_rail, seq, probe_ok=True)


def agreed_backups(rates: Sequence[Sequence[int]], rails: int) -> frozenset[int] | None:
    """The rails a channel of this call may fail over to: those no rank proposed
    DOWN for, so their links are in service at both ends, whatever share the
    weights gave them (a rail left out for being slow, or never measured fast
    yet, is still far better than the store). None without rates, or when every
    rail is DOWN somewhere: then the health board alone decides, as for the
    static weights :func:`agreed_weights` falls back to."""
    if not rates:
        return None
    return frozenset(r for r in range(rails) if all(int(row[r]) >= 0 for row in rates)) or None


def _shares(per_rail: Sequence[int], seq: int, *, probe_ok: bool) -> tuple[float, ...]:
    total = sum(per_rail)
    shares = [rate / total for rate in per_rail]
    probe = probe_ok and seq % PROBE_EVERY == 0
    if probe:
        shares = [max(s, PROBE_SHARE) for s in shares]
        scale = sum(shares)
        shares = [s / scale for s in shares]
    floor = 0.0 if probe else DROP_SHARE
    return tuple(0.0 if s < floor else float(max(1, round(s * QUANTUM))) for s in shares)


class WeightLearner:
    """Turns each call's exchange into its weights; logs rails that fall or recover.

    A rail is *degraded* while its agreed share is under half its static share:
    ``link.degraded`` is emitted once that held for :data:`CONFIRM_CALLS` calls in a
    row, ``link.repaired`` once the opposite did (probe calls are not counted), so
    one noisy measurement raises no event. Only this state is kept, for the events;
    the weights themselves never depend on history.
    """

    def __init__(self, static: Sequence[float], rank: int, epoch: int = 0) -> None:
        self.static = tuple(static)
        self.rank, self.epoch = rank, epoch
        self.slow: set[int] = set()
        self._streak = [0] * len(self.static)

    def weights_for(self, exchange: Exchange) -> tuple[float, ...]:
        weights = agreed_weights(exchange.rates, self.static, exchange.seq)
        if exchange.seq % PROBE_EVERY != 0:
            self._track(weights, exchange)
        return weights

    def _track(self, weights: tuple[float, ...], exchange: Exchange) -> None:
        total, static_total = sum(weights), sum(self.static)
        for rail, (w, s) in enumerate(zip(weights, self.static, strict=True)):
            slow = w / total < 0.5 * s / static_total
            if slow == (rail in self.slow):
                self._streak[rail] = 0
                continue
            self._streak[rail] += 1
            if self._streak[rail] < CONFIRM_CALLS:
                continue
            self._streak[rail] = 0
            self.slow.symmetric_difference_update({rail})
            slowest = min(row[rail] for row in exchange.rates)
            events.emit(
                "link.degraded" if slow else "link.repaired",
                epoch=self.epoch,
                links=[(self.rank, -1, rail)],
                reason=_why(rail, slowest),
                action=f"rail weights now {':'.join(f'{x:g}' for x in weights)}",
            )
            logger.warning(
                "rank %d (epoch %d, call %d): rail %d %s; rail weights now %s",
                self.rank, self.epoch, exchange.seq, rail,
                "degraded" if slow else "recovered", weights,
            )  # fmt: skip


def _why(rail: int, slowest: float) -> str:
    """What a rail's slowest proposed rate says, for a weight change's event."""
    if slowest == DOWN:
        return f"rail {rail} is down or has a broken link at some rank"
    if slowest <= 0:  # a rank that has not timed a transfer on it yet (a new epoch)
        return f"rail {rail} is up at every rank; not measured at every rank yet"
    return f"rail {rail} measured at {slowest / 1e6:.1f} MB/s (slowest rank)"
