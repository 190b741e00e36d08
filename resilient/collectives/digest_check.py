"""Calls checked by a digest in their data messages instead of an exchange of rows.

The signature exchange (resilient.check.exchange) costs every call a round of rows and
the Python around them (~6 points of a DDP step on a loaded host, docs/BENCHMARKS.md).
With ``elide_every`` K > 0, only every K-th call by number (and the first) keeps
it. The others are *elided*: which ones is decided by the call's number alone, so
every rank agrees without a word. In an elided call:

* every data message carries the call's **digest** (a hash of its signature) in
  its socket frame header, and tags numbered by the call (``CALL_SHIFT``), so no
  message of one call ever meets a receive of another;
* the mesh all-reduce (socket data links built to every peer, one rail, every
  chunk non-empty, no slow rank) sends each peer its contribution first, so every
  rank hears from every peer before it folds anything (the *gate*); an
  all_to_all_single of equal splits on one rail sends each peer a digest frame
  first and reads no data until every peer's came (resilient.group.alltoall), and
  so does an all-reduce the ring takes (cut across rails, or too large for the
  mesh) before its ring starts (resilient.collectives.ring_gate). A receive that
  meets another digest fails with
  :class:`~resilient.links.socket_frames.DigestMismatch`;
* any other call (another op, a payload, a barrier) sends every peer on every
  rail a header-only **hello** under the same tag with the digest ``FALLBACK``
  instead, which no receive accepts.

Digests are equal only if signatures are (64-bit hash), so if any two ranks'
calls differ, every rank meets a message it refuses at its gate: each hears from
every peer. Then every rank forgets the call's tags on its data links and *falls
back*: it exchanges full rows for the call on the control links (a tag of their
own, so they meet in order whatever full rows went out meanwhile), which raises
:class:`~resilient.errors.CollectiveMismatch` naming every rank's call, exactly as
an exchange ahead of the data would. Nothing was folded into the caller's tensor.
If the rows agree (every rank made the same call, one that is not elided), the
call runs as a checked one would, with the rows' payloads.

Calls elide only while the group is quiet (the last full exchange named nothing
that needs every call's news; ResilientProcessGroup._quiet), decided when a call
runs, in order, so alike on every rank. What an elided call skips is the row's
news (rail rates, slow-link evidence, straggler clocks): it waits for the next
full exchange, at most K - 1 calls later. A rank whose health board changed
since the quiet verdict sets the NEWS flag beside its digest; every rank sees it
at its gate and ends the quiet. The time a rank waits at the gate counts as
waiting for the others in its clock, as time inside an exchange does.
"""

from __future__ import annotations

import hashlib
import logging
from typing import Final

import torch

from resilient.collectives.signature import Signature
from resilient.errors import LinkError
from resilient.links.ledger import salt_of
from resilient.links.socket_frames import CALL_SHIFT
from resilient.links.socket_link import SocketLink
from resilient.links.table import LinkTable

__all__ = ["FALLBACK", "NotElided", "call_key", "digest_of", "elided", "forget_call", "hello"]

logger = logging.getLogger(__name__)

# What a hello carries: no real digest is negative (see digest_of).
FALLBACK: Final = -1
_EMPTY: Final = torch.empty(0, dtype=torch.uint8)
# Calls by number within an epoch, before they come round (tags have room for more).
_CALLS: Final = 1 << 16


class NotElided(Exception):
    """This rank's call cannot run elided (raised before anything was posted):
    it says so to its peers with hellos and falls back."""


def elided(every: int, seq: int) -> bool:
    """Whether call ``seq`` (1, 2, ... within an epoch) skips its exchange."""
    return every > 0 and seq > 1 and seq % every != 0


def digest_of(sig: Signature) -> int:
    """A positive 62-bit digest of what must match across ranks (not the call's
    number: tags carry that). The same on every rank for equal signatures."""
    text = repr(
        (sig.op, sig.reduce, str(sig.dtype), sig.tensors, sig.numel, sig.root, sig.shape,
         sig.shapes_crc)
    )  # fmt: skip
    raw = hashlib.blake2b(text.encode(), digest_size=8).digest()
    return (int.from_bytes(raw, "little") >> 2) | 1


def call_key(epoch: int, seq: int) -> int:
    """The tag bits from CALL_SHIFT on of call ``seq``: never 0 (the tags of checked
    calls), and with the epoch's salt, so a call forgotten in one epoch never
    drops a message of the same number in the next."""
    return (salt_of(epoch) << 17) | (seq % (_CALLS - 1) + 1)


def hello(links: LinkTable, key: int) -> None:
    """Tell every peer this rank has a link to that its call ``key`` is not elided:
    a header-only message under the tag the mesh's first receive waits on, on
    every rail. Builds no link: a peer that gates has built its links to every
    peer, which took this rank's part. A broken link is skipped (its peer's wait
    on it fails anyway)."""
    base = key << CALL_SHIFT
    for link in links.links().values():
        if isinstance(link, SocketLink) and not link.broken:
            try:
                link.isend(_EMPTY, base, FALLBACK)
            except LinkError:
                logger.debug("rank %d: hello of call %d not sent on %r", links.rank, key, link)


def forget_call(links: LinkTable, key: int) -> None:
    """Drop every receive of call ``key`` on the data links, and its messages,
    stashed or still to come (see SocketPair.forget_call)."""
    why = f"call {key:#x} fell back to a full exchange"
    for link in links.links().values():
        pg = getattr(link, "pg", None)
        if isinstance(link, SocketLink) and pg is not None:
            pg.forget_call(key, why, link.ledger.slot)
