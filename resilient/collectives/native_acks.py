"""The acknowledgements of a call's C steps on several rails (resilient.collectives.failover).

On one rail nothing can fail over, so a call exchanges no acknowledgements. On
several, a sender may return only once its receiver consumed everything: until
then a failover may have to re-send. The Python path's channels do it with one
small message per channel and call: the receiver's :class:`~.failover.Rx` sends it
once it has every message, the sender's :class:`~.failover.Tx` waits for it.

A call's last C step (resilient.links.native_steps) carries the same frames, so
the C path and the Python path stay interchangeable at any point of a call: per
pair, the acknowledgement this rank sends once the last message from that peer is
whole (the step's ``after_recv``), and the one it receives. :meth:`StepAcks.split`
takes them out of a stopped step's hand-back, for the channels to finish where the
step left them; :meth:`StepAcks.ran_whole` leaves what ``Rx.finish`` would: a
record a later break of the link publishes, for a peer whose sender has not read
our acknowledgement yet.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Final

import torch

from resilient.collectives.failover import ack_tag, finished_receiving
from resilient.links.byte_views import bytes_of

if TYPE_CHECKING:
    from resilient.collectives.route import Route
    from resilient.links.native_steps import Step
    from resilient.links.table import Link

__all__ = ["StepAcks", "acked"]

_ACK_BYTES: Final = 8
# What every acknowledgement carries (Rx sends ones; Tx does not read it).
_ONE: Final = torch.ones(1, dtype=torch.int64)
_ONE_BYTES: Final = bytes_of(_ONE)


def acked(route: Route) -> bool:
    """Whether a call on ``route`` acknowledges its messages (several rails)."""
    return len(route.links.rails) > 1


class StepAcks:
    """The acknowledgements one C step adds for a call on ``rail``."""

    def __init__(self, route: Route, rail: int, pairs: int) -> None:
        """``pairs``: at most how many acknowledgements are received (one buffer each)."""
        self.route, self.rail = route, rail
        self._into = torch.zeros(max(1, pairs), dtype=torch.int64)
        self._raw, self._base = bytes_of(self._into), self._into.data_ptr()
        # (peer, link, send index) and (peer, receive index) in the step.
        self._given: list[tuple[int, Link, int]] = []
        self._expected: list[tuple[int, int]] = []

    def give(self, step: Step, i: int, peer: int, link: Link) -> None:
        """Send ``peer`` (pair ``i`` of ``step``) its acknowledgement once the step's
        last message from it is whole. Add after every message of the step."""
        last = max((k for k, m in enumerate(step.recvs) if m[0] == i), default=-1)
        tag = link.ledger.tag(ack_tag(self.route, self.rail))
        idx = step.send(i, tag, 0, _ONE_BYTES, _ONE.data_ptr(), 0, _ACK_BYTES, after_recv=last)
        self._given.append((peer, link, idx))

    def expect(self, step: Step, i: int, peer: int, link: Link) -> None:
        """Receive ``peer``'s acknowledgement of what we sent it (pair ``i``)."""
        tag = link.ledger.tag(ack_tag(self.route, self.rail))
        at = len(self._expected) * _ACK_BYTES
        idx = step.recv(i, tag, 0, self._raw, self._base, at, _ACK_BYTES)
        self._expected.append((peer, idx))

    def split(
        self, sent: list[Any], got: list[Any]
    ) -> tuple[list[Any], list[Any], dict[int, Any], dict[int, Any]]:
        """A stopped step's hand-back without the acknowledgements (which are its
        last messages): the data's, then per peer what the step did of the
        acknowledgement received (for Tx) and of the one sent (for Rx)."""
        tx = {peer: got[idx] for peer, idx in self._expected}
        rx = {peer: sent[idx] for peer, _, idx in self._given}
        n_sent = len(sent) - len(self._given)
        n_got = len(got) - len(self._expected)
        return sent[:n_sent], got[:n_got], tx, rx

    def ran_whole(self) -> None:
        """The step moved everything, acknowledgements included."""
        for peer, link, _ in self._given:
            finished_receiving(self.route, peer, self.rail, link)
