"""Collectives as schedules over links: which bytes go over which link, in what order.

- ``engine``: :class:`RingEngine`, a rank's collectives (all_reduce, broadcast,
  all_gather, reduce_scatter, barrier) split over the rails by weight.
- ``ring_plan``: pure ring schedule math (spans, chunk bounds, rings around a cut pair).
- ``ring_rail``: one rail's share of a ring schedule (a ring pass, a broadcast chain).
- ``ring_native``: a ring pass in C steps while its links are quiet.
- ``mesh``: direct schedules, every rank to every peer (small all_reduces).
- ``mesh_native``: the mesh all_reduce's two steps in C while its links are quiet.
- ``reduce_ops``: the reduction ops and the rank-order fold every schedule follows.
- ``failover``: :class:`Tx`/:class:`Rx`, one direction of one rank pair in one call,
  moved to another rail (or the relay) when its link breaks.
- ``route``: what one call's channels share; ``relay``: a pair's messages through
  the store, the last resort.
- ``reorder``: rings ordered around a pair that no rail connects.
- ``rail_rates``: each rail's speed, learned from the collectives' own timings.
- ``signature``: call signatures; ``digest_check``: calls checked by a digest in
  their data messages instead of an exchange of rows.
- ``solo``: the collectives of a replacement not yet admitted.

Modules inside the package import each other by module path, never from here.
"""

from resilient.collectives.engine import RingEngine
from resilient.collectives.failover import Rx, Tx
from resilient.collectives.reduce_ops import REDUCERS, Reduce, fold_rows
from resilient.collectives.relay import RELAY_RAIL, StoreLink
from resilient.collectives.signature import INLINE_BYTES, Exchange, Signature
from resilient.collectives.solo import SoloEngine

__all__ = [
    "INLINE_BYTES",
    "REDUCERS",
    "RELAY_RAIL",
    "Exchange",
    "Reduce",
    "RingEngine",
    "Rx",
    "Signature",
    "SoloEngine",
    "StoreLink",
    "Tx",
    "fold_rows",
]
