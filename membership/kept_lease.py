"""A lease in etcd, kept alive from a thread, and the fence it can keep.

Granted by :meth:`KeptLease.grant`, refreshed every third of its TTL, counted
from when the last refresh was sent (again ``_RETRY_S`` after a failed refresh:
it must be refreshed before the fence deadline, not merely within its TTL).
:meth:`KeptLease.watch` calls back when the lease may be about to expire in
etcd: ``fence_margin_s`` before the TTL has passed since the last refresh etcd
acknowledged, measured from when that refresh was *sent* (etcd restarted the TTL
no earlier), or at once when etcd says the lease is gone. A node agent's
(:class:`membership.nodes.NodeRendezvous`) fences the node's ranks; a rank's
member lease (:class:`membership.members.Membership`) fences the rank itself
where asked (``RESILIENT_FENCE=1``).
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from typing import Final

from membership.etcd_client import EtcdClient
from resilient.errors import MembershipError

__all__ = ["KeptLease", "fence_margin"]

logger = logging.getLogger(__name__)

_POLL_S: Final = 0.2
_RETRY_S: Final = 0.2
_SLOW_LOG_S: Final = 30.0  # slow keep-alive answers: one warning per this long


def fence_margin(ttl_s: float) -> float:
    """How long before a lease could expire in etcd its holder fences: a fifth of
    the TTL, 0.5 to 2 s (killing a process group and reaping it takes milliseconds;
    the rest covers a busy machine's scheduling delays)."""
    return min(max(0.2 * ttl_s, 0.5), 2.0)


class KeptLease:
    """One holder's lease. ``who()`` names the holder in log lines (it changes when
    a spare claims a node); ``what``: the lease in messages ("node lease");
    ``on_gone``: called (from the keep-alive thread) when etcd says the lease is
    gone; ``margin_s``: how long before the lease could lapse the fence comes
    (default :func:`fence_margin`).

    Raises (from :meth:`grant`): EtcdUnavailable, MembershipError, as the client.
    """

    def __init__(
        self,
        client: EtcdClient,
        ttl_s: float,
        who: Callable[[], str],
        *,
        what: str = "node lease",
        on_gone: Callable[[], None] | None = None,
        margin_s: float | None = None,
    ) -> None:
        self._client, self._ttl_s, self._who = client, ttl_s, who
        self._what, self._on_gone = what, on_gone
        self.fence_margin_s = fence_margin(ttl_s) if margin_s is None else margin_s
        self.id: int | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        # When the last keep-alive etcd acknowledged was sent, and the last one
        # sent, answered or not (monotonic): a fence says which of the two lagged.
        self._acked_at = self._sent_at = 0.0
        self._last_answer: str | None = "answered"  # None while one is awaited
        self._slow, self._slow_logged = 0, -math.inf  # answers after their period
        self._gone = threading.Event()
        self.fenced: str | None = None  # why the holder fenced itself, once it did
        self._watched = False

    def grant(self) -> int:
        """Grant the lease and start its keep-alive thread; returns its id."""
        sent = time.monotonic()
        lease = self._client.grant_lease(math.ceil(self._ttl_s))
        self.id, self._acked_at, self._sent_at = lease, sent, sent
        self._start(self._keepalive_loop, f"{self._what.replace(' ', '-')}-keepalive")
        return lease

    def fence_at(self) -> float:
        """When (monotonic) the holder must have fenced: ``fence_margin_s`` before
        the lease could expire in etcd."""
        return self._acked_at + math.ceil(self._ttl_s) - self.fence_margin_s

    def watch(self, fence: Callable[[str], None]) -> None:
        """Call ``fence(why)`` once, from a watchdog thread, at :meth:`fence_at` (or
        at once when etcd says the lease is gone); :attr:`fenced` says why after."""
        self._watched = True

        def watchdog() -> None:
            while not self._stop.is_set():
                left = self.fence_at() - time.monotonic()
                if self._gone.is_set() or left <= 0:
                    break
                self._gone.wait(min(left, _POLL_S))
            else:
                return
            why = (
                f"etcd says its {self._what} expired"
                if self._gone.is_set()
                else f"its {self._what} was not refreshed for "
                f"{time.monotonic() - self._acked_at:.1f} s (TTL {math.ceil(self._ttl_s)} s; "
                f"{self._last_send()})"
            )
            self.fenced = why
            logger.error("%s fenced: %s", self._who(), why)
            fence(why)

        self._start(watchdog, f"{self._what.replace(' ', '-')}-fence")

    def _last_send(self) -> str:
        """Where the keep-alive stands, for a fence's reason: waiting for etcd's
        answer (a slow etcd, or a lost one) or not sending (its thread starved)."""
        ago, answer = time.monotonic() - self._sent_at, self._last_answer
        if answer is None:
            return f"a keep-alive sent {ago:.1f} s ago is unanswered"
        return f"the last keep-alive went out {ago:.1f} s ago: {answer}"

    def _start(self, target: Callable[[], None], name: str) -> None:
        thread = threading.Thread(target=target, name=name, daemon=True)
        self._threads.append(thread)
        thread.start()

    def _keepalive_loop(self) -> None:
        period = self._ttl_s / 3.0
        due = time.monotonic() + period
        while not self._stop.wait(max(due - time.monotonic(), 0.0)):
            lease = self.id
            if lease is None:
                return
            sent = time.monotonic()
            # Paced by when each refresh went out, not by when its answer came: a
            # slow answer (a busy etcd or host) used to push the next one a whole
            # period later, so two slow ones in a row left the lease unrefreshed
            # past its fence with every refresh answered.
            due = sent + period
            # Bounded by the fence, when one is watched: an answer after it would
            # come too late anyway. Unwatched (a rank's member lease by default),
            # a slow etcd gets the whole period, as before the fence existed.
            budget = max(min(period, self.fence_at() - sent), 0.1) if self._watched else period
            self._sent_at, self._last_answer = sent, None
            try:
                ttl = self._client.refresh_lease(lease, budget_s=budget)
            except MembershipError as exc:
                self._last_answer = f"failed ({exc})"
                logger.warning("%s: its %s keep-alive failed: %s", self._who(), self._what, exc)
                due = time.monotonic() + _RETRY_S
                continue
            if ttl <= 0:
                logger.error("%s: its %s %x expired", self._who(), self._what, lease)
                self._gone.set()
                if self._on_gone is not None:
                    self._on_gone()
                return
            took, self._last_answer = time.monotonic() - sent, "answered"
            if took > period:  # the fence's slack shrinks by as much (module doc)
                self._slow_answer(took, period)
            self._acked_at = sent

    def _slow_answer(self, took: float, period: float) -> None:
        """Log a keep-alive answered after more than its period: a warning at most
        every ``_SLOW_LOG_S``, with how many were slow since the last one."""
        self._slow += 1
        now = time.monotonic()
        if now < self._slow_logged + _SLOW_LOG_S:
            return
        logger.warning(
            "%s: its %s keep-alive was answered after %.2f s (one every %.2f s; %d slow "
            "since the last warning)", self._who(), self._what, took, period, self._slow,
        )  # fmt: skip
        self._slow, self._slow_logged = 0, now

    def stop(self) -> None:
        """Stop the keep-alive and the fence watch (the lease lapses by its TTL)."""
        self._stop.set()
        for thread in self._threads:
            if thread is not threading.current_thread():
                thread.join(5.0)

    def close(self) -> None:
        """Stop the threads and revoke the lease (the keys under it go with it).
        Safe to call twice; etcd errors are logged, not raised."""
        self.stop()
        lease, self.id = self.id, None
        if lease is not None:
            try:
                self._client.revoke_lease(lease, budget_s=3.0)
            except MembershipError as exc:
                logger.warning(
                    "%s: revoking its %s %x failed: %s", self._who(), self._what, lease, exc
                )
