"""The communication thread of a process group: its calls run there one at a time,
in the order they were issued (every rank issues them in the same order), each
after its signature exchange (or elided: :class:`~resilient.check.elision.ElidedCalls`).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from datetime import timedelta
from typing import Any, Protocol

import torch
from torch.futures import Future

from resilient.check.elision import CHECKED, ElidedCalls
from resilient.check.exchange import Payload
from resilient.collectives.signature import Exchange, Signature
from resilient.errors import CommunicationError, PeerLost, RecoveryError, ResilientError
from resilient.group.epoch_control import EpochControl
from resilient.group.handoff import Handoff
from resilient.group.work import Failed, ResilientWork

__all__ = ["CallRunner", "Submit"]

logger = logging.getLogger(__name__)


class Submit(Protocol):
    """Queues a call on the group's communication thread (:meth:`CallRunner.submit`);
    what the families of calls (rooted, all_to_all) are given."""

    def __call__(
        self,
        op: str,
        sig: Signature,
        fn: Callable[[torch.Tensor | None], Any],
        /,
        *,
        payload: Payload | None = None,
        after_previous: bool = False,
        digest: int = 0,
        devices: Sequence[torch.device] = (),
    ) -> ResilientWork: ...


class CallRunner:
    """Runs the calls of rank ``rank``'s group in the epoch ``epochs`` runs."""

    def __init__(self, rank: int, epochs: EpochControl) -> None:
        self._rank, self._epochs = rank, epochs
        # Calls submitted and finished: the peer watch looks only while some run.
        self._calls_in, self._calls_out = 0, 0
        self.closed = False  # set by the group's shutdown: no call is taken after it
        # How long a work's wait() waits by default (the group's timeout), or None.
        self.timeout: timedelta | None = None
        self._queue: Handoff[tuple[Callable[[], Any], Future[Any]] | None] = Handoff()
        self._thread = threading.Thread(
            target=self._loop, name=f"resilient-comm-{rank}", daemon=True
        )
        self._thread.start()

    def _loop(self) -> None:
        while True:
            item = self._queue.get()
            if item is None:
                return
            fn, fut = item
            try:
                fut.set_result(fn())
            except BaseException as exc:  # delivered to whoever waits on the work
                if not isinstance(exc, ResilientError):
                    logger.exception("rank %d: collective failed", self._rank)
                fut.set_result(Failed(exc))

    def busy(self) -> bool:
        """Whether calls were submitted that have not finished."""
        return self._calls_in != self._calls_out

    def submit(
        self,
        op: str,
        sig: Signature,
        fn: Callable[[torch.Tensor | None], Any],
        *,
        payload: Payload | None = None,
        after_previous: bool = False,
        digest: int = 0,
        devices: Sequence[torch.device] = (),
    ) -> ResilientWork:
        """Queue ``fn(table)``: ``table`` holds every rank's inline bytes once the
        signatures matched (an empty tensor for a call without ``payload``; None with
        checks off); a mismatch raises before ``fn``. ``digest``: the call's, when
        it may run elided (resilient.collectives.digest_check: a CPU all_reduce with no payload).
        ``devices``: the CUDA devices of the call's tensors, which its future carries
        (``torch.futures.Future(devices=...)``: waiters' streams wait for its result).

        Raises:
            RuntimeError: the group is shut down.
        """
        if self.closed:
            raise RuntimeError(f"resilient process group is shut down; cannot run {op}")
        epochs = self._epochs
        checks, elided = epochs.checks, epochs.elided
        # What this rank's health board had published before the row was built: an
        # elided call after a quiet verdict carries news if it has changed since.
        mark = epochs.board.changes
        ticket = checks.submit(sig, payload, after_previous=after_previous) if checks else None

        def run() -> Any:
            ok = False
            try:
                if (lost := epochs.lost) is not None:
                    raise PeerLost(str(lost), peer=lost.peer, epoch=epochs.epoch)
                if checks is None or ticket is None:
                    out = fn(None)
                elif checks.take_elided(ticket):
                    assert elided is not None  # made with the checks
                    out = elided.run(ticket, fn, payload, digest)
                else:
                    out = self._run_checked(checks.result(ticket), elided, sig, fn, payload, mark)
                ok = True
                return out
            except CommunicationError as exc:
                if isinstance(exc, PeerLost) or (lost := epochs.peer_loss.await_lost()) is None:
                    raise
                raise lost from exc
            finally:
                if checks is not None and ticket is not None:
                    checks.mark_done(ticket, ok=ok)
                self._calls_out += 1

        fut: Future[Any] = Future(devices=list(devices))
        self._calls_in += 1
        self._queue.put((run, fut))
        return ResilientWork(fut, op, self.timeout)

    def _run_checked(
        self,
        exchange: Exchange,
        elided: ElidedCalls | None,
        sig: Signature,
        fn: Callable[[torch.Tensor | None], Any],
        payload: Payload | None,
        mark: int,
    ) -> Any:
        """Run ``fn`` after its full exchange: every rank acts on the same verdict
        first (EpochControl.follow), and it decides whether the next calls may
        elide (``mark``: the board's changes when the call was made)."""
        self._epochs.follow(exchange)
        assert elided is not None  # made with the checks
        elided.settle(exchange, sig, mark)
        # Only calls that carry payloads read them (a view per call otherwise).
        return fn(exchange.payloads() if payload is not None else CHECKED)

    def wait_idle(self, timeout_s: float) -> None:
        """Wait until every call queued so far has run (failed or not).

        Raises:
            RecoveryError: the communication thread is still busy after ``timeout_s``.
        """
        idle = threading.Event()
        marker: Future[Any] = Future()
        self._queue.put((idle.set, marker))
        if not idle.wait(timeout_s):
            raise RecoveryError(
                f"rank {self._rank} (epoch {self._epochs.epoch}): calls of the failed step "
                f"still running after {timeout_s:.1f} s"
            )

    def stop(self, timeout_s: float) -> bool:
        """Let the queued calls finish and end the thread; whether it ended within
        ``timeout_s`` (else the queue stays open for it)."""
        self._queue.put(None)
        self._thread.join(timeout=timeout_s)
        if self._thread.is_alive():
            return False
        self._queue.close()
        return True
