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
from dataclasses import dataclass
from typing import Final

from recovery import events

__all__ = ["STALL_S", "StallWatch", "watch"]

logger = logging.getLogger(__name__)

STALL_S: Final = 0.5
_TICK_S: Final = 0.05


@dataclass(slots=True)
class _Op:
    link: tuple[int, int, int]
    owner: object  # the Link, for its name (formatted only when reported)
    start: float
    limit_s: float
    reported: bool = False
    quiet: bool = False
    cut: bool = False


class StallWatch:
    """Pending link ops; see the module docstring."""

    def __init__(self) -> None:
        self._ops: dict[int, _Op] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self.reported = 0
        self.cut = 0

    def begin(
        self, link: tuple[int, int, int], owner: object, expected_s: float, *, report: bool = True
    ) -> int:
        """Register an op about to be waited on; returns the token for :meth:`end`.

        ``report=False``: never logged as stalled, only checked for a dead connection.
        """
        token = next(self._ids)
        op = _Op(link, owner, time.monotonic(), STALL_S + expected_s, quiet=not report)
        with self._lock:
            self._ops[token] = op
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="stall-watch", daemon=True)
                self._thread.start()
        return token

    def end(self, token: int) -> None:
        with self._lock:
            self._ops.pop(token, None)

    def waiting_on(self, owner: object) -> bool:
        """Whether an op on ``owner`` (a Link) is being waited for: this watch then
        judges its connection (resilient._peerwatch judges the idle ones)."""
        with self._lock:
            return any(op.owner is owner for op in self._ops.values())

    def _run(self) -> None:
        while True:
            time.sleep(_TICK_S)
            now = time.monotonic()
            with self._lock:
                overdue = [
                    op for op in self._ops.values() if not op.cut and now - op.start > op.limit_s
                ]
                due = [
                    op
                    for op in self._ops.values()
                    if not op.reported and now - op.start > op.limit_s
                ]
            why = {id(op): self._suspect(op) if op.quiet else "" for op in due}
            with self._lock:
                # One report per link and stall, however many of its ops are pending.
                seen: set[tuple[int, int, int]] = set()
                fresh = []
                for op in due:
                    if why[id(op)] is None:
                        continue  # a quiet op, and its connection still looks alive
                    op.reported = True
                    if op.link not in seen:
                        seen.add(op.link)
                        fresh.append((op, now - op.start, why[id(op)]))
            for op, pending_s, kernel in fresh:
                self.reported += 1
                events.emit(
                    "link.degraded",
                    links=[op.link],
                    reason=f"{op.owner!r}: an op has been pending for {pending_s * 1e3:.0f} ms"
                    + (f" ({kernel})" if kernel else ""),
                    action="waiting (the op fails at its deadline if it never completes)",
                )
                logger.warning("%r: op pending for %.0f ms (stalled?)", op.owner, pending_s * 1e3)
            self._cut_dead(overdue)

    @staticmethod
    def _suspect(op: _Op) -> str | None:
        """What the kernel sees wrong with a quiet op's connection, or None."""
        check = getattr(op.owner, "network_stall", None)
        if check is None:
            return None
        try:
            reason: str | None = check(int(STALL_S * 1000))
        except Exception:  # a check must never stop the watchdog
            logger.debug("stall check of %r failed", op.owner, exc_info=True)
            return None
        return reason

    def _cut_dead(self, overdue: list[_Op]) -> None:
        """Cut the links of overdue ops whose connection the kernel sees dead."""
        done: set[int] = set()
        for op in overdue:
            check = getattr(op.owner, "network_stall", None)
            if check is None or id(op.owner) in done:
                continue
            try:
                reason = check()
            except Exception:  # a check must never stop the watchdog
                logger.debug("stall check of %r failed", op.owner, exc_info=True)
                continue
            if reason is None:
                continue
            done.add(id(op.owner))
            op.cut = True
            self.cut += 1
            try:
                op.owner.abort(f"network stalled: {reason}")  # type: ignore[attr-defined]
            except Exception:
                logger.exception("cutting stalled %r failed", op.owner)


_WATCH = StallWatch()


def watch() -> StallWatch:
    """The process's watchdog."""
    return _WATCH
