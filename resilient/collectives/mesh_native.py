"""The mesh all-reduce's two steps in C (resilient.links.native_steps), when its links are quiet.

:class:`~resilient.collectives.mesh.MeshRail` asks :func:`in_c` first. The contributions move
in one C step, the owner folds them in rank order as the Python path does, and the
results move in a second step. A step that stops hands its streams back; the
rail's channels are built then, with what each step moved of every message as
their ``ahead`` (resilient.collectives.failover), and the Python path finishes the call from
there, folds included only if the first step stopped.
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING

import torch

from resilient.links import native_steps
from resilient.links.byte_views import bytes_of

if TYPE_CHECKING:
    from resilient.collectives.mesh import MeshRail, Reducer

__all__ = ["in_c"]


def in_c(m: MeshRail, reduce: Reducer, pool: torch.Tensor, *, then_gather: bool) -> bool:
    """The call's two steps in C (resilient.links.native_steps): the contributions, then the
    results. False: the pairs are not quiet, nothing was moved. A step that stops
    hands its streams back, and the channels finish the call from there."""
    if m._bytes is None or m.skip is not None:  # CUDA or gloo links; a slow rank
        return False
    links = native_steps.quiet_links(m.route.links, m.peers, m.rail)
    if links is None:
        return False
    pairs, ledgers = [link.pg for link in links], [link.ledger for link in links]
    assert m._bytes is not None
    e, k, route = m.elem, m.k, m.route
    own, at = m.subs[m.rank], {p: i for i, p in enumerate(m.peers)}
    tag = [ledger.tag for ledger in ledgers]
    buf, base, raw, pbase = m._bytes, m.flat.data_ptr(), bytes_of(pool), pool.data_ptr()
    sent, want = route.sent_digest, route.digest
    one, scratch, off = native_steps.Step(pairs, ledgers), {}, 0
    for j in range(k):
        for p in m.peers:
            i, span = at[p], m.subs[p][j]
            if span.size:
                one.send(i, tag[i](j + route.base), sent, buf, base, span.start * e, span.size * e)
            if own[j].size:
                one.recv(i, tag[i](j + route.base), want, raw, pbase, off * e, own[j].size * e)
                scratch[(p, j)] = pool[off : off + own[j].size]
                off += own[j].size
    began = time.monotonic()
    stopped = one.run()
    if m.gated:  # waiting for the peers' contributions, as at the Python gate
        m.gate_waited_s += time.monotonic() - began
    if stopped is not None:
        m._channels(*_ahead(m, one, stopped, None))
        m._python(reduce, pool, then_gather=then_gather, folded=False)
        return True
    m.gate_news = one.news
    for j in range(k):
        if own[j].size:
            m._fold(j, reduce, scratch, {}, waited=True)
    if not then_gather:
        return True
    two = native_steps.Step(pairs, ledgers)
    for j in range(k):
        for p in m.peers:
            i, span = at[p], m.subs[p][j]
            if own[j].size:
                two.send(
                    i,
                    tag[i](k + j + route.base),
                    sent,
                    buf,
                    base,
                    own[j].start * e,
                    own[j].size * e,
                )
            if span.size:
                two.recv(
                    i,
                    tag[i](k + j + route.base),
                    want,
                    buf,
                    base,
                    span.start * e,
                    span.size * e,
                )
    stopped = two.run()
    m.gate_news = m.gate_news or two.news
    if stopped is not None:
        m._channels(*_ahead(m, two, stopped, one))
        m._python(reduce, pool, then_gather=True, folded=True)
    return True


def _ahead(
    m: MeshRail,
    step: native_steps.Step,
    stopped: tuple[list[object], list[object]],
    before: native_steps.Step | None,
) -> tuple[dict[int, list[object]], dict[int, list[object]]]:
    """Per peer, what the C steps did of each message, in posting order (``before``:
    the contributions' step, moved whole, when the results' one stopped)."""
    tx: dict[int, list[object]] = {p: [] for p in m.peers}
    rx: dict[int, list[object]] = {p: [] for p in m.peers}
    if before is not None:
        for out in before.sends:
            tx[m.peers[out[0]]].append(native_steps.DONE)
        for got in before.recvs:
            rx[m.peers[got[0]]].append(native_steps.finished(before.pairs[got[0]], before.news))
    for out, w in zip(step.sends, stopped[0], strict=True):
        tx[m.peers[out[0]]].append(w)
    for got, w in zip(step.recvs, stopped[1], strict=True):
        rx[m.peers[got[0]]].append(w)
    return tx, rx
