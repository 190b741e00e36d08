"""What the failover channels of one collective share: its links, number and store.

The engine makes a :class:`Route` for every call and hands it to each of the call's
failover channels (:mod:`resilient.collectives.failover`). It names the call's
failover records in the store, picks a channel's backup rail (or the store itself,
see :mod:`resilient.collectives.relay`), and says when the call may no longer fail
over.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Final

from torch._C._distributed_c10d import Store

from resilient.collectives.relay import RELAY_RAIL, StoreLink
from resilient.errors import LinkError
from resilient.links.table import Link, LinkTable

__all__ = ["Route"]

_POLL_S: Final = 0.001


@dataclass(slots=True)
class Route:
    """What the channels of one collective share: its links, number and store."""

    links: LinkTable
    seq: int
    timeout_s: float
    board: Any = None  # HealthBoard | None; typed loosely to keep this module leaf-level
    # Rails every rank agreed are in service in this call (None: all), whatever
    # their share: a repaired link is chosen as a backup only once it is agreed,
    # i.e. in service at both ends, and a healthy rail with no share still beats
    # the store (seen: a rail the weights had left out sent a failover through the
    # store, +323 ms on benchmarks/failover.py).
    allowed: frozenset[int] | None = None
    # Failovers done, as (peer, from_rail, to_rail, resumed_at): the engine's record.
    log: list[tuple[int, int, int, int]] = field(default_factory=list)
    # May a pair with no rail left go through the store (resilient.collectives.relay)?
    relay: bool = False
    # The epoch the call started in (-1: whatever the table's is). A rail thread
    # of a call given up may outlive its epoch; it must not fail over into the
    # next one (a rendezvous there nobody answers holds the table for its timeout).
    epoch: int = -1
    # Calls checked by digest (resilient.collectives.digest_check): what every message's tag carries
    # from CALL_SHIFT on, and the digest it is sent with and received against.
    base: int = 0
    digest: int = 0
    # What this rank's messages carry: ``digest``, with the NEWS flag if it has news.
    sent_digest: int = 0

    @property
    def store(self) -> Store:
        return self.links.store

    def check_epoch(self) -> None:
        """Raises LinkError once the call's epoch is over: a rail thread of a call
        given up must not post on a link the next epoch kept (same tags)."""
        if self.epoch >= 0 and self.links.epoch != self.epoch:
            raise LinkError(
                f"rank {self.links.rank}: the call belongs to epoch {self.epoch}, "
                f"the group is at {self.links.epoch}"
            )

    def given_up(self) -> str | None:
        """Why this call may not fail over (a peer was lost, or its epoch is over)."""
        if self.links.abandoned is not None:
            return self.links.abandoned
        if self.epoch >= 0 and self.links.epoch != self.epoch:
            return f"the call belongs to epoch {self.epoch}, the group is at {self.links.epoch}"
        return None

    def key(self, src: int, dst: int, rail: int, gen: int) -> str:
        t = self.links
        return f"fo/{t.name}/e{t.epoch}/{t.device_type}/{self.seq}/{src}-{dst}/r{rail}/g{gen}"

    def backup(self, peer: int, tried: set[int]) -> int:
        """The first rail, in index order, not tried yet and not known dead.

        Raises:
            LinkError: no rail is left, or the call is given up (a peer was lost).
        """
        if (why := self.given_up()) is not None:
            raise LinkError(f"rank {self.links.rank}: no failover: {why}")
        for rail in range(len(self.links.rails)):
            if rail in tried or (self.allowed is not None and rail not in self.allowed):
                continue
            if self.board is None or self.board.usable(peer, rail, self.links):
                return rail
        raise LinkError(
            f"rank {self.links.rank}: no healthy rail left to rank {peer} (tried {sorted(tried)})"
        )

    def can_relay(self, failed: Link | StoreLink) -> bool:
        """Through the store only if we cut ``failed`` ourselves: then the peer is
        alive (a peer that closed the connection may be dead)."""
        cut = getattr(failed, "cut_reason", None) is not None
        return self.relay and cut and self.given_up() is None

    def link(
        self, peer: int, rail: int, orig_rail: int, gen: int, *, sender: bool
    ) -> Link | StoreLink:
        """The link a channel resumes on: ``rail``'s, or the store's."""
        if rail == RELAY_RAIL:
            return StoreLink(self, peer, orig_rail, gen, sender=sender)
        if (why := self.given_up()) is not None:
            raise LinkError(f"rank {self.links.rank}: no failover: {why}")
        return self.links.get(peer, rail)

    def read(self, key: str) -> str:
        """Poll ``key`` (never a blocking get: the store client is shared).

        Raises:
            LinkError: it did not appear within ``timeout_s`` (the peer is gone).
        """
        end = time.monotonic() + self.timeout_s
        while True:
            if self.links.closed or self.given_up() is not None:
                raise LinkError(f"rank {self.links.rank}: links closed while waiting for {key}")
            if self.store.check([key]):
                return bytes(self.store.get(key)).decode()
            if time.monotonic() > end:
                raise LinkError(f"no failover record {key} after {self.timeout_s:.1f} s")
            time.sleep(_POLL_S)
