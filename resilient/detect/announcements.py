"""Hearing from the launcher that a rank's process died, before any link shows it.

A rank killed while its peers compute (a forward pass, the first layers of a
backward pass) is seen by them only when they next use a link to it: measured on
the 100 MB warm-spare benchmark, 66-330 ms after the launcher saw the exit. The
launcher, its parent, sees the exit within one poll and writes the replacement it
starts (or "none") under ``replacement/<rank>`` in etcd (resilient.launch.leases).
Every rank watches that prefix; an announcement makes it look at the named rank's
links at once (``PeerLoss.probe``, resilient.group.peer_loss), and if every one of them is closed
at the peer's end or its socket is gone (gloo closes an idle socket whose peer
closed it), the rank is declared lost: its peers then leave the step within
milliseconds. A socket gone alone is no proof of a loss (resilient.detect.lost_peer); with
the launcher's word that the process exited, it is.

The announcement is only a doorbell, never the verdict: a late or stale record
(the rank was already replaced and its new incarnation is alive) finds the links
open and changes nothing. Jobs without the launcher (torchrun) have no
announcements and rely on the links alone.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any

__all__ = ["watch_announcements"]

logger = logging.getLogger(__name__)

SUBPREFIX = "replacement/"


def watch_announcements(membership: Any, probe: Callable[[int], object]) -> Any:
    """Call ``probe(rank)`` for every replacement the launcher announces from now
    on; returns the watch (stopped when ``membership`` leaves). None when etcd
    refused the watch (the links still tell, later)."""

    def on_event(ev: Any) -> None:
        if ev.kind != "put" or ev.synthetic:
            return
        try:
            rank = int(ev.key.rsplit("/", 1)[1])
        except ValueError:
            return
        probe(rank)

    try:
        return membership.watch(SUBPREFIX, on_event)
    except Exception as exc:  # only the early warning is lost
        logger.warning("watching the launcher's announcements failed: %s", exc)
        return None
