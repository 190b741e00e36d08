"""``etcd-leader-kill``: SIGKILL whichever member of the scenario's etcd leads now.

The leader is found when the fault fires, from each member's ``/metrics``
(``etcd_server_is_leader 1``; over TLS with the client certificate of
``RESILIENT_ETCD_*``, :mod:`chaos.etcd_security`); the remaining members elect a
new one. With ``duration_s`` the killed member is restarted on stop and rejoins
as a follower. The report's fault detail names the member (``member``).
"""

from __future__ import annotations

import logging
import os
import ssl
import urllib.error
import urllib.request
from typing import TYPE_CHECKING, Any, Final

from chaos.injectors import Injector
from resilient.errors import ChaosError

if TYPE_CHECKING:
    from membership.server import EtcdCluster

__all__ = ["EtcdLeaderKill", "is_leader", "leader_of"]

logger = logging.getLogger(__name__)

_PROBE_S: Final = 2.0


def is_leader(metrics: str) -> bool:
    """Whether an etcd ``/metrics`` text says its member leads."""
    for line in metrics.splitlines():
        if line.startswith("etcd_server_is_leader "):
            return float(line.split()[1]) == 1.0
    return False


def _context(url: str) -> ssl.SSLContext | None:
    if not url.startswith("https://"):
        return None
    ctx = ssl.create_default_context(cafile=os.environ.get("RESILIENT_ETCD_CA"))
    cert, key = os.environ.get("RESILIENT_ETCD_CERT"), os.environ.get("RESILIENT_ETCD_KEY")
    if cert:
        ctx.load_cert_chain(cert, key)
    return ctx


def leader_of(endpoints: tuple[str, ...]) -> int:
    """The index of the member among ``endpoints`` that leads now.

    Raises:
        ChaosError: no member answered as the leader (none elected, or all down).
    """
    answers = []
    for index, url in enumerate(endpoints):
        try:
            with urllib.request.urlopen(
                f"{url}/metrics", timeout=_PROBE_S, context=_context(url)
            ) as resp:
                text = resp.read().decode(errors="replace")
        except (urllib.error.URLError, OSError) as exc:
            answers.append(f"{url}: {exc}")
            continue
        if is_leader(text):
            return index
        answers.append(f"{url}: follower")
    raise ChaosError(f"etcd-leader-kill: no member leads ({'; '.join(answers)})")


class EtcdLeaderKill(Injector):
    """SIGKILL the etcd leader; restart that member on stop."""

    def __init__(self, *args: Any) -> None:
        super().__init__(*args)
        self.detail: dict[str, Any] = {}
        self._member: int | None = None

    def _etcd(self) -> EtcdCluster:
        etcd = self.ctx.etcd
        if etcd is None:
            raise ChaosError("etcd-leader-kill: this run has no etcd cluster of its own")
        if etcd.size < 3:
            raise ChaosError(
                f"etcd-leader-kill: needs 3+ members to elect another leader (size {etcd.size})"
            )
        return etcd

    def _check(self) -> None:
        self._etcd()

    def _start(self) -> None:
        etcd = self._etcd()
        self._member = leader_of(etcd.endpoints)
        self.detail = {"member": self._member}
        logger.info("etcd-leader-kill: member %d leads; killing it", self._member)
        etcd.kill(self._member)

    def _stop(self) -> None:
        if self._member is None:  # the leader was never found: nothing was killed
            return
        try:
            self._etcd().restart(self._member)
        except Exception as exc:
            raise ChaosError(
                f"etcd-leader-kill: member {self._member} did not come back: {exc}"
            ) from exc
