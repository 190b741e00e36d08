"""Signature exchange ahead of the data, on its own links and thread.

Checking every call's signature before its data moves costs one hop. Done on the
communication thread, that hop adds to every collective. Here a call submitted
while the communication thread is busy with an earlier one is exchanged on a
control thread over separate control links (mesh, on the healthiest rail): while
call k moves its data, call k+1's signature is already being agreed on, so
back-to-back collectives (DDP's buckets) stop paying for it. A call submitted to
an idle group is exchanged by the communication thread itself, as it picks the
call up: handing it to the control thread and its verdict back would add two
thread wake-ups to the critical path, each of which waits for a core on a busy
host (every exchange still runs alone and in submission order).

Calls whose exchange reads tensor data (inline payloads) or must mean "everyone got
here" (barrier) are always exchanged by the communication thread, so only once every
earlier call finished locally: they see the results of earlier collectives. Every
rank exchanges in submission order, on links no data phase uses, so the exchanges
always pair up.

Each rank also keeps an exchange clock: how long it has waited
inside exchanges for the other ranks, and all the rest of its time ("active").
Every row carries the rank's totals, so all ranks see who keeps the others waiting
(straggler detection) from the same numbers.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future

import torch
from torch._C._distributed_c10d import Store

from resilient._ctlmesh import ControlMesh
from resilient._handoff import Bell, Handoff
from resilient._reorder import follow_cuts
from resilient._repair import CTL_TABLE, install_agreed
from resilient._signature import WIDTH, Exchange, Signature, check_signatures, exchange_of
from resilient._stolen import StolenTime
from resilient._weights import agreed_backups, agreed_weights
from resilient.collectives import RingEngine
from resilient.config import DataPlaneConfig
from resilient.errors import CollectiveMismatch, CommunicationError
from resilient.links import LinkTable

__all__ = ["SignatureChannel"]

logger = logging.getLogger(__name__)

Payload = Callable[[], torch.Tensor | None]


class Ticket:
    """One call's exchange: who runs it (``by_ctl``) and its future :class:`Exchange`."""

    __slots__ = ("by_ctl", "fut", "payload", "seq", "settled", "sig")

    def __init__(self, seq: int, sig: Signature, payload: Payload | None, by_ctl: bool) -> None:
        self.seq, self.sig, self.payload = seq, sig, payload
        self.by_ctl = by_ctl
        self.settled = False
        self.fut: Future[Exchange] = Future()


class SignatureChannel:
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
        # when a peer is lost, for peers whose copy of it failed (resilient._rescue).
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
        # Over socket links the rows go straight to the peers (resilient._ctlmesh);
        # over gloo links through the engine's mesh schedule and its channels.
        self._mesh = (
            ControlMesh(rank=rank, world=world, links=links)
            if config.control_transport == "socket"
            else None
        )
        self._static = self.engine.weights
        self._submitted = 0
        self._done = 0  # calls the communication thread finished
        self._succeeded = 0  # see succeeded
        self._ran = 0  # exchanges settled (each once, in submission order)
        self._ran_lock = threading.Lock()
        self._queue: Handoff[Ticket | None] = Handoff()
        # Rung when the control thread settles an exchange: the communication thread
        # waits on it (see result) rather than on the future's condition.
        self._settled = Bell()
        # Rung when the communication thread settles one while the control thread
        # waits for its turn (``_ctl_waiting``: no pipe write when nobody waits).
        self._turn = Bell()
        self._ctl_waiting = False
        self._started = time.monotonic()
        self._waited_us = 0  # written by whichever thread runs an exchange (one at a time)
        self._failed_with: BaseException | None = None
        self._stolen = StolenTime(f"resilient-stolen-{rank}")
        self._thread = threading.Thread(
            target=self._loop, name=f"resilient-ctl-{rank}", daemon=True
        )
        self._thread.start()

    def submit(
        self,
        sig: Signature,
        payload: Payload | None = None,
        *,
        after_previous: bool = False,
    ) -> Ticket:
        """Schedule the exchange of ``sig``; :meth:`result` gives its :class:`Exchange`.

        With ``after_previous`` (or a ``payload``) the exchange waits until every
        earlier call was marked done. Called from one thread at a time, in order.
        """
        self._submitted += 1
        seq = self._submitted
        quiet = after_previous or payload is not None
        # The communication thread busy with an earlier call: agree on this one
        # meanwhile. Otherwise it runs the exchange itself as it takes the call up.
        by_ctl = not quiet and self._done < seq - 1
        ticket = Ticket(seq, sig.with_seq(seq), payload, by_ctl)
        if by_ctl:
            self._queue.put(ticket)
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
        """The ticket's exchange, run here when it is the communication thread's, else
        waited for on the channel's bell (resilient._handoff): the control thread
        then never wakes this thread with the GIL held. Only the communication
        thread calls this, in submission order.

        Raises:
            CollectiveMismatch: the ranks' signatures differ.
            LinkError: a row did not come.
            PeerLost: a peer was lost before the exchange.
        """
        if not ticket.by_ctl and not ticket.settled:
            while self._ran < ticket.seq - 1:  # a control-thread exchange still ending
                self._settled.wait()
            self._run_item(ticket)
        fut = ticket.fut
        while not fut.done():
            self._settled.wait()
        return fut.result()

    def _settle(
        self, ticket: Ticket, exchange: Exchange | None, exc: BaseException | None = None
    ) -> None:
        """Give the ticket its exchange (or ``exc``) and wake whoever waits for it."""
        fut = ticket.fut
        if exchange is not None:
            fut.set_result(exchange)
        else:
            fut.set_exception(exc or RuntimeError("an exchange settled without a result"))
        ticket.settled = True
        with self._ran_lock:  # a call given up may settle while the other thread ends one
            self._ran += 1
        if ticket.by_ctl:
            self._settled.ring()
        elif self._ctl_waiting:
            self._turn.ring()

    def mark_done(self, ticket: Ticket, *, ok: bool = True) -> None:
        """Called by the communication thread after each call, failed (``ok`` False)
        or not, in order (with its ticket: one it never ran is settled here, failed)."""
        if not ticket.by_ctl and not ticket.settled:
            self._settle(ticket, None, self._failed_with or RuntimeError("call ended first"))
        self._done += 1
        if ok and self._succeeded == ticket.seq - 1:
            self._succeeded = ticket.seq

    def fail_pending(self, exc: BaseException) -> None:
        """Fail every exchange not started yet with ``exc`` (a peer is gone: the
        others stopped taking part in this epoch's calls)."""
        self._failed_with = exc

    def stop(self, timeout_s: float) -> bool:
        """Stop the control thread after the exchanges already queued, keeping the
        links; False if it is still busy after ``timeout_s`` (waiting on a peer)."""
        self._queue.put(None)
        self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():
            return False
        self._stolen.close()
        self.engine.close()
        self._release()
        return True

    def abandon(self) -> None:
        """Close this channel and its links in the background (a stuck exchange
        may keep its thread for up to a deadline)."""
        threading.Thread(target=self.close, name=f"ctl-close-{self.rank}", daemon=True).start()

    def close(self) -> None:
        self._queue.put(None)
        self._thread.join(timeout=30)
        self._stolen.close()
        self.engine.close()
        self.engine.links.close()
        if not self._thread.is_alive():
            self._release()

    def _release(self) -> None:
        """Close the hand-off pipes once the control thread is gone (an exchange
        settled already needs no wake-up; one never settled never had one)."""
        self._queue.close()
        self._settled.close()
        self._turn.close()

    def _install(self, exchange: Exchange) -> None:
        """Put control links staged at both ends in service before the next exchange
        (every rank decides from the same table; see resilient._repair)."""
        installed = install_agreed(self.engine.links, exchange.staged, self.rank, CTL_TABLE)
        if installed and self._on_install is not None:
            self._on_install()

    def _loop(self) -> None:
        while True:
            ticket = self._queue.get()
            if ticket is None:
                return
            self._await_turn(ticket.seq)
            self._run_item(ticket)

    def _await_turn(self, seq: int) -> None:
        """Wait until every exchange before ``seq`` settled (one the communication
        thread runs may still be on the wire: rows must meet in order)."""
        while self._ran < seq - 1:
            self._ctl_waiting = True
            # Re-checked after the flag is up: a settle in between rang the bell.
            if self._ran >= seq - 1:
                break
            self._turn.wait()
        self._ctl_waiting = False

    def _run_item(self, ticket: Ticket) -> None:
        seq, sig, payload = ticket.seq, ticket.sig, ticket.payload
        if self._failed_with is not None:
            self._settle(ticket, None, self._failed_with)
            return
        try:
            data = payload() if payload is not None else None
            rates = self._rates() if self._rates is not None else ()
            began = time.monotonic()
            clock = (
                int((began - self._started) * 1e6) - self._waited_us,
                self._waited_us,
                self._stolen.total_us,
            )
            lag = self._lagging() if self._lagging is not None else (-1, 0, 0)
            staged = self._staged() if self._staged is not None else []
            cut = self._cut() if self._cut is not None else ()
            try:
                exchange = check_signatures(
                    self._gather(seq), self.engine.world, sig, self.rank, data, rates, clock,
                    lag, staged, cut,
                )  # fmt: skip
            finally:
                self._waited_us += int((time.monotonic() - began) * 1e6)
            self._finish(ticket, exchange)
        except BaseException as exc:  # the waiting collective re-raises it
            rescued = self._rescued(seq, exc) if payload is not None else None
            if rescued is not None:
                self._finish(ticket, rescued)
            else:
                self._settle(ticket, None, exc)

    def _gather(self, seq: int) -> Callable[[torch.Tensor], None]:
        """How exchange ``seq``'s table is filled: on the heaviest rail by the
        weights agreed in the previous exchange (the same rail on every rank)."""
        engine, mesh = self.engine, self._mesh
        if mesh is None:
            return lambda table: engine.all_gather(table.view(-1))
        rail = max(range(engine.num_rails), key=lambda r: engine.weights[r])
        return lambda table: mesh.all_gather(table, seq, rail)

    def _finish(self, ticket: Ticket, exchange: Exchange) -> None:
        seq = ticket.seq
        self._install(exchange)
        # The next exchange avoids a cut-off pair too (the data call's engine
        # follows the same rows: resilient._reorder).
        follow_cuts(self.engine, exchange)
        if self._rates is not None:
            self.engine.weights = agreed_weights(exchange.rates, self._static, seq)
            self.engine.backups = agreed_backups(exchange.rates, self.engine.num_rails)
        self.last = (seq, exchange.table)
        self._settle(ticket, exchange)

    def _rescued(self, seq: int, exc: BaseException) -> Exchange | None:
        """The exchange ``seq`` as another survivor completed it, when this rank's
        copy failed for a lost peer (see resilient._rescue); else None. Only calls
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
