"""Local link repair: rebuild only the broken link, in the background, and put it back.

A broken link (its NIC went down, its connection was cut) stays out of service
while its collectives run on other rails (:mod:`resilient.collectives.failover`). Once the
NICs at both ends are up again and the peer, too, reports the link broken (so it
is alive; see :class:`~resilient.detect.health_board.HealthBoard`), a repair thread per rank
rebuilds that one link, and no other:

1. **Agree on a generation.** The lower rank of the pair leads: it writes the next
   generation under ``repair/<table>/e<epoch>/<device>/<lo>-<hi>/r<rail>/go``; the
   other end joins when it sees a generation newer than its own. The generation is
   part of the link's rendezvous prefix, so a rebuilt link never meets stale keys.
2. **Build** the two-rank group (a rendezvous bounded by ``timeout_s``).
3. **Probe** it: a one-element all_reduce within ``timeout_s`` must give 2.
4. **Both ends confirm** (``.../g<gen>/ok<rank>``) before either puts it in service,
   so a link is never in service at one end only.
5. **Stage** it in the table and log ``link.repaired``. With the signature exchange
   on, both ends list it in their exchange rows and put it in service on the call
   whose table shows it staged at both ends (control links right after that
   exchange, data links at the start of that call), so no call ever runs on the new
   link at one end and on the old one at the other; without the exchange it goes
   into service at once. Then the health record is published: the rail's ranks
   propose it up again and, once every rank does, it gets its share back.

A failed attempt (peer gone again, probe failed) is retried at the next generation
after an exponential backoff (tenacity's ``wait_exponential``: ``backoff_s``
doubling up to ``max_backoff_s``), counted per link.
Both ends handle their broken links in one global order (lowest pair, then rail),
as link builds do, so two repair threads never wait on each other in a cycle.
"""

from __future__ import annotations

import logging
import threading
import time
from datetime import timedelta
from types import SimpleNamespace
from typing import Any, Final, cast

import torch
from tenacity import RetryCallState, wait_exponential

from resilient import events
from resilient.errors import LinkError
from resilient.failures import FailureSite
from resilient.links.table import Link, LinkTable

__all__ = [
    "CTL_TABLE",
    "DATA_TABLE",
    "LinkRepair",
    "agreed_installs",
    "install_agreed",
    "join_stranded",
    "staged_rows",
    "strand",
]

logger = logging.getLogger(__name__)

_POLL_S: Final = 0.002
# Table codes in the exchange rows' staged entries.
DATA_TABLE: Final = 0
CTL_TABLE: Final = 1

# Threads that may sit in gloo's constructor when the group shuts down: repair
# threads an epoch change left running (``stop(wait=False)``), and links built
# ahead (StateTransfer.prebuild_links). The group's shutdown joins them: a daemon
# thread that comes back from gloo's constructor after the interpreter began
# finalising aborts the process ("terminate called without an active exception",
# seen after a flapping NIC's job had finished).
_STRANDED: list[threading.Thread] = []
_STRANDED_LOCK = threading.Lock()


def strand(thread: threading.Thread) -> None:
    """Have the group's shutdown join ``thread`` (see join_stranded)."""
    with _STRANDED_LOCK:
        _STRANDED.append(thread)


def join_stranded(timeout_s: float) -> int:
    """Wait up to ``timeout_s`` in all for the threads given to :func:`strand`;
    returns how many are still running after that."""
    end = time.monotonic() + timeout_s
    with _STRANDED_LOCK:
        threads = list(_STRANDED)
    for thread in threads:
        thread.join(max(0.0, end - time.monotonic()))
    with _STRANDED_LOCK:
        _STRANDED[:] = [t for t in _STRANDED if t.is_alive()]
        return len(_STRANDED)


def staged_rows(tables: dict[int, LinkTable]) -> list[tuple[int, int, int, int]]:
    """This rank's staged links as exchange entries ``(code, peer, rail, generation)``."""
    return [(code, *entry) for code, table in tables.items() for entry in table.staged()]


def agreed_installs(
    staged: list[list[tuple[int, int, int, int]]], rank: int, code: int
) -> list[tuple[int, int, int]]:
    """``(peer, rail, generation)`` of table ``code``'s links staged at both ends in
    one exchange table: every rank computes the same, so both ends switch together."""
    if rank >= len(staged):
        return []
    out = []
    for c, peer, rail, gen in staged[rank]:
        if c == code and 0 <= peer < len(staged) and (c, rank, rail, gen) in staged[peer]:
            out.append((peer, rail, gen))
    return out


def install_agreed(
    table: LinkTable, staged: list[list[tuple[int, int, int, int]]], rank: int, code: int
) -> bool:
    """Put ``table``'s links staged at both ends (per ``staged``) in service; True if
    any went in (the caller then republishes the health record)."""
    done = [table.promote(p, r, g) for p, r, g in agreed_installs(staged, rank, code)]
    return any(done)


class LinkRepair:
    """The repair thread of one rank; see the module docstring."""

    def __init__(
        self,
        *,
        rank: int,
        board: Any,  # HealthBoard: nic_up_both, peer_sees_broken, publish
        epoch: int = 0,
        interval_s: float = 0.05,
        timeout_s: float = 5.0,
        backoff_s: float = 0.1,
        max_backoff_s: float = 5.0,
    ) -> None:
        self.rank, self.epoch, self.board = rank, epoch, board
        self.interval_s, self.timeout_s = interval_s, timeout_s
        self._backoff = wait_exponential(multiplier=backoff_s, max=max_backoff_s)
        self._round_backoff_max_s = max(interval_s, max_backoff_s)
        # A round that fails as a whole (the store unreachable, say) used to be
        # retried every interval_s with a traceback each time: now counted, and
        # retried after a backoff up to max_backoff_s (resilient.failures).
        self._round_failures = FailureSite(
            "link repair round", rank=rank, epoch=epoch,
            action=f"retrying after {interval_s}-{max_backoff_s} s (doubling)", log=logger,
        )  # fmt: skip
        self.tables: list[LinkTable] = []
        self.repaired: list[tuple[str, int, int, int]] = []  # (table, peer, rail, gen)
        self._failures: dict[tuple[str, int, int], int] = {}
        self._next_try: dict[tuple[str, int, int], float] = {}
        self._halt = threading.Event()
        self._thread: threading.Thread | None = None

    def attach(self, table: LinkTable) -> None:
        self.tables.append(table)

    def start(self) -> LinkRepair:
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="link-repair", daemon=True)
            self._thread.start()
        return self

    def stop(self, *, wait: bool = True) -> None:
        """Stop repairing. ``wait=False`` (leaving an epoch) does not wait for an
        attempt under way: its rendezvous may wait out ``timeout_s`` on a peer that
        is gone, and the recovery must not (seen: a flapping NIC's repair toward the
        killed rank held the epoch change for 16 s). Such an attempt ends on its
        own and puts nothing in service (see _attempt); its thread is kept for
        :func:`join_stranded`, as is one that outlived a waited stop."""
        self._halt.set()
        if self._thread is not None and wait:
            self._thread.join(self.timeout_s * 3 + 1.0)
        if self._thread is not None and self._thread.is_alive():
            strand(self._thread)

    def _run(self) -> None:
        delay = self.interval_s
        while not self._halt.wait(delay):
            try:
                self._round()
            except Exception as exc:  # never let the thread die: a later round retries
                if self._halt.is_set():
                    break  # failed because the repair stopped: no news
                self._round_failures.failed(exc)
                delay = self._round_failures.backoff_s(self.interval_s, self._round_backoff_max_s)
                continue
            self._round_failures.succeeded()
            delay = self.interval_s

    def _round(self) -> None:
        # Nothing is repaired while a lost peer's epoch is given up: the links the
        # next epoch needs are built there, and a rendezvous here would hold up
        # the recovery (measured: quiesce waited 5 s, one repair_timeout_s).
        todo = [
            (table, link)
            for table in list(self.tables)
            if not table.closed and table.abandoned is None
            for link in table.broken()
        ]
        todo.sort(key=lambda tl: (min(self.rank, tl[1].peer), max(self.rank, tl[1].peer),
                                  tl[1].rail, tl[0].name))  # fmt: skip
        for table, link in todo:
            if self._halt.is_set() or table.closed or table.abandoned is not None:
                return
            ident = (table.name, link.peer, link.rail)
            if time.monotonic() < self._next_try.get(ident, 0.0):
                continue
            # The peer must report this link broken too: then it is alive, and its
            # end is out of service as well (a dead peer never says so).
            if self.board.nic_up_both(link.peer, link.rail) and self.board.peer_sees_broken(
                link.peer, link.rail
            ):
                self._attempt(table, link, ident)

    def _key(self, table: LinkTable, link: Link) -> str:
        lo, hi = min(self.rank, link.peer), max(self.rank, link.peer)
        return f"repair/{table.name}/e{table.epoch}/{table.device_type}/{lo}-{hi}/r{link.rail}"

    def _generation(self, table: LinkTable, link: Link) -> int | None:
        """The generation to build now, or None (the leader has not asked yet)."""
        key = self._key(table, link) + "/go"
        mine = table.generation(link.peer, link.rail)
        if self.rank < link.peer:
            table.store.set(key, str(mine + 1))
            return mine + 1
        if not table.store.check([key]):
            return None
        theirs = int(bytes(table.store.get(key)).decode())
        return theirs if theirs > mine else None

    def _attempt(self, table: LinkTable, link: Link, ident: tuple[str, int, int]) -> None:
        gen = self._generation(table, link)
        if gen is None:
            return
        start, epoch = time.monotonic(), table.epoch
        new: Link | None = None
        try:
            new = table.rebuild(link.peer, link.rail, gen, self.timeout_s)
            self._probe(new)
            self._confirm(table, new, gen)
        except (LinkError, RuntimeError) as exc:
            self._failed(ident, link, gen, exc)
            if new is not None:
                new.close(background=True)
            return
        if self._halt.is_set() or not table.stage(new, gen, epoch):  # stopped meanwhile
            new.close(background=True)
            return
        ms = (time.monotonic() - start) * 1e3
        self._failures.pop(ident, None)
        self.repaired.append((table.name, link.peer, link.rail, gen))
        events.emit(
            "link.repaired",
            epoch=self.epoch,
            links=[(self.rank, link.peer, link.rail)],
            duration_ms=ms,
            reason=f"{link!r} was broken; the NICs at both ends are up",
            action=(
                f"rebuilt it alone at generation {gen}, probed; in service from the "
                "next call every rank agrees on"
            ),
            links_rebuilt=1,
            table=table.name,
            generation=gen,
        )
        logger.warning(
            "rank %d (epoch %d): %s %r repaired at generation %d in %.0f ms",
            self.rank, self.epoch, table.name, new, gen, ms,
        )  # fmt: skip
        self.board.publish()

    def _probe(self, link: Link) -> None:
        t = torch.ones(1)
        try:
            link.pg.allreduce([t]).wait(timedelta(seconds=self.timeout_s))
        except RuntimeError as exc:
            raise LinkError(f"{link!r}: probe failed: {exc}") from exc
        if float(t.item()) != 2.0:
            raise LinkError(f"{link!r}: probe returned {t.item()} instead of 2")

    def _confirm(self, table: LinkTable, link: Link, gen: int) -> None:
        """Both ends probed it: only then does either put it in service."""
        base = f"{self._key(table, link)}/g{gen}"
        table.store.set(f"{base}/ok{self.rank}", "1")
        theirs = f"{base}/ok{link.peer}"
        end = time.monotonic() + self.timeout_s
        while not table.store.check([theirs]):
            if time.monotonic() > end or self._halt.is_set():
                raise LinkError(f"{link!r}: rank {link.peer} did not confirm generation {gen}")
            time.sleep(_POLL_S)

    def _failed(self, ident: tuple[str, int, int], link: Link, gen: int, exc: Exception) -> None:
        n = self._failures.get(ident, 0) + 1
        self._failures[ident] = n
        # tenacity's schedule, kept per link rather than in a blocking retry loop:
        # one link's backoff must not hold up the repair of the others.
        attempt = cast(RetryCallState, SimpleNamespace(attempt_number=n))
        delay = float(self._backoff(attempt))
        self._next_try[ident] = time.monotonic() + delay
        logger.warning(
            "rank %d (epoch %d): repairing %r at generation %d failed (attempt %d, next in "
            "%.1f s): %s", self.rank, self.epoch, link, gen, n, delay, exc,
        )  # fmt: skip
