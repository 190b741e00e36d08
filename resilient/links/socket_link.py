"""Links over plain TCP sockets: collectives without gloo's handshakes and event loop.

A :class:`SocketLink` is a :class:`~resilient.links.link.Link` whose group is a
:class:`~resilient.links.socket_pair.SocketPair`: it speaks the little of
``ProcessGroupGloo`` a link uses (``send``, ``recv``, ``allreduce`` for the repair
probe, ``shutdown``), so every failover, cut, stall and repair rule of links
applies unchanged; the connection is the link's own and bound to the rail's
address, so cutting it, reading its ``TCP_INFO`` and telling a peer's close all
work as for gloo's, and a cut ends a wait at once (no helper threads, see
:mod:`resilient.links.gloo_wait`). How the bytes move: :mod:`resilient.links.socket_pair`
and :mod:`resilient.links.socket_engine`.

Control links (the signature exchange, ``control_transport``): over two-rank gloo
groups each 2.4 KB row costs gloo's rendezvous for unbound buffers (the sender
announces it, the receiver answers when its receive is posted, then the bytes go)
and several wake-ups of the device's event-loop thread. Measured (4 ranks, 2 cores,
a mesh all-gather of one row each, 2000 calls): gloo pairs 2.6 ms a call and 0.96
ms of CPU per rank, plain sockets 0.065 ms and 0.025 ms.

Data links (``data_transport``, CPU tensors): gloo's ``send`` takes the pair's
mutex, which its event loop holds while it reads, so a rank that sends to a slow
peer blocked up to 45 ms inside ``send`` before it could fold what it had
received (docs/BENCHMARKS.md, 2026-12-02). Over sockets the waiting thread moves
every link's bytes itself, without a hand-off to an event loop.
"""

from __future__ import annotations

import logging
from collections.abc import Callable

import torch.distributed as dist
from torch._C._distributed_c10d import PrefixStore, Store

from resilient.errors import LinkError
from resilient.links import gloo_sockets
from resilient.links.ledger import tag_salt
from resilient.links.link import Link
from resilient.links.socket_connect import PairError, connect_pair
from resilient.links.socket_engine import SocketWork, engine
from resilient.links.socket_pair import SocketPair

__all__ = ["PairError", "SocketLink", "SocketPair", "SocketWork", "connect_pair"]

logger = logging.getLogger(__name__)


class SocketLink(Link):
    """A :class:`~resilient.links.link.Link` over a :class:`SocketPair`; the pairs of one
    kind of link (data, control) share one engine per process."""

    cut_wakes_waits = True
    takes_bytes = True

    def sent(self) -> tuple[int, int, int, int] | None:
        """As :meth:`Link.sent`, read on the pair's own socket (the send-rate meter
        reads every data link's after most large reductions)."""
        pg = self.pg
        return (
            gloo_sockets.sent_of(pg.tcp_info(gloo_sockets.SENT_INFO_BYTES))
            if pg is not None
            else None
        )

    # The peer watch reads these of every link 20 times a second while calls run:
    # on the pair's own socket that is one system call, where through the
    # descriptor number it is a duplicate and a check of it first (both reads:
    # 15.9 -> 3.6 us a link, warm).
    def _read_before_close(self) -> None:
        """Read what the peer sent before its close (:meth:`SocketPair.drain`): a
        peer that sent its last messages (a job's final barrier) and exited shows as
        closed to the kernel while a slower rank has yet to read them, and failing
        the pair would lose them. They complete their receives, or wait in the stash."""
        pg = self.pg
        if pg is not None and pg.unread() > 0:
            pg.drain()

    def _states(self) -> list[int | None]:
        pg = self.pg
        return [gloo_sockets.state_of(pg.tcp_info(1))] if pg is not None else super()._states()

    def _progresses(self) -> list[gloo_sockets.Progress | None]:
        pg = self.pg
        if pg is None:
            return super()._progresses()
        return [gloo_sockets.progress_of(pg.tcp_info(gloo_sockets.PROGRESS_INFO_BYTES))]

    # Control rows (resilient.check.control_mesh) are byte views: one per row serves every
    # peer, where a tensor is viewed as bytes again for each op. As isend/irecv.
    def isend_bytes(self, view: memoryview, tag: int) -> SocketWork:
        """Post a send of ``view``; raises LinkError as :meth:`Link.isend` does."""
        return self._post_bytes("send", view, tag)

    def irecv_bytes(self, view: memoryview, tag: int) -> SocketWork:
        """Post a receive into ``view``; raises LinkError as :meth:`Link.irecv` does."""
        return self._post_bytes("recv", view, tag)

    def _post_bytes(self, what: str, view: memoryview, tag: int) -> SocketWork:
        self._injected_failure(what)
        pg = self.pg
        if pg is None:
            raise self._failed(f"{self}: {what} on a link that is not built or is closed")
        sending = what == "send"
        post = pg.send_bytes if sending else pg.recv_bytes
        work: SocketWork = post(view, self.ledger.tag(tag))
        if sending:
            self.tx_ops += 1
        else:
            self.rx_ops += 1
        self.ledger.posted(work)
        return work

    def renew(self, epoch: int) -> None:
        """As :meth:`Link.renew`, and drop the receives of the epoch just left, with
        their messages: one whose send did come would otherwise land in its buffer
        during this epoch, which may be using that buffer (resilient.links.ledger).

        Only that epoch's salt: earlier ones were dropped on entering the epochs
        after them, and forgetting every salt ever left would, once salts come
        round (resilient.links.ledger.SALTS), discard messages of the *next* epoch
        that a peer entering it first sends ahead."""
        left = self.ledger.salt
        super().renew(epoch)
        if self.pg is None or left == self.ledger.salt:
            return
        dropped = self.pg.forget(
            lambda tag: tag_salt(tag) == left,
            f"{self!r}: its call was given up",
            self.ledger.slot,
        )
        if dropped:
            logger.debug(
                "rank %d (epoch %d): %r dropped %d receive(s) of a given-up call",
                self.rank, epoch, self, dropped,
            )  # fmt: skip

    def _interrupt(self, why: str) -> None:
        pg = self.pg
        if pg is not None:
            pg.fail(why)

    def _rendezvous(
        self,
        store: Store,
        index: int,
        address: str,
        over: Callable[[], bool] | None,
        *,
        met: bool = False,
        background: bool = False,
    ) -> None:
        own = PrefixStore(self.prefix, store)
        try:
            sock = connect_pair(
                own, index, address, self.config.connect_timeout_s, over, self.prefix.encode()
            )
        except (OSError, RuntimeError, dist.DistError) as exc:
            raise LinkError(
                f"link {self.rank}<->{self.peer} rail {self.rail} ({address}): "
                f"socket rendezvous failed: {exc}"
            ) from exc
        self.pg = SocketPair(sock, engine(self.prefix.split("/", 1)[0]))
        self._conns = [gloo_sockets.Conn.of(sock)]
