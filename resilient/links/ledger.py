"""The ops of one link that have not finished, so a link can outlive a given-up call.

When a rank is lost, the survivors give up the call they were in. Some of its ops
between two survivors never finish: an acknowledgement the peer was never going
to send, a receive of data the peer stopped producing, a send nobody waited for.
gloo cannot cancel them, and a stale receive left on a link would swallow the
next message with its tag. So every link's tags carry a *salt*, the epoch modulo
:data:`SALTS` (bits 24-27 of the tag): ops of different epochs never match, and an
op of a given-up epoch that nobody waits for is harmless (measured: a pair with
an unmatched receive and an unmatched send pending carried new traffic with other
tags correctly, and left the stale buffer untouched).

What is not harmless is *waiting* for such an op: a gloo wait that reaches its
deadline closes the pair ("Application timeout caused pair closure", measured).
So the ledger knows which unfinished ops a thread is blocked on (those links
must be cut), and once the epoch is given up (:meth:`OpLedger.freeze`) a new wait
for an unfinished op of it fails at once instead of blocking.

Nor is a stale receive whose stale send *does* come: the two match under their
salt, and the message lands in the receive's buffer whenever the pair is next
moved, which on a socket pair is by the next epoch's first wait. Schedules reuse
buffers (scratch, the caller's tensor: DDP's bucket), so it overwrote data the
replayed step was using; seen as a job that finished with every rank equal and
all unlike the fault-free run. A socket link therefore drops its stale receives
and discards their messages when it enters an epoch
(:meth:`resilient.links.socket_pair.SocketPair.forget`). gloo cannot cancel an op, but its
own thread completes a matched pair within milliseconds, well before the
survivors have agreed on the next epoch.

A link that shares its connection with another group's (a subgroup's link over the
world group's, :mod:`resilient.links.lending`) also carries its *slot* from bit
:data:`GROUP_SHIFT` on: the groups' tags never meet, and each group forgets only
its own.

A salt comes round again after :data:`SALTS` epochs. A link that carried stale ops
under some salt is *dirty* for it and is not kept into an epoch with that salt
(both ends' records say so; see :mod:`recovery.agree`).
"""

from __future__ import annotations

import threading
from typing import Any, Final

__all__ = ["GROUP_SHIFT", "MAX_SLOT", "SALTS", "OpLedger", "salt_of", "tag_salt", "tag_slot"]

SALTS: Final = 16
SALT_SHIFT: Final = 24
# A shared connection's slot: above the call numbers (resilient.links.socket_frames
# CALL_SHIFT plus the 21 bits of resilient.collectives.digest_check.call_key), below
# the sign bit. Slot 0 is the connection's owner.
GROUP_SHIFT: Final = 53
MAX_SLOT: Final = (1 << (63 - GROUP_SHIFT)) - 1
_PURGE_ABOVE: Final = 256


def salt_of(epoch: int) -> int:
    """The tag salt of ``epoch``."""
    return epoch % SALTS


def tag_salt(tag: int) -> int | None:
    """The salt a wire tag was sent under; None for the pair's own tags (negative:
    the repair probe), which carry none."""
    return None if tag < 0 else (tag >> SALT_SHIFT) % SALTS


def tag_slot(tag: int) -> int:
    """The slot a wire tag was sent under (-1 for the pair's own negative tags)."""
    return tag >> GROUP_SHIFT


class OpLedger:
    """Unfinished ops of one link, for the current epoch; see the module docstring.

    ``posted``, ``begin_wait`` and ``end_wait`` run for every op and take no lock:
    each is one or two dict operations, atomic under the GIL, ordered so that a
    concurrent :meth:`freeze` never misses a wait (``begin_wait`` registers the
    wait before it looks at the flag). The rest is rare and holds the lock.
    """

    def __init__(self, salt: int = 0, slot: int = 0) -> None:
        if not 0 <= slot <= MAX_SLOT:
            raise ValueError(f"tag slot {slot} outside 0..{MAX_SLOT}")
        self.salt = salt
        self.slot = slot
        self.dirty = 0  # bit s: ops posted under salt s may still be pending
        self._lock = threading.Lock()
        self._open: dict[int, Any] = {}  # id(work) -> work, posted this epoch
        self._stale: dict[int, Any] = {}  # unfinished ops of earlier epochs
        self._waiting: dict[int, Any] = {}
        self._frozen = False
        self._offset = (slot << GROUP_SHIFT) + (salt << SALT_SHIFT)

    def tag(self, tag: int) -> int:
        """``tag`` as it goes on the wire in this epoch."""
        return tag + self._offset

    def posted(self, work: Any) -> None:
        self._open[id(work)] = work
        if len(self._open) > _PURGE_ABOVE:  # ops never waited for (a re-posted send)
            with self._lock:
                self._purge()

    def begin_wait(self, work: Any) -> bool:
        """Note that a thread waits for ``work``; False (do not wait) if its epoch was
        given up and it has not finished (it may never: the wait would only end at
        its deadline, and that closes the pair)."""
        key = id(work)
        self._waiting[key] = work  # first: blocked() counts it from here on
        given_up = key in self._stale or (self._frozen and key in self._open)
        if given_up and not work.is_completed():
            self._waiting.pop(key, None)
            return False
        return True

    def end_wait(self, work: Any, *, finished: bool) -> None:
        key = id(work)
        self._waiting.pop(key, None)
        if finished:
            self._open.pop(key, None)

    def blocked(self) -> int:
        """Unfinished ops a thread is waiting for right now."""
        return sum(1 for w in list(self._waiting.values()) if not w.is_completed())

    def stale(self) -> int:
        """Unfinished ops, waited for or not."""
        with self._lock:
            self._purge()
            return len(self._open)

    def dirty_mask(self) -> int:
        """The salts this link must not be kept into (this epoch's if ops are left)."""
        return self.dirty | ((1 << self.salt) if self.stale() else 0)

    def freeze(self) -> None:
        """The epoch's calls are given up: no new wait for an unfinished op."""
        self._frozen = True

    def renew(self, salt: int) -> None:
        """Enter a new epoch under ``salt``; what is still pending stays pending in
        gloo, unmatched and unwaited, and marks its salt dirty."""
        self.dirty = self.dirty_mask()
        with self._lock:
            self._stale.update(self._open)
            self._open.clear()
            self._frozen = False
            self.salt = salt
            self._offset = (self.slot << GROUP_SHIFT) + (salt << SALT_SHIFT)

    def _purge(self) -> None:
        """Forget finished ops (holds the lock; other threads may add meanwhile)."""
        for ops in (self._open, self._stale):
            for k, w in list(ops.items()):
                if w.is_completed():
                    ops.pop(k, None)
