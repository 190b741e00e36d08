"""The store handshakes of a link build: each end says something under the link's
rendezvous prefix and reads what the peer said (:class:`Handshake`, one per
:class:`~resilient.links.table.LinkTable`).

Every wait polls (the store client is shared with the health board, so never a
blocking get) and ends as soon as nobody wants the link any more: the table
closed, its epoch's calls were given up, or it left the epoch the key belongs to;
or as soon as the peer can no longer come (it shut its group down), which the
table's ``peer_gone`` says (reading the store at its own pace).
"""

from __future__ import annotations

import time
from typing import Protocol

from torch._C._distributed_c10d import Store
from torch.distributed import DistError

from resilient.config import DataPlaneConfig
from resilient.errors import LinkError

__all__ = ["Handshake"]


class _Table(Protocol):
    """What a handshake reads of its table (a LinkTable)."""

    name: str
    rank: int
    epoch: int
    store: Store
    config: DataPlaneConfig
    closed: bool
    abandoned: str | None

    def peer_gone(self, peer: int) -> str | None: ...


class Handshake:
    """The handshakes of ``table``'s builds."""

    def __init__(self, table: _Table) -> None:
        self._t = table

    def meet(
        self, prefix: str, peer: int, rail: int, why: str | None = None,
        timeout_s: float | None = None,
    ) -> str:  # fmt: skip
        """Say whether this end builds the link under ``prefix`` (``build<rank>``:
        empty, or ``why`` not); what the peer said once it did (empty: it builds).

        Raises:
            LinkError: the store failed, or the peer did not say within ``timeout_s``
                (default ``connect_timeout_s``).
        """
        return self.tell(f"{prefix}build", "" if why is None else why, peer, rail, timeout_s)

    def tell(
        self, key: str, value: str, peer: int, rail: int, timeout_s: float | None = None
    ) -> str:
        """Write ``value`` under ``key<rank>`` and return what the peer wrote under
        ``key<peer>`` once it did.

        Raises:
            LinkError: the store failed, or the peer did not write within
                ``timeout_s`` (default ``connect_timeout_s``).
        """
        t = self._t
        try:
            t.store.set(f"{key}{t.rank}", value)
            return self.poll(f"{key}{peer}", peer, rail, timeout_s)
        except (RuntimeError, DistError) as exc:
            raise LinkError(f"rank {t.rank}: link to rank {peer} rail {rail}: {exc}") from exc

    def agree_built(self, prefix: str, peer: int, rail: int, ok: bool) -> str | None:
        """Tell the peer whether this end's rendezvous succeeded; why the link is not
        usable (ours or the peer's failed), or None."""
        t = self._t
        try:
            t.store.set(f"{prefix}built{t.rank}", "1" if ok else "0")
            theirs = self.poll(f"{prefix}built{peer}", peer, rail)
        except (RuntimeError, DistError, LinkError) as exc:
            return f"its rendezvous could not be confirmed: {exc}"
        if not ok:
            return "its rendezvous failed here"
        return None if theirs == "1" else f"its rendezvous failed at rank {peer}"

    def poll(self, key: str, peer: int, rail: int, timeout_s: float | None = None) -> str:
        """The value of ``key`` once the peer wrote it.

        Raises:
            LinkError: not within ``timeout_s`` (default ``connect_timeout_s``), or
                the table closed, its epoch was given up or it left the key's epoch
                (a build begun before an epoch change must not hold up the next
                epoch's builds, which wait for their turn behind it), or the peer
                shut its group down.
        """
        t = self._t
        timeout_s = t.config.connect_timeout_s if timeout_s is None else timeout_s
        end = time.monotonic() + timeout_s
        nap = 0.0005
        while not t.store.check([key]):
            if t.closed or t.abandoned is not None or not key.startswith(f"{t.name}/e{t.epoch}/"):
                raise LinkError(f"rank {t.rank}: link to rank {peer} on rail {rail} given up")
            if (why := t.peer_gone(peer)) is not None:
                raise LinkError(f"rank {t.rank}: link to rank {peer} on rail {rail}: {why}")
            if time.monotonic() > end:
                raise LinkError(
                    f"rank {t.rank}: rank {peer} did not come to build the link on rail "
                    f"{rail} within {timeout_s:.1f} s"
                )
            time.sleep(nap)
            nap = min(nap * 2, 0.02)
        return bytes(t.store.get(key)).decode()
