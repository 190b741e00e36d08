"""Running an elided call and deciding when calls may elide (resilient.collectives.digest_check).

:class:`ElidedCalls` lives for one epoch beside that epoch's :class:`~resilient.check.
exchange.CallChecks`: the process group hands it the calls the checks let skip their
exchange, and the verdict of every full exchange, which decides whether the next
calls may.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch

from resilient.collectives.alltoall import equal_sizes
from resilient.collectives.digest_check import NotElided, call_key, forget_call, hello
from resilient.collectives.ring_gate import ring_elides
from resilient.detect.rail_weights import DOWN
from resilient.detect.slow_rank import ENTER_PERMILLE, named
from resilient.links.socket_frames import DigestMismatch

if TYPE_CHECKING:
    from collections.abc import Callable

    from resilient.check.exchange import CallChecks, Payload, Ticket
    from resilient.collectives.engine import RingEngine
    from resilient.collectives.signature import Exchange, Signature
    from resilient.detect.health_board import HealthBoard
    from resilient.detect.stragglers import StragglerWatch
    from resilient.links.table import LinkTable

__all__ = ["CHECKED", "ElidedCalls"]

logger = logging.getLogger(__name__)

# What a call without payloads gets for its table once the signatures matched (its
# function only asks whether they were checked: None means checks are off).
CHECKED = torch.empty(0, dtype=torch.uint8)


class ElidedCalls:
    """Runs one epoch's elided calls over ``engine`` (the CPU ring engine) and
    ``links`` (its data links), and keeps ``checks.quiet`` from each verdict."""

    def __init__(
        self,
        checks: CallChecks,
        *,
        engine: RingEngine,
        links: LinkTable,
        board: HealthBoard,
        stragglers: StragglerWatch,
        rank: int,
        epoch: int,
    ) -> None:
        self.checks, self.engine, self.links = checks, engine, links
        self.board, self.stragglers = board, stragglers
        self.rank, self.epoch = rank, epoch
        # The health board's changes when the group was last found quiet (settle).
        self.quiet_mark = 0

    def settle(self, exchange: Exchange, sig: Signature, mark: int) -> None:
        """After a full exchange: whether the next calls may elide, and the board's
        changes (``mark``, read before the call's row was built) at that verdict."""
        self.checks.quiet, self.quiet_mark = self._quiet(exchange, sig), mark

    def run(
        self,
        ticket: Ticket,
        fn: Callable[[torch.Tensor | None], Any],
        payload: Payload | None,
        digest: int,
    ) -> Any:
        """Run an elided call (collectives.digest_check): checked by its digest where it can
        be, else by a hello and a full exchange, which every rank falls back to as
        soon as one refuses the call.

        Raises:
            CollectiveMismatch: the ranks' calls differ.
            CommunicationError: as any call.
        """
        channel = self.checks
        channel.check_elided(ticket)
        engine = self.engine
        key = call_key(self.epoch, ticket.seq)
        calls = engine.calls
        # A rank with news since the quiet verdict (a NIC, a link) still takes part
        # (a failover needs every peer in the call) but flags its messages: every
        # rank sees the flag at its gate, and the quiet ends for all alike, so the
        # next call exchanges rows that show the news.
        mark = self.board.changes
        news = mark != self.quiet_mark
        if digest:
            engine.elided, engine.gate_waited_s, engine.gate_news = (key, digest, news), 0.0, False
            try:
                out = fn(CHECKED)
                if news or engine.gate_news:
                    channel.quiet = False
                return out
            except DigestMismatch as exc:
                logger.info(
                    "rank %d (epoch %d, call %d): a peer's call differs (%s); falling back "
                    "to a full exchange", self.rank, self.epoch, ticket.seq, exc,
                )  # fmt: skip
            except NotElided:
                hello(self.links, key)
            finally:
                engine.elided = None
                channel.add_waited(engine.gate_waited_s)
        else:
            hello(self.links, key)
        forget_call(self.links, key)
        # Some ranks routed the refused call and others did not: agree again.
        engine.calls = calls
        exchange = channel.fallback(ticket)
        # Its clocks are news every rank reads alike; links are not put in service
        # here (rows of later calls may have gone out on the old ones).
        self.stragglers.observe(exchange)
        self.settle(exchange, ticket.sig, mark)
        return fn(exchange.payloads() if payload is not None else CHECKED)

    def _elidable_op(self, exchange: Exchange, sig: Signature) -> bool:
        """Whether ``sig`` is an all_reduce the mesh takes on one rail or the ring
        takes gated (resilient.collectives.ring_gate), or an all_to_all_single of
        equal splits on every rank (its payloads say so; see resilient.group.alltoall)
        on one rail."""
        engine, dtype = self.engine, sig.dtype
        if sig.op == "all_to_all_single":
            return engine.num_rails == 1 and equal_sizes(exchange.payloads(), engine.world)
        if sig.op != "allreduce" or dtype is None:
            return False
        nbytes = sig.numel * dtype.itemsize
        if ring_elides(engine, nbytes):
            return True
        return engine.mesh and nbytes < engine.mesh_below_bytes and engine.one_rail(nbytes)

    def _quiet(self, exchange: Exchange, sig: Signature) -> bool:
        """Whether the next calls may elide (collectives.digest_check): this call (``sig``,
        agreed) is one that elides (see _elidable_op), so the next ones likely are
        too (a job of ring-sized tensors would only fall back), and nothing in this
        verdict needs the news of every call (links to put in service, cut pairs,
        a rail down, a slow rank named or agreed, a straggler confirmed). The same
        on every rank: all of it follows from the exchange table."""
        engine = self.engine
        if not self._elidable_op(exchange, sig):
            return False
        if engine.slow_rank is not None or engine.order is not None:
            return False
        if any(exchange.staged) or any(exchange.cut):
            return False
        if any(DOWN in rates for rates in exchange.rates):  # a NIC or link down somewhere
            return False
        if exchange.lagging and named(exchange.lagging, ENTER_PERMILLE) is not None:
            return False
        # A confirmed straggler, not a suspected one: suspicions come and go on a
        # loaded host (a tight loop of calls kept one suspected in 805 of 807
        # exchanges), and the clocks are still read at every full exchange.
        state = self.stragglers.state
        return all(state(r) != "confirmed" for r in range(len(exchange.clocks)))
