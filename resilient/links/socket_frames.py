"""The frame format of socket links: what goes on the wire ahead of each message.

Every message a :class:`~resilient.links.socket_pair.SocketPair` sends is one
:data:`HEADER` (tag, payload bytes, call digest) followed by the payload. A tag of a
call checked by digest carries the call's number from bit :data:`CALL_SHIFT` on; a
digest may carry the :data:`NEWS` flag. A receive that meets a message of its tag
whose digest differs fails with :class:`DigestMismatch`
(:mod:`resilient.collectives.digest_check` explains the digests).
"""

from __future__ import annotations

import struct
from typing import Final

__all__ = ["CALL_SHIFT", "HEADER", "NEWS", "DigestMismatch"]

# tag, payload bytes, digest of the call the message belongs to (0: not checked)
HEADER: Final = struct.Struct("<qQq")
# Tags of calls checked by digest carry the call's number from this bit on: what
# SocketPair.forget_call drops (resilient.collectives.digest_check).
CALL_SHIFT: Final = 32
# A digest's flag, not part of it: the sender has news (resilient.collectives.digest_check).
NEWS: Final = 1 << 62


class DigestMismatch(Exception):
    """A receive met a message of its tag sent for another call (its digest differs):
    the ranks' calls differ. The pair is not failed (it is not broken); the message
    was read aside. Not a RuntimeError, so a link does not take it for a broken
    connection and fail over (resilient.links.link translates those)."""
