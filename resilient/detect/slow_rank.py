"""Agreeing on one slow rank, so all_reduce can take the straggler-aware schedule.

When every NIC of one rank is slow, a ring or an even mesh runs the whole job at
that rank's speed: it moves as many bytes as anyone. The straggler-aware schedule
(:meth:`~resilient.collectives.engine.RingEngine.all_reduce` with ``slow_rank``) gives it
no chunk to reduce, so it sends its data once and receives the result once while
the others reduce among themselves (DESIGN.md's bound ``max(T_healthy, N/(bB))``).

Evidence: after each mesh reduction of at least ``LAG_MIN_BYTES`` the engine calls
its ``lag_meter`` (a :class:`SendRates`, see :mod:`resilient.collectives.engine`):
every rank reads its links' send rates from the kernel (bytes acknowledged per
microsecond the connection had data to send, ``TCP_INFO``) and names its slowest
peer, with that rate in permille of the median of its other peers
(``SendRates.lagging``). The kernel's rate is what the path allowed, whatever the
schedule, so it reads the same in either schedule. Every exchange row carries it,
so all ranks see the same table, run the same vote and switch on the same call;
the results stay identical on every rank (the straggler-aware schedule folds in the
mesh's rank order).

* enter: on :data:`ENTER_VOTES` consecutive votes with new measurements, at least
  :func:`quorum` of the other ranks name the same rank at :data:`ENTER_PERMILLE` or
  less (with 3 votes a healthy rank of a CPU-bound 4-rank job on loopback was named
  once, after 761 calls: one rank's share dips under 650 permille in ~10 % of
  measurements there);
* leave: on :data:`LEAVE_VOTES` consecutive such votes, the quorum no longer names
  it at :data:`LEAVE_PERMILLE` or less;
* after leaving, :data:`COOLDOWN_CALLS` calls pass before it may enter again, so a
  rank near the threshold does not flip the schedule back and forth.

Entering and leaving are also the ``straggler.confirmed`` / ``straggler.cleared``
verdicts with ``cause: link``: a rank whose links are slow while its compute is
not. Compute and stalled stragglers come from the exchange clocks instead
(:mod:`resilient.detect.stragglers`): a rank those already show slow is not reported
again as a link straggler (a stopped process's links look slow too: seen in the
``straggler`` scenario), though the schedule still spares it the reduction work.
"""

from __future__ import annotations

import logging
import statistics
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any, Final

from resilient import events

if TYPE_CHECKING:
    from resilient.detect.stragglers import Verdicts
    from resilient.links.table import LinkTable

__all__ = ["SendRates", "SlowRankVote", "quorum"]

logger = logging.getLogger(__name__)

ENTER_PERMILLE: Final = 650
LEAVE_PERMILLE: Final = 800
ENTER_VOTES: Final = 6
LEAVE_VOTES: Final = 3
COOLDOWN_CALLS: Final = 100
# No entry in the first calls of an epoch: fresh links measure unevenly (slow
# start, first touches); seen naming a healthy rank slow at the start of a job.
WARMUP_CALLS: Final = 20

Lagging = tuple[int, int, int]  # slowest peer (-1: none), its permille, measurements

# Below this much sending since the last measurement (the kernel counts in
# jiffies), a peer's rate is not measured.
MIN_BUSY_US: Final = 5000
_ALPHA: Final = 0.5  # smoothing: one op's rates swing with TCP's dynamics


class SendRates:
    """This rank's evidence: its links' send rates, as ``lagging``."""

    def __init__(self) -> None:
        self.lagging: Lagging = (-1, 1000, 0)
        self._sent: dict[tuple[int, int], tuple[Any, int, int]] = {}  # link, acked, busy
        self._rates: dict[int, float] = {}

    def measure(self, links: LinkTable, peers: Sequence[int]) -> None:
        """Read each peer's send rate since the last call and keep the slowest:
        ``(peer, permille of the other peers' median, measurements so far)``.

        A rank with a peer it reaches on no rail (the pair goes through the store)
        abstains, ``(-1, 1000, n + 1)``: its call was paced by the relay, and its
        other links' rates then say nothing about its peers (seen in the
        ``partition-pair`` scenario: the two cut-off ranks named a healthy third).
        """
        rates: dict[int, float] = {}
        table = links.links()
        cut_off = bool(links.relayed)
        for peer in peers:
            acked = busy = 0
            reached = False
            for rail in range(len(links.rails)):
                link = table.get((peer, rail))
                now = link.sent() if link is not None else None
                if link is None or now is None:
                    continue
                reached = True
                before = self._sent.get((peer, rail))
                self._sent[(peer, rail)] = (link, now[0], now[1])
                if before is not None and before[0] is link:
                    acked, busy = acked + now[0] - before[1], busy + now[1] - before[2]
            cut_off = cut_off or not reached
            if busy >= MIN_BUSY_US:
                old, new = self._rates.get(peer), acked / busy
                rates[peer] = self._rates[peer] = new if old is None else old + _ALPHA * (new - old)
        if cut_off:
            self.lagging = (-1, 1000, self.lagging[2] + 1)
            return
        if len(rates) < 2:
            return
        slowest = min(rates, key=lambda p: rates[p])
        others = statistics.median(r for p, r in rates.items() if p != slowest)
        share = min(1000, int(1000 * rates[slowest] / others)) if others > 0 else 1000
        self.lagging = (slowest, share, self.lagging[2] + 1)


def quorum(world: int) -> int:
    """How many of the other ranks must name a rank: two thirds of them, at least 2."""
    return max(2, -(-2 * (world - 1) // 3))


def _share(lagging: Sequence[Lagging], rank: int) -> int:
    """The median permille of the voters naming ``rank`` (1000 when none does)."""
    shares = [share for voter, (peer, share, _) in enumerate(lagging) if peer == rank != voter]
    return int(statistics.median(shares)) if shares else 1000


def named(lagging: Sequence[Lagging], permille: int) -> int | None:
    """The rank a quorum of the others name as slow, at ``permille`` or less."""
    votes: dict[int, int] = {}
    for voter, (peer, share, _) in enumerate(lagging):
        if 0 <= peer < len(lagging) and peer != voter and share <= permille:
            votes[peer] = votes.get(peer, 0) + 1
    need = quorum(len(lagging))
    return next((p for p, n in votes.items() if n >= need), None)


class SlowRankVote:
    """The agreed slow rank (or None), updated from each exchange's ``lagging``."""

    def __init__(
        self,
        rank: int,
        world: int,
        epoch: int = 0,
        explained: Callable[[int], bool] | None = None,
        sink: Verdicts | None = None,
    ) -> None:
        """``explained(rank)``: the exchange clocks already show that rank slow at
        compute or stalled (resilient.detect.stragglers): its slow links are a symptom,
        so the vote still switches the schedule but reports no link straggler."""
        self.rank, self.world, self.epoch = rank, world, epoch
        self._explained = explained
        self._sink = sink
        self._reported: int | None = None  # the link straggler confirmed, if any
        self.slow: int | None = None
        self._streak = 0
        self._candidate: int | None = None
        self._seen: tuple[int, ...] = ()
        self._cooldown_until = WARMUP_CALLS
        self._lagging: Sequence[Lagging] = ()

    def decide(self, seq: int, lagging: Sequence[Lagging]) -> int | None:
        """The slow rank for call ``seq`` (the same on every rank for the same table)."""
        if self.world < 3 or len(lagging) != self.world:
            return self.slow
        counts = tuple(c for _, _, c in lagging)
        if counts == self._seen:  # no new measurement: nothing to vote on
            return self.slow
        self._seen = counts
        self._lagging = lagging
        if self.slow is None:
            self._vote_enter(seq, named(lagging, ENTER_PERMILLE))
        else:
            self._vote_leave(seq, named(lagging, LEAVE_PERMILLE))
        return self.slow

    def _vote_enter(self, seq: int, candidate: int | None) -> None:
        if candidate is None or seq < self._cooldown_until:
            self._candidate, self._streak = None, 0
            return
        self._streak = self._streak + 1 if candidate == self._candidate else 1
        self._candidate = candidate
        if self._streak >= ENTER_VOTES:
            self.slow, self._streak = candidate, 0
            self._report(seq, entered=True)

    def _vote_leave(self, seq: int, candidate: int | None) -> None:
        self._streak = 0 if candidate == self.slow else self._streak + 1
        if self._streak >= LEAVE_VOTES:
            self._report(seq, entered=False)
            self.slow, self._streak, self._candidate = None, 0, None
            self._cooldown_until = seq + COOLDOWN_CALLS

    def _report(self, seq: int, *, entered: bool) -> None:
        slow = self.slow
        assert slow is not None
        # The straggler's verdict, with its cause: its links are slow (a compute or
        # stalled straggler is judged on the exchange clocks, resilient.detect.stragglers).
        share = _share(self._lagging, slow)
        explained = self._explained is not None and self._explained(slow)
        if (entered and not explained) or (not entered and self._reported == slow):
            self._reported = slow if entered else None
            if self._sink is not None:
                if entered:
                    self._sink.add(slow, "link", share / 1000)
                else:
                    self._sink.clear(slow, "link")
            events.emit(
                "straggler.confirmed" if entered else "straggler.cleared", epoch=self.epoch,
                rank=slow, call=seq, relative=round(share / 1000, 3), cause="link",
                reason=f"the other ranks send to rank {slow} at {share / 10:.0f}% of their "
                "rate to anyone else (median of their votes)",
                action="reported",
            )  # fmt: skip
        if entered:
            reason = (
                f"the other ranks send to rank {slow} at <= {ENTER_PERMILLE / 10:.0f}% of "
                "their rate to anyone else: its links are all slow"
            )
            action = f"straggler-aware all_reduce: rank {slow} sends once, receives once"
            # The finding itself (the schedule change below is the action taken).
            events.emit(
                "link.degraded", epoch=self.epoch, links=[(slow, -1, -1)], reason=reason,
                action="switching all_reduce to the straggler-aware schedule", call=seq,
            )  # fmt: skip
        else:
            reason = f"the other ranks send to rank {slow} about as fast as to anyone else"
            action = "all_reduce back to the normal schedule"
        events.emit(
            "link.rerouted", epoch=self.epoch, links=[(slow, -1, -1)], reason=reason,
            action=action, call=seq,
        )  # fmt: skip
        logger.warning(
            "rank %d (epoch %d, call %d): %s (%s)", self.rank, self.epoch, seq, action, reason
        )
