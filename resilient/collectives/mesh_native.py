"""The mesh all-reduce's two steps in C (resilient.links.native_steps), when its links are quiet.

:class:`~resilient.collectives.mesh.MeshRail` runs them itself: the contributions move
in one C step (:meth:`MeshSteps.contributions`), the owner folds them in rank order
as the Python path does, and the results move in a second step
(:meth:`MeshSteps.results`). A step that stops hands its streams back; the rail's
channels are built then, with what each step moved of every message as their
``ahead`` (:meth:`MeshSteps.ahead`, resilient.collectives.failover), and the Python path
finishes the call from there, folds included only if the first step stopped.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from resilient.collectives.native_acks import StepAcks, acked
from resilient.links import native_steps
from resilient.links.byte_views import bytes_of

if TYPE_CHECKING:
    from resilient.collectives.ring_plan import Span
    from resilient.collectives.route import Route
    from resilient.links.table import Link

__all__ = ["MeshSteps"]


class MeshSteps:
    """One rail's two C steps of a mesh call over the quiet ``links`` to ``peers``."""

    def __init__(
        self,
        links: list[Link],
        route: Route,
        rank: int,
        peers: list[int],
        subs: list[list[Span]],
        flat: torch.Tensor,
        buf: memoryview,
        pool: torch.Tensor,
    ) -> None:
        """``subs[chunk][j]``: the rail's sub-chunks (MeshPlan.subs); ``buf``: the
        byte view of ``flat`` its messages are posted from; ``pool``: scratch for
        the peers' contributions to this rank's chunk."""
        self.links, self.rail = links, links[0].rail
        self.pairs = [link.pg for link in links]
        self.ledgers = [link.ledger for link in links]
        self.route, self.peers, self.subs, self.own = route, peers, subs, subs[rank]
        self.k, self.elem = len(subs[0]), flat.element_size()
        self.buf, self.base, self.pool = buf, flat.data_ptr(), pool
        self.at = {p: i for i, p in enumerate(peers)}
        self.tag = [ledger.tag for ledger in self.ledgers]
        # Each peer's contribution to sub-chunk j of this rank's chunk, by (peer, j),
        # once :meth:`contributions` posted them: views of ``pool``.
        self.scratch: dict[tuple[int, int], torch.Tensor] = {}

    def contributions(self) -> native_steps.Step:
        """The first step, posted (not run): this rank's part of every peer's chunk
        to that peer, every peer's part of this rank's chunk into ``pool``."""
        e, k, route, own, at, tag = self.elem, self.k, self.route, self.own, self.at, self.tag
        buf, base, pool = self.buf, self.base, self.pool
        raw, pbase = bytes_of(pool), pool.data_ptr()
        sent, want = route.sent_digest, route.digest
        one, scratch, off = native_steps.Step(self.pairs, self.ledgers), self.scratch, 0
        for j in range(k):
            for p in self.peers:
                i, span = at[p], self.subs[p][j]
                if span.size:
                    one.send(
                        i, tag[i](j + route.base), sent, buf, base, span.start * e, span.size * e
                    )
                if own[j].size:
                    one.recv(i, tag[i](j + route.base), want, raw, pbase, off * e, own[j].size * e)
                    scratch[(p, j)] = pool[off : off + own[j].size]
                    off += own[j].size
        return one

    def results(self) -> native_steps.Step:
        """The second step, posted (not run): this rank's reduced chunk to every
        peer, every peer's straight into the buffer."""
        e, k, route, own, at, tag = self.elem, self.k, self.route, self.own, self.at, self.tag
        buf, base = self.buf, self.base
        sent, want = route.sent_digest, route.digest
        two = native_steps.Step(self.pairs, self.ledgers)
        for j in range(k):
            for p in self.peers:
                i, span = at[p], self.subs[p][j]
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
        return two

    def ahead(
        self,
        step: native_steps.Step,
        stopped: tuple[list[object], list[object]],
        before: native_steps.Step | None,
    ) -> tuple[dict[int, list[object]], dict[int, list[object]]]:
        """Per peer, what the C steps did of each message, in posting order: the
        channels' ``ahead`` once ``step`` stopped (``before``: the contributions'
        step, moved whole, when the results' one stopped)."""
        peers = self.peers
        tx: dict[int, list[object]] = {p: [] for p in peers}
        rx: dict[int, list[object]] = {p: [] for p in peers}
        if before is not None:
            for out in before.sends:
                tx[peers[out[0]]].append(native_steps.DONE)
            for got in before.recvs:
                rx[peers[got[0]]].append(native_steps.finished(before.pairs[got[0]], before.news))
        # Only the data's: a step's acknowledgements come after it (see acks).
        for out, w in zip(step.sends[: len(stopped[0])], stopped[0], strict=True):
            tx[peers[out[0]]].append(w)
        for got, w in zip(step.recvs[: len(stopped[1])], stopped[1], strict=True):
            rx[peers[got[0]]].append(w)
        return tx, rx

    def acks(self, step: native_steps.Step) -> StepAcks | None:
        """Add every pair's acknowledgements to the call's last step (several rails)."""
        if not acked(self.route):
            return None
        acks = StepAcks(self.route, self.rail, len(self.peers))
        for i, p in enumerate(self.peers):
            acks.give(step, i, p, self.links[i])
            acks.expect(step, i, p, self.links[i])
        return acks
