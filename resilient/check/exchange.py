"""Signature exchange ahead of the data: rows sent when the call is made, read when it runs.

Every collective first all-gathers a row per rank (its signature, small payload and
the plan inputs every rank must agree on; see resilient.collectives.signature) over control
links of their own. Waiting for a round of rows before every call's data costs a
hop, and on a loaded host every hop is wake-ups that wait for a core. So a row goes
out as early as it can: from the caller's thread when the call is made, if the
previous exchange has settled here (its verdict decides the rail and the links the
next row takes), else from the communication thread right after that exchange
settles. The communication thread reads the peers' rows when it takes the call up:
DDP's second bucket is made while its first one's data moves, so by the time that
is through, every rank's row for it is already in the sockets and the verdict
costs no wait. Exchanges settle one at a time, in submission order, on the
communication thread; rows go out in the same order, each once, so every pair's
rows meet in order.

Calls whose exchange reads tensor data (inline payloads) or must mean "everyone got
here" (barrier) send their row only when the communication thread takes them up,
so only once every earlier call finished locally: they see the results of earlier
collectives, and no later row goes out before theirs. Over gloo control links
(``control_transport="gloo"``) a row cannot be sent apart from the all-gather that
reads the others', and every exchange runs whole on the communication thread.

Each rank also keeps an exchange clock: how long it has waited inside exchanges
for the other ranks, and all the rest of its time ("active"). Every row carries
the rank's totals, so all ranks see who keeps the others waiting (straggler
detection) from the same numbers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from typing import Any

import torch
from torch._C._distributed_c10d import Store

from resilient.check.control_mesh import FALLBACK_TAG, ControlMesh
from resilient.collectives.digest_check import elided
from resilient.collectives.engine import RingEngine
from resilient.collectives.reorder import follow_cuts
from resilient.collectives.signature import (
    WIDTH,
    Exchange,
    Signature,
    exchange_of,
    signature_table,
)
from resilient.config import DataPlaneConfig
from resilient.detect.rail_weights import agreed_backups, agreed_weights
from resilient.detect.stolen_time import StolenTime
from resilient.errors import CollectiveMismatch, CommunicationError
from resilient.links.repair import CTL_TABLE, install_agreed
from resilient.links.table import LinkTable

__all__ = ["CallChecks"]

logger = logging.getLogger(__name__)

Payload = Callable[[], torch.Tensor | None]


class Ticket:
    """One call's exchange: its row once sent (``table``, ``rail``, ``sends``) and,
    once settled, its :class:`Exchange` or the error its call raises."""

    __slots__ = (
        "elided", "error", "exchange", "payload", "quiet", "rail", "sends", "sent", "seq",
        "settled", "sig", "table",
    )  # fmt: skip

    def __init__(self, seq: int, sig: Signature, payload: Payload | None, quiet: bool) -> None:
        self.seq, self.sig, self.payload, self.quiet = seq, sig, payload, quiet
        self.sent = self.settled = self.elided = False
        self.table: torch.Tensor | None = None
        self.rail = 0
        self.sends: Any = None
        self.exchange: Exchange | None = None
        self.error: BaseException | None = None


class CallChecks:
    """Agrees on each call's signature (and small payload) for one process group."""

    def __init__(
        self,
        *,
        rank: int,
        world: int,
        rail_addresses: Sequence[str],
        store: Store,
        config: DataPlaneConfig,
        epoch: int = 0,
        rates: Callable[[], Sequence[float]] | None = None,
        lagging: Callable[[], tuple[int, int, int]] | None = None,
        staged: Callable[[], list[tuple[int, int, int, int]]] | None = None,
        on_install: Callable[[], None] | None = None,
        links: LinkTable | None = None,
        cut: Callable[[], Sequence[int]] | None = None,
        rescue: Callable[[int], torch.Tensor | None] | None = None,
    ) -> None:
        self.rank = rank
        self._rescue = rescue
        # The last exchange completed here (seq, table): what a survivor publishes
        # when a peer is lost, for peers whose copy of it failed (resilient.group.rescue).
        self.last: tuple[int, torch.Tensor | None] = (0, None)
        self._rates = rates
        self._lagging = lagging
        self._staged = staged
        self._on_install = on_install
        self._cut = cut
        # ``links``: the control links kept from the last epoch, after a rank was lost.
        links = links or LinkTable(
            rank=rank, rails=tuple(rail_addresses), store=store, config=config, epoch=epoch,
            name="ctl", transport=config.control_transport,
        )  # fmt: skip
        # An exchange is small enough to travel on one rail: the heaviest by the
        # engine's weights. With ``rates`` those follow each exchange's agreed rail
        # weights, so the next exchange leaves a degraded rail too (every rank sees
        # the same table, so every rank picks the same rail). Links are made lazily.
        self.engine = RingEngine(rank=rank, world=world, links=links, mesh=True)
        # Over socket links the rows go straight to the peers (resilient.check.control_mesh);
        # over gloo links through the engine's mesh schedule and its channels.
        self._mesh = (
            ControlMesh(rank=rank, world=world, links=links)
            if config.control_transport == "socket"
            else None
        )
        self._static = self.engine.weights
        # Calls that skip their exchange (resilient.collectives.digest_check): every K-th keeps it.
        # Only where the data plane meshes (every rank decides alike from the
        # config): elsewhere every elided call would fall back, costing more.
        sockets = config.control_transport == "socket" and config.data_transport == "socket"
        mesh = world > 2 and config.meshes(world)
        self.elide_every = config.elide_every if sockets and mesh else 0
        # Whether the last full exchange found the group quiet (set by the group
        # from its verdict, the same on every rank): only then do calls elide.
        self.quiet = False
        # Full exchanges run, calls run elided, and those of them that fell back to
        # an exchange (for tests and benchmarks to tell what the calls cost).
        self.exchanges = self.elided = self.fallbacks = 0
        self._submitted = 0
        self._succeeded = 0  # see succeeded
        self._ran = 0  # exchanges settled (each once, in submission order)
        self._sent = 0  # exchanges whose row went out (each once, in submission order)
        # Submitted calls whose row has not gone out yet, oldest first; the lock
        # makes sending a row, and deciding that it may go, one step for the caller's
        # thread and the communication thread.
        self._unsent: deque[Ticket] = deque()
        self._send_lock = threading.Lock()
        self._started = time.monotonic()
        self._waited_us = 0  # written by the communication thread only
        self._failed_with: BaseException | None = None
        self._stolen = StolenTime(f"resilient-stolen-{rank}")

    def submit(
        self,
        sig: Signature,
        payload: Payload | None = None,
        *,
        after_previous: bool = False,
    ) -> Ticket:
        """Schedule the exchange of ``sig``; :meth:`result` gives its :class:`Exchange`.

        Sends this rank's row now when the previous exchange has settled here (and
        the call is not ``after_previous`` and has no ``payload``: those go out once
        every earlier call was marked done). Called from one thread at a time, in
        order.
        """
        self._submitted += 1
        seq = self._submitted
        quiet = after_previous or payload is not None
        if elided(self.elide_every, seq):
            # Elided if the group is quiet when it runs (take_elided): its row, if
            # any, goes out only then, from the communication thread, so no later
            # row can pass it (its signature is numbered then too).
            ticket = Ticket(seq, sig, payload, True)
            ticket.elided = True
            with self._send_lock:
                self._unsent.append(ticket)
            return ticket
        ticket = Ticket(seq, sig.with_seq(seq), payload, quiet)
        with self._send_lock:
            self._unsent.append(ticket)
            self._send_ready()
        return ticket

    @property
    def submitted(self) -> int:
        """Calls submitted in this epoch (numbered alike on every rank)."""
        return self._submitted

    @property
    def succeeded(self) -> int:
        """How many of this epoch's calls, from the first on, all succeeded here."""
        return self._succeeded

    @property
    def failovers(self) -> list[tuple[int, int, int, int]]:
        """The control links' failovers: ``(peer, from_rail, to_rail, resumed_at)``
        (see Route.log; ``to_rail`` RELAY_RAIL for rows taken from the store)."""
        extra = self._mesh.failovers if self._mesh is not None else []
        return self.engine.failovers + extra

    def result(self, ticket: Ticket) -> Exchange:
        """The ticket's exchange: its row sent if it has not been, the peers' rows
        read. Only the communication thread calls this, in submission order.

        Raises:
            CollectiveMismatch: the ranks' signatures differ.
            LinkError: a row did not come.
            PeerLost: a peer was lost before the exchange.
        """
        if not ticket.settled:
            self._run(ticket)
        if ticket.error is not None:
            raise ticket.error
        assert ticket.exchange is not None
        return ticket.exchange

    def _settle(
        self, ticket: Ticket, exchange: Exchange | None, exc: BaseException | None = None
    ) -> None:
        """Give the ticket its exchange (or ``exc``); the next row may go out."""
        ticket.exchange = exchange
        if exchange is None:
            ticket.error = exc or RuntimeError("an exchange settled without a result")
        ticket.settled = True
        with self._send_lock:
            if not ticket.sent and self._unsent and self._unsent[0] is ticket:
                # Its call ended before its row went out (a peer was lost: the
                # epoch's calls are given up); later rows must not wait for it.
                self._unsent.popleft()
                self._sent, ticket.sent = ticket.seq, True
            self._ran += 1
            self._send_ready()

    def take_elided(self, ticket: Ticket) -> bool:
        """Whether ``ticket``'s call runs elided (collectives.digest_check): its number says
        it may, and the last full exchange found the group quiet (every rank
        decides alike, in call order). If so it is settled without a row; if not,
        it becomes a call with an exchange. Communication thread only, in order."""
        if not ticket.elided:
            return False
        if not self.quiet or self._failed_with is not None:
            ticket.elided = False
            ticket.sig = ticket.sig.with_seq(ticket.seq)
            return False
        with self._send_lock:
            assert self._unsent and self._unsent[0] is ticket
            self._unsent.popleft()
            self._sent, ticket.sent, ticket.settled = ticket.seq, True, True
            self._ran += 1
            self._send_ready()
        self.elided += 1
        return True

    def check_elided(self, ticket: Ticket) -> None:
        """Before an elided call's data: raises what every pending call raises (a
        peer was lost)."""
        if self._failed_with is not None:
            raise self._failed_with

    def add_waited(self, seconds: float) -> None:
        """Time an elided call waited at its gate for the others: the clock counts
        it as time waited inside an exchange (communication thread only)."""
        self._waited_us += int(seconds * 1e6)

    def fallback(self, ticket: Ticket) -> Exchange:
        """Exchange full rows for an elided call that a rank refused (every rank
        does, see collectives.digest_check), on the control links under a tag of their own.
        Its news is not acted on: later rows went out under the previous verdict.

        A call with payloads whose rows did not all come is finished from a
        surviving peer's table when one completed it (see _rescued).

        Raises:
            CollectiveMismatch: the ranks' calls differ (the usual case).
            LinkError: a row did not come.
            PeerLost: a peer was lost.
        """
        self.check_elided(ticket)
        assert self._mesh is not None  # elided calls need socket control links
        self.fallbacks += 1
        ticket.sig = ticket.sig.with_seq(ticket.seq)
        table = self._row(ticket)
        rail = self._rail()
        began = time.monotonic()
        try:
            sends = self._mesh.send(table, ticket.seq, rail, tag=FALLBACK_TAG)
            self._mesh.receive(table, ticket.seq, rail, sends, tag=FALLBACK_TAG)
        except BaseException as exc:
            # A call with payloads only, as an exchange ahead of the call would be.
            rescued = self._rescued(ticket.seq, exc) if ticket.payload is not None else None
            if rescued is None:
                raise
            return rescued
        finally:
            self._waited_us += int((time.monotonic() - began) * 1e6)
        exchange = exchange_of(table, ticket.seq)
        self.last = (ticket.seq, table)
        return exchange

    def mark_done(self, ticket: Ticket, *, ok: bool = True) -> None:
        """Called by the communication thread after each call, failed (``ok`` False)
        or not, in order (with its ticket: one it never ran is settled here, failed)."""
        if not ticket.settled:
            self._settle(ticket, None, self._failed_with or RuntimeError("call ended first"))
        if ok and self._succeeded == ticket.seq - 1:
            self._succeeded = ticket.seq

    def fail_pending(self, exc: BaseException) -> None:
        """Fail every exchange not started yet with ``exc`` (a peer is gone: the
        others stopped taking part in this epoch's calls)."""
        self._failed_with = exc

    def stop(self, timeout_s: float) -> bool:
        """Stop the checks' meter, keeping the links (exchanges run on the
        communication thread, which the caller has seen idle); True."""
        self._stolen.close()
        self.engine.close()
        return True

    def abandon(self) -> None:
        """Close these checks and their links in the background (closing a link can
        block)."""
        threading.Thread(target=self.close, name=f"ctl-close-{self.rank}", daemon=True).start()

    def close(self) -> None:
        self._stolen.close()
        self.engine.close()
        self.engine.links.close()

    def _install(self, exchange: Exchange) -> None:
        """Put control links staged at both ends in service before the next exchange
        (every rank decides from the same table; see resilient.links.repair)."""
        installed = install_agreed(self.engine.links, exchange.staged, self.rank, CTL_TABLE)
        if installed and self._on_install is not None:
            self._on_install()

    # -- sending rows (under _send_lock) -------------------------------------------------
    def _send_ready(self) -> None:
        """Send the oldest unsent row if it may go now: its predecessor settled here
        (the rail and links follow from that verdict), it is not quiet, and this
        thread would build no link for it."""
        if not self._unsent or self._failed_with is not None or self._mesh is None:
            return
        ticket = self._unsent[0]
        if ticket.quiet or self._ran < ticket.seq - 1:
            return
        if not self._mesh.ready(self._rail()):
            return  # the first exchange builds the links, on the communication thread
        self._send(ticket)

    def _send(self, ticket: Ticket) -> None:
        """Build and send ``ticket``'s row; a failure is kept for its call to raise."""
        assert self._unsent[0] is ticket and self._sent < ticket.seq
        self._unsent.popleft()
        self._sent = ticket.seq
        ticket.sent = True
        ticket.rail = self._rail()
        try:
            ticket.table = self._row(ticket)
            if self._mesh is not None:
                ticket.sends = self._mesh.send(ticket.table, ticket.seq, ticket.rail)
        except BaseException as exc:  # the call raises it when it runs
            ticket.error = exc

    def _rail(self) -> int:
        """The rail of the next exchange: the heaviest by the weights agreed in the
        previous one (the same rail on every rank)."""
        weights = self.engine.weights
        # Twice per call on the caller's thread: one rail needs no search.
        return 0 if len(weights) == 1 else max(range(len(weights)), key=weights.__getitem__)

    def _row(self, ticket: Ticket) -> torch.Tensor:
        """The exchange table with this rank's row filled (see signature_table)."""
        data = ticket.payload() if ticket.payload is not None else None
        clock = (
            int((time.monotonic() - self._started) * 1e6) - self._waited_us,
            self._waited_us,
            self._stolen.total_us,
        )
        return signature_table(
            self.engine.world,
            ticket.sig,
            self.rank,
            data,
            self._rates() if self._rates is not None else (),
            clock,
            self._lagging() if self._lagging is not None else (-1, 0, 0),
            self._staged() if self._staged is not None else [],
            self._cut() if self._cut is not None else (),
        )

    # -- running an exchange (communication thread) ------------------------------------
    def _run(self, ticket: Ticket) -> None:
        if self._failed_with is not None:
            self._settle(ticket, None, self._failed_with)
            return
        try:
            with self._send_lock:
                if not ticket.sent:  # the caller's thread may be sending it right now
                    self._send(ticket)
            if ticket.error is not None:
                raise ticket.error
            assert ticket.table is not None
            self.exchanges += 1
            began = time.monotonic()
            try:
                if self._mesh is None:  # gloo control links: one all-gather sends and reads
                    self.engine.all_gather(ticket.table.view(-1))
                else:
                    self._mesh.receive(ticket.table, ticket.seq, ticket.rail, ticket.sends)
            finally:
                self._waited_us += int((time.monotonic() - began) * 1e6)
            self._finish(ticket, exchange_of(ticket.table, ticket.seq))
        except BaseException as exc:  # the waiting collective re-raises it
            self._failed(ticket, exc)

    def _failed(self, ticket: Ticket, exc: BaseException) -> None:
        rescued = self._rescued(ticket.seq, exc) if ticket.payload is not None else None
        if rescued is not None:
            self._finish(ticket, rescued)
        else:
            self._settle(ticket, None, exc)

    def _finish(self, ticket: Ticket, exchange: Exchange) -> None:
        seq = ticket.seq
        self._install(exchange)
        # The next exchange avoids a cut-off pair too (the data call's engine
        # follows the same rows: resilient.collectives.reorder).
        follow_cuts(self.engine, exchange)
        if self._rates is not None:
            self.engine.weights = agreed_weights(exchange.rates, self._static, seq)
            self.engine.backups = agreed_backups(exchange.rates, self.engine.num_rails)
        self.last = (seq, exchange.table)
        self._settle(ticket, exchange)

    def _rescued(self, seq: int, exc: BaseException) -> Exchange | None:
        """The exchange ``seq`` as another survivor completed it, when this rank's
        copy failed for a lost peer (see resilient.group.rescue); else None. Only calls
        with no data phase (inline payloads) are rescued: a data phase would need
        the lost peer anyway."""
        if self._rescue is None or not isinstance(exc, CommunicationError):
            return None
        table = self._rescue(seq)
        if table is None or table.shape != (self.engine.world, WIDTH):
            return None
        try:
            exchange = exchange_of(table, seq)
        except CollectiveMismatch:  # the survivors' own verdict was the same
            return None
        logger.warning(
            "rank %d: exchange %d failed here (%s) but a surviving peer completed it; "
            "finished from its table", self.rank, seq, exc,
        )  # fmt: skip
        return exchange
