"""Failures of background loops: counted, logged at a bounded rate, reported once.

Watchers and monitors (the health board's watcher, the stall watchdog, link repair,
etcd watches, health records, NVML readings) retry what failed on their next round.
Left to themselves they did so in silence (a debug line) or with a traceback on
every try (every 50 ms), so an etcd outage or a broken probe was either invisible
or drowned the log. One :class:`FailureSite` per place that can fail instead:

* counts consecutive and total failures;
* logs a WARNING with both counts, the last error and the caller's retry policy,
  at most once per :attr:`FailureConfig.warn_every_s`, across streaks (the others
  go to DEBUG; the traceback rides on a warning of a streak's first failure);
* after :attr:`FailureConfig.event_after` consecutive failures emits one
  ``monitor.failing`` event for the streak (resilient.events); on the next
  success logs "recovered after K failures" (INFO if a warning told of the
  streak, else DEBUG) and, if the streak was reported, emits ``monitor.recovered``.

:meth:`FailureSite.succeeded` is on the loops' happy path: one attribute read and
no system call while nothing is failing.

This module sits in ``membership`` because that is the lowest layer that every user
(membership's own threads, ``resilient.links``, ``resilient.detect``) may import
(docs/ARCHITECTURE.md, "Dependency order"); it needs only ``resilient.events``.
"""

from __future__ import annotations

import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final

from resilient import events
from resilient.errors import ConfigError

__all__ = ["DEFAULT_CONFIG", "FailureConfig", "FailureSite"]

logger = logging.getLogger(__name__)

_MAX_ERROR: Final = 300  # characters of the last error in a message or an event


@dataclass(frozen=True, kw_only=True, slots=True)
class FailureConfig:
    """How a :class:`FailureSite` reports.

    ``warn_every_s``: at most one WARNING per site in this time (0: every failure).
    ``event_after``: consecutive failures after which ``monitor.failing`` is emitted.
    """

    warn_every_s: float = 10.0
    event_after: int = 5

    def __post_init__(self) -> None:
        if not math.isfinite(self.warn_every_s) or self.warn_every_s < 0:
            raise ConfigError(f"FailureConfig.warn_every_s must be >= 0, not {self.warn_every_s}")
        if self.event_after < 1:
            raise ConfigError(f"FailureConfig.event_after must be >= 1, not {self.event_after}")


DEFAULT_CONFIG = FailureConfig()


def _describe(exc: BaseException) -> str:
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    return text[:_MAX_ERROR]


class FailureSite:
    """The failures of one place in one background loop; see the module docstring.

    ``site`` names the place in messages and events (``"health board watch"``);
    ``rank`` (when the caller knows it) prefixes the messages; ``action`` says what
    the loop does about it (``"retrying every 0.2 s"``). ``config`` defaults to
    :data:`DEFAULT_CONFIG` as it is when the site is made. Thread-safe.
    """

    def __init__(
        self,
        site: str,
        *,
        rank: int | None = None,
        epoch: int = 0,
        action: str = "retrying",
        config: FailureConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
        log: logging.Logger | None = None,
    ) -> None:
        self.site, self.rank, self.epoch, self.action = site, rank, epoch, action
        self.config = config if config is not None else DEFAULT_CONFIG
        self._clock = clock
        self._log = log if log is not None else logger
        self.consecutive = 0
        self.total = 0
        self.last_error: BaseException | None = None
        self.reported = False  # monitor.failing emitted for the current streak
        self._warned_at = -math.inf
        self._unlogged = 0  # failures since the last warning, not warned about
        self._streak_warned = False  # a warning told of the current streak
        self._lock = threading.Lock()

    def _who(self) -> str:
        return self.site if self.rank is None else f"rank {self.rank}: {self.site}"

    def failed(self, exc: BaseException, *, about: object = None, epoch: int | None = None) -> int:
        """Count a failure (never raises); returns the consecutive count.

        ``about`` (a link, a key) is named beside the error; ``epoch`` overrides the
        site's in the event.
        """
        error = _describe(exc) if about is None else f"{about!r}: {_describe(exc)}"[:_MAX_ERROR]
        with self._lock:
            self.consecutive += 1
            self.total += 1
            self.last_error = exc
            n, total = self.consecutive, self.total
            now = self._clock()
            warn = now - self._warned_at >= self.config.warn_every_s
            if warn:
                self._warned_at, skipped, self._unlogged = now, self._unlogged, 0
                self._streak_warned = True
            else:
                self._unlogged += 1
            report = n >= self.config.event_after and not self.reported
            if report:
                self.reported = True
        if warn:
            # The traceback once per streak: later ones are the same failure again.
            self._log.warning(
                "%s failed (%d in a row, %d in all, %d not logged since the last warning); "
                "%s: %s", self._who(), n, total, skipped, self.action, error,
                exc_info=exc if n == 1 else None, stacklevel=2,
            )  # fmt: skip
        else:
            self._log.debug(
                "%s failed (%d in a row): %s", self._who(), n, error, exc_info=exc, stacklevel=2
            )
        if report:
            self._emit(
                "monitor.failing",
                epoch,
                reason=f"{self._who()}: {n} failures in a row; last: {error}",
                action=self.action,
                failures=n,
                total=total,
            )
        return n

    def succeeded(self) -> None:
        """End a failing streak, if there is one (hot path: one attribute read)."""
        if self.consecutive:
            self._recovered()

    def _recovered(self) -> None:
        with self._lock:
            n, reported, warned = self.consecutive, self.reported, self._streak_warned
            if not n:
                return  # another thread ended the streak meanwhile
            self.consecutive, self.reported, self._streak_warned = 0, False, False
        # The warning's rate limit spans streaks (a site that fails every other
        # round must not log twice a round), so only a streak a warning told of
        # gets its recovery told at INFO. stacklevel: name the loop's line.
        level = logging.INFO if warned else logging.DEBUG
        self._log.log(level, "%s recovered after %d failures", self._who(), n, stacklevel=3)
        if reported:
            self._emit(
                "monitor.recovered",
                None,
                reason=f"{self._who()}: succeeded after {n} failures in a row",
                action="reported",
                failures=n,
                total=self.total,
            )

    def backoff_s(self, base_s: float, max_s: float) -> float:
        """``base_s`` doubled per consecutive failure after the first, at most ``max_s``
        (``base_s`` while nothing fails)."""
        return min(max_s, base_s * 2.0 ** min(max(self.consecutive - 1, 0), 30))

    def _emit(self, kind: str, epoch: int | None, **fields: object) -> None:
        try:
            events.emit(
                kind, epoch=self.epoch if epoch is None else epoch, site=self.site, **fields
            )
        except Exception:  # reporting must never stop the loop that failed
            self._log.warning("%s: %s event not emitted", self._who(), kind, exc_info=True)
