"""The last resort of a failover: a pair's messages through the store.

When no rail connects a pair any more (its link on every rail broken) but both
ranks are alive and still reach the store (the control plane, normally on its own
network), the failover channels (:mod:`resilient.collectives.failover`) resume on a
:class:`StoreLink` instead of a rail: every message is written to the store in
parts of at most :data:`PART_BYTES` and deleted once read. The store is no data
path, so this is slow, but the collective completes without an error and with
the same bits (the schedule is unchanged; only the transport of one pair is).
Later collectives take the same way until the link is repaired.

It is only taken where the peer is surely alive: the failed link was cut by this
rank because the network stalled, a NIC went down or the peer reported it broken,
never because the peer closed the connection (a crash), so losing a rank still
surfaces at once. Each side marks that it took the relay; a side that sees no
such mark from its peer within :data:`READY_S` gives up with a LinkError.
It needs the channels' acknowledgements, i.e. two rails or more.
"""

from __future__ import annotations

import time
from typing import Any, Final, Protocol

import torch
from torch._C._distributed_c10d import Store

from resilient.errors import LinkError
from resilient.links.byte_views import as_tensor
from resilient.links.table import LinkTable

__all__ = ["PART_BYTES", "READY_S", "RELAY_RAIL", "CallRoute", "StoreLink"]

RELAY_RAIL: Final = -1
PART_BYTES: Final = 512 << 10  # well under etcd's default 1.5 MiB per request
READY_S: Final = 5.0
_BYTES_PER_S: Final = 5e6  # what the deadline allows per byte through the store
_POLL_S: Final = 0.002
_SENT: Final = object()


class CallRoute(Protocol):
    """What a relay needs of its call (:class:`resilient.collectives.route.Route` is one)."""

    @property
    def links(self) -> LinkTable: ...

    @property
    def seq(self) -> int: ...

    @property
    def store(self) -> Store: ...

    @property
    def timeout_s(self) -> float: ...


class StoreLink:
    """A pair's link through the store, for one channel generation (see above)."""

    rail = RELAY_RAIL

    def __init__(
        self, route: CallRoute, peer: int, orig_rail: int, gen: int, *, sender: bool
    ) -> None:
        t = route.links
        self.rank, self.peer = t.rank, peer
        lo, hi = sorted((t.rank, peer))
        self.prefix = (
            f"relay/{t.name}/e{t.epoch}/{t.device_type}/{route.seq}/{lo}-{hi}/r{orig_rail}/g{gen}"
        )
        self.store = route.store
        self.timeout_s = route.timeout_s
        self.broken = False
        self.finished: list[tuple[Any, str]] = []  # read by Rx.finish, as on a Link
        self._counts: dict[tuple[int, int], int] = {}
        self._peer_ready = False
        # A pair's two directions share the prefix, so each mark names its side:
        # our sender's mark is read (and deleted) by the peer's receiver only.
        self._mine = f"{self.prefix}/ready/{self.rank}{'tx' if sender else 'rx'}"
        self._theirs = f"{self.prefix}/ready/{self.peer}{'rx' if sender else 'tx'}"
        self.store.set(self._mine, "1")

    def __repr__(self) -> str:
        return f"StoreLink({self.rank}<->{self.peer}, through the store)"

    def _key(self, src: int, tag: int) -> str:
        n = self._counts.get((src, tag), 0)
        self._counts[(src, tag)] = n + 1
        dst = self.peer if src == self.rank else self.rank
        return f"{self.prefix}/{src}>{dst}/t{tag}/{n}"

    # -- the Link interface the channels use --------------------------------------
    def watch_sender(self, tx: Any) -> bool:
        return not self.broken

    def watch_receiver(self, rx: Any) -> bool:
        return not self.broken

    def unwatch_sender(self, tx: Any) -> None:
        pass

    def unwatch_receiver(self, rx: Any) -> None:
        pass

    def abort(self, reason: str) -> None:
        self.broken = True

    def isend(self, tensor: torch.Tensor | memoryview, tag: int, digest: int = 0) -> Any:
        """Write ``tensor`` to the store now (the sender's thread does the work);
        ``digest`` is not carried: a message relayed through the store is not
        checked (resilient.collectives.digest_check)."""
        key = self._key(self.rank, tag)
        tensor = as_tensor(tensor)
        raw = tensor.detach().contiguous().reshape(-1).cpu().view(torch.uint8).numpy().tobytes()
        parts = [raw[i : i + PART_BYTES] for i in range(0, len(raw), PART_BYTES)] or [b""]
        for i, part in enumerate(parts):
            self.store.set(f"{key}/p{i}", part)  # type: ignore[arg-type]  # bytes work (stub says str)
        self.store.set(f"{key}/n", str(len(parts)))  # last: the reader waits for it
        return _SENT

    def irecv(self, tensor: torch.Tensor | memoryview, tag: int, digest: int = 0) -> Any:
        return (self._key(self.peer, tag), as_tensor(tensor))

    def wait(
        self, work: Any, nbytes: int, *, watch: bool = True, interruptible: bool = False
    ) -> None:
        """Wait for a message; raises LinkError at the deadline, or when the peer did
        not take the relay within READY_S (it is gone or cut off from the store)."""
        if work is _SENT:
            return
        key, into = work
        start = time.monotonic()
        deadline = start + self.timeout_s + nbytes / _BYTES_PER_S
        while not self.store.check([f"{key}/n"]):
            now = time.monotonic()
            if self.broken:
                raise LinkError(f"{self!r} was cut")
            if not self._peer_ready:
                self._peer_ready = self.store.check([self._theirs])
                if self._peer_ready:
                    # Read by this link only; every relayed call writes new marks,
                    # so they must not pile up in the store.
                    self.store.delete_key(self._theirs)
                if not self._peer_ready and now - start > READY_S:
                    self.broken = True
                    raise LinkError(f"{self!r}: rank {self.peer} did not take the relay")
            if now > deadline:
                self.broken = True
                raise LinkError(f"{self!r}: no message {key} within {deadline - start:.1f} s")
            time.sleep(_POLL_S)
        self._read(key, into)

    def _read(self, key: str, into: torch.Tensor) -> None:
        count = int(bytes(self.store.get(f"{key}/n")).decode())
        data = b"".join(bytes(self.store.get(f"{key}/p{i}")) for i in range(count))
        want = into.numel() * into.element_size()
        if len(data) != want:
            raise LinkError(f"{self!r}: message {key} has {len(data)} B, expected {want} B")
        if want:
            got = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(into.dtype)
            into.copy_(got.view(into.shape).to(into.device))
        for i in range(count):
            self.store.delete_key(f"{key}/p{i}")
        self.store.delete_key(f"{key}/n")
