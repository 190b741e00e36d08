"""Seeing a peer's connections close while this rank waits on someone else.

When a rank dies in the middle of a ring, its neighbours may be waiting on an op
with another, live, rank (a send that cannot drain, a receive its sender never
posts because it is blocked too). gloo fails the ops of the dead rank's pair at
once, but nobody waits on them, and every rank stays blocked until an op
deadline (measured: 10 s, 100 MB DDP buckets on a 4-rank ring). The kernel knows
at once: the dead rank's sockets were closed (FIN) or reset (RST). So while calls
are in flight, a thread reads the TCP state of every link every
:data:`INTERVAL_S`, marks links whose peer closed them broken, and lets the group
decide whether the peer is lost (:mod:`resilient.detect.lost_peer`).

The same scan cuts a link whose connection the kernel sees dead (data
unacknowledged, retransmission timeouts, no ACK for a second:
``Link.network_stall``) while no op waits on it; a link an op waits on is the
stall watch's (:mod:`resilient.links.stall`). A partition can leave the dead end
idle: a send completes once its bytes are in the socket, so the sender moves on
to wait elsewhere, while the receiver, whose own socket holds nothing
unacknowledged, cannot tell a partition from a late peer. With the stall watch
alone, the whole job then waited the partition out (docs/ARCHITECTURE.md has the
runs).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from typing import Final

from resilient.failures import FailureSite
from resilient.links import stall
from resilient.links.table import LinkTable

__all__ = ["INTERVAL_S", "PeerWatch"]

logger = logging.getLogger(__name__)

INTERVAL_S: Final = 0.05


class PeerWatch:
    """Calls ``on_closed()`` after it marked links closed by their peer broken."""

    def __init__(
        self,
        rank: int,
        tables: Callable[[], list[LinkTable]],
        busy: Callable[[], bool],
        on_closed: Callable[[], object],
    ) -> None:
        self.rank = rank
        self._tables, self._busy, self._on_closed = tables, busy, on_closed
        self._halt = threading.Event()
        self._seen: set[int] = set()  # links already found closed (by id)
        self.cut = 0  # links cut as dead with no op waiting on them (for tests, events)
        self._thread = threading.Thread(target=self._run, name=f"peer-watch-{rank}", daemon=True)
        # A scan that keeps failing is told at a bounded rate, not with a traceback
        # every INTERVAL_S (resilient.failures).
        self.failures = FailureSite(
            "peer watch", rank=rank, action=f"scanning again every {INTERVAL_S} s", log=logger
        )

    def start(self) -> PeerWatch:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._halt.set()
        if self._thread.is_alive() and self._thread is not threading.current_thread():
            self._thread.join(2.0)

    def _run(self) -> None:
        # Only while calls are in flight: a peer closing its links at the end of a
        # job, after the last call, is not a loss.
        while not self._halt.wait(INTERVAL_S):
            try:
                if self._busy() and self.scan():
                    self._on_closed()
            except Exception as exc:  # a watch must never die; the op deadlines still hold
                self.failures.failed(exc)
                continue
            self.failures.succeeded()

    def scan(self) -> bool:
        """Mark links closed by their peer broken and cut links the kernel sees
        dead; True if a link closed by its peer (here, or by an op that failed on
        it) is new since the last scan."""
        found, stalls = False, stall.watch()
        for table in self._tables():
            for link in list(table.links().values()):
                if not link.check_closed() and not link.broken and not stalls.waiting_on(link):
                    dead = link.network_stall()
                    if dead is not None:
                        link.abort(f"network stalled with no op waiting on it: {dead}")
                        self.cut += 1
                closed = (link.broken and link.peer_closed) or link.socket_gone
                if closed and id(link) not in self._seen:
                    self._seen.add(id(link))
                    found = True
        return found
