"""Whose turn it is to build a link: one table's builds in one global order,
whichever thread asks for them.

A link is built by a rendezvous through the store: both ends must come to the same
link, and the first one there waits for the other (up to ``connect_timeout_s``).
Every rank builds in one global order (lowest rank pair first, then rail:
:meth:`resilient.links.table.LinkTable.ensure`), which is what keeps those waits
from forming a cycle around the ranks, but only if all of a rank's builds follow
that order, from every thread. Two threads asking for different sets used to take
turns by the table's lock, which a build held for as long as it waited: after a
replacement was admitted with every link to be rebuilt, the background build of
every link (``StateTransfer.prebuild_links``) and the replayed step's two-rail ring,
which asks for its two neighbours only, put some ranks at a later link of one set
while their peers waited for them at an earlier link of the other. Every rank then
waited for the next one until the rendezvous timeout (60 s), and every thread that
read the table meanwhile (a link's break publishing the health record) stopped
with it (soak 600 s, seed 1).

Here each thread first says which links it wants (:meth:`BuildTurns.want`: all of
them at once, before it builds any), and a build goes ahead only when its link is
the lowest one wanted and not built yet. Peers that want the same links therefore
meet in the same order, whatever thread of theirs builds. An epoch change
(:meth:`BuildTurns.reset`) voids every want of the epoch before.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Final

from resilient.errors import LinkError

__all__ = ["BuildTurns", "Key", "Wanted"]

Key = tuple[int, int]  # (peer, rail)
_RECHECK_S: Final = 0.5  # a waiting thread looks again this often, whatever woke it


@dataclass(frozen=True, slots=True)
class Wanted:
    """Links a thread said it will build (in build order), and in which era."""

    keys: tuple[Key, ...]
    era: int


class BuildTurns:
    """The turns of one table's builds; ``order`` sorts keys into the global order."""

    def __init__(self, order: Callable[[Key], tuple[int, int, int]]) -> None:
        self._order = order
        self._cond = threading.Condition()
        self._wanted: dict[Key, int] = {}  # key -> how many threads want it
        self._building: Key | None = None
        self.era = 0

    def want(self, keys: Iterable[Key]) -> Wanted:
        """Say that this thread will build ``keys``; every build of the table from
        now on waits until the lower ones of them are built."""
        ordered = tuple(sorted(set(keys), key=self._order))
        with self._cond:
            for key in ordered:
                self._wanted[key] = self._wanted.get(key, 0) + 1
            return Wanted(ordered, self.era)

    def drop(self, wanted: Wanted) -> None:
        """No longer want ``wanted`` (built, failed or given up)."""
        with self._cond:
            if wanted.era == self.era:
                for key in wanted.keys:
                    n = self._wanted.get(key, 0) - 1
                    if n > 0:
                        self._wanted[key] = n
                    else:
                        self._wanted.pop(key, None)
            self._cond.notify_all()

    def take(self, key: Key, era: int, built: Callable[[Key], bool]) -> bool:
        """Wait for ``key``'s turn: True when this thread is to build it now (then
        call :meth:`done`), False when it was built meanwhile.

        Raises:
            LinkError: the table left era ``era`` (an epoch change, or closed).
        """
        with self._cond:
            while True:
                if era != self.era:
                    raise LinkError(f"the build of the link to {key} belongs to an ended epoch")
                if built(key):
                    return False
                if self._building is None:
                    todo = [k for k in self._wanted if not built(k)]
                    if not todo or self._order(key) <= self._order(min(todo, key=self._order)):
                        self._building = key
                        return True
                self._cond.wait(_RECHECK_S)

    def await_building(
        self, keys: Iterable[Key], built: Callable[[Key], bool], timeout_s: float
    ) -> None:
        """Wait up to ``timeout_s`` while one of ``keys`` not built yet is the one
        being built now. A rank asking whether its links are built must answer as
        its peers do (an elided call: a rank that said no refused the call without
        telling a peer it has no link to, which waited on it to its deadline); but
        a link a background build (prebuild_links) finished at the peer may still
        be in the last step of the same rendezvous here. A build not begun here has
        not ended at the peer either (both ends meet), so only one under way is
        waited for."""
        wanted = set(keys)
        deadline = time.monotonic() + timeout_s
        with self._cond:
            while True:
                key = self._building
                left = deadline - time.monotonic()
                if key is None or key not in wanted or built(key) or left <= 0:
                    return
                self._cond.wait(min(left, _RECHECK_S))

    def done(self) -> None:
        """The build :meth:`take` allowed is over (built, refused or failed)."""
        with self._cond:
            self._building = None
            self._cond.notify_all()

    def reset(self) -> None:
        """A new epoch (or the table closed): every want so far is void, and threads
        waiting for a turn raise."""
        with self._cond:
            self.era += 1
            self._wanted = {}
            self._cond.notify_all()
