"""Stalled link ops, reported long before their deadline.

A link op that waits far longer than its size explains (a partition, a hung peer,
a NIC that lost its carrier) fails only at its deadline, 10 s by default: gloo
cannot be asked "are you stuck?" without giving up, since a ``wait`` that times out
closes the pair. So waits register here instead, and a watchdog thread (one per
process, started on first use) emits ``link.degraded`` for a link whose op has been
pending longer than :data:`STALL_S` (plus the time its bytes need at the expected
rate), once per stall; the wait itself goes on untouched. Waits that may
legitimately last (acknowledgements, control links: they wait for the peer's own
progress) are reported only when the kernel shows the first signs of a dead
connection (retransmission timeouts and no ACK for :data:`STALL_S`).

While such an op stays pending, the watchdog also asks its link whether the kernel
sees the connection dead (``network_stall``: data unacknowledged, retransmission
timeouts, no ACK for a second; a partition or heavy loss, not a slow peer). If so
it cuts the link, which fails the op over to another rail at once instead of at
its deadline.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from typing import Final

from resilient import events
from resilient.failures import FailureSite

__all__ = ["STALL_S", "WATCH", "StallWatch", "watch"]

logger = logging.getLogger(__name__)

STALL_S: Final = 0.5
_TICK_S: Final = 0.05


# A pending op: (link, owner, start, limit_s, quiet). A plain tuple: begin/end run
# on every link wait, and nothing there may cost more than a dict store.
_Op = tuple[tuple[int, int, int], object, float, float, bool]
_OWNER: Final = 1


class StallWatch:
    """Pending link ops; see the module docstring.

    ``begin``/``end`` take no lock (single dict operations, atomic under the GIL);
    the watchdog reads a snapshot and keeps what it reported or cut by token.
    """

    def __init__(self) -> None:
        self._ops: dict[int, _Op] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()  # starting the thread
        self._thread: threading.Thread | None = None
        self._reported: set[int] = set()  # tokens reported (the watchdog's own)
        self._cut_tokens: set[int] = set()
        self.reported = 0
        self.cut = 0
        # The watchdog retries every tick whatever failed; these say so when it
        # keeps failing (resilient.failures) instead of a debug line per tick.
        # One site for the checks of all links, judged per tick: a link whose
        # check keeps failing is a failing streak even while others' succeed.
        self.check_failures = FailureSite(
            "stall check (network_stall)", action=f"checking again every {_TICK_S} s", log=logger
        )
        self._check_failed = False  # a check failed in the current tick
        self.tick_failures = FailureSite(
            "stall watchdog", action=f"retrying every {_TICK_S} s", log=logger
        )

    def begin(
        self, link: tuple[int, int, int], owner: object, expected_s: float, *, report: bool = True
    ) -> int:
        """Register an op about to be waited on; returns the token for :meth:`end`.

        ``report=False``: never logged as stalled, only checked for a dead connection.
        """
        token = next(self._ids)
        self._ops[token] = (link, owner, time.monotonic(), STALL_S + expected_s, not report)
        if self._thread is None:
            self._start()
        return token

    def end(self, token: int) -> None:
        self._ops.pop(token, None)

    def waiting_on(self, owner: object) -> bool:
        """Whether an op on ``owner`` (a Link) is being waited for: this watch then
        judges its connection (resilient.detect.peer_watch judges the idle ones)."""
        return any(op[_OWNER] is owner for op in list(self._ops.values()))

    def _start(self) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="stall-watch", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        while True:
            time.sleep(_TICK_S)
            try:
                self._tick(time.monotonic())
            except Exception as exc:  # the process's only watchdog must not die
                self.tick_failures.failed(exc)
                continue
            self.tick_failures.succeeded()

    def _tick(self, now: float) -> None:
        self._check_failed = False
        ops = list(self._ops.items())
        live = {token for token, _ in ops}
        self._reported &= live
        self._cut_tokens &= live
        late = [(token, op) for token, op in ops if now - op[2] > op[3]]
        overdue = [op for token, op in late if token not in self._cut_tokens]
        due = [(token, op) for token, op in late if token not in self._reported]
        why = {token: self._suspect(op) if op[4] else "" for token, op in due}
        # One report per link and stall, however many of its ops are pending, also
        # when they come due in different ticks (ops posted a preemption apart).
        seen = {op[0] for token, op in ops if token in self._reported}
        fresh = []
        for token, op in due:
            if why[token] is None:
                continue  # a quiet op, and its connection still looks alive
            self._reported.add(token)
            if op[0] not in seen:
                seen.add(op[0])
                fresh.append((op, now - op[2], why[token]))
        for op, pending_s, kernel in fresh:
            self.reported += 1
            events.emit(
                "link.degraded",
                links=[op[0]],
                reason=f"{op[_OWNER]!r}: an op has been pending for {pending_s * 1e3:.0f} ms"
                + (f" ({kernel})" if kernel else ""),
                action="waiting (the op fails at its deadline if it never completes)",
            )
            logger.warning("%r: op pending for %.0f ms (stalled?)", op[_OWNER], pending_s * 1e3)
        cut = self._cut_dead(overdue)
        self._cut_tokens |= {token for token, op in late if id(op[_OWNER]) in cut}
        if not self._check_failed:
            self.check_failures.succeeded()

    def _suspect(self, op: _Op) -> str | None:
        """What the kernel sees wrong with a quiet op's connection, or None."""
        check = getattr(op[_OWNER], "network_stall", None)
        if check is None:
            return None
        try:
            reason: str | None = check(int(STALL_S * 1000))
        except Exception as exc:  # a check must never stop the watchdog
            self._check_failed = True
            self.check_failures.failed(exc, about=op[_OWNER])
            return None
        return reason

    def _cut_dead(self, overdue: list[_Op]) -> set[int]:
        """Cut the links of overdue ops whose connection the kernel sees dead;
        returns the ids of the owners cut."""
        done: set[int] = set()
        for op in overdue:
            owner = op[_OWNER]
            check = getattr(owner, "network_stall", None)
            if check is None or id(owner) in done:
                continue
            try:
                reason = check()
            except Exception as exc:  # a check must never stop the watchdog
                self._check_failed = True
                self.check_failures.failed(exc, about=owner)
                continue
            if reason is None:
                continue
            done.add(id(owner))
            self.cut += 1
            try:
                owner.abort(f"network stalled: {reason}")  # type: ignore[attr-defined]
            except Exception:
                logger.exception("cutting stalled %r failed", owner)
        return done


WATCH = StallWatch()  # the process's watchdog


def watch() -> StallWatch:
    """The process's watchdog."""
    return WATCH
