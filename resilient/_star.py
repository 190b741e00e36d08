"""Star all-gather for the signature exchange: every row to rank 0, the table back.

A mesh all-gather costs every rank P-1 sends and P-1 receives, and on a CPU-bound
host each gloo op is a system call that also runs the peer's side of TCP (on
loopback) and wakes its event loop. The signature table is small and every rank
needs all of it, so for small worlds a star moves it with 2(P-1) messages in all
instead of P(P-1): each rank sends its row to rank 0 and receives the whole table
back (two hops instead of one; the exchange runs ahead of the data, so the hop
is mostly hidden). Rank 0 does what it did before.

Failover is the channels' (:mod:`resilient._channel`): a row is re-sent from the
sender's buffer, which nothing overwrites before rank 0 consumed it (the table
comes back only after every row arrived, and carries the sender's row unchanged).
"""

from __future__ import annotations

from typing import Final

import torch

from resilient._channel import Route, Rx, Tx
from resilient._ring import Span

__all__ = ["STAR_MAX_WORLD", "star_all_gather"]

# Rank 0 sends the whole table to every peer: P-1 times P rows. Beyond a few
# ranks that outweighs the messages saved, and the mesh spreads the load.
STAR_MAX_WORLD: Final = 8
_ROW_TAG: Final = 0
_TABLE_TAG: Final = 1


def star_all_gather(
    *, rank: int, world: int, rail: int, route: Route, flat: torch.Tensor, chunks: list[Span]
) -> None:
    """Fill every chunk of ``flat`` (chunk ``rank`` is filled) through rank 0.

    Raises:
        LinkError: a link failed and no other rail (or the store) could take over.
    """
    elem = flat.element_size()
    if rank != 0:
        mine = chunks[rank]
        tx, rx = Tx(route, 0, rail), Rx(route, 0, rail)
        sent = tx.post(flat[mine.start : mine.stop], _ROW_TAG)
        got = rx.post(flat, _TABLE_TAG)
        tx.wait(sent, mine.size * elem)
        rx.wait(got, flat.numel() * elem)
        rx.ack()
        tx.finish()
        rx.finish()
        return
    peers = range(1, world)
    rxs = {p: Rx(route, p, rail) for p in peers}
    rows = {p: rxs[p].post(flat[chunks[p].start : chunks[p].stop], _ROW_TAG) for p in peers}
    for p in peers:
        rxs[p].wait(rows[p], chunks[p].size * elem)
    txs = {p: Tx(route, p, rail) for p in peers}
    tables = {p: txs[p].post(flat, _TABLE_TAG) for p in peers}
    for p in peers:
        txs[p].wait(tables[p], flat.numel() * elem)
    for p in peers:
        rxs[p].ack()
    for p in peers:
        txs[p].finish()
    for p in peers:
        rxs[p].finish()
