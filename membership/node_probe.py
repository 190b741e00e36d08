"""Telling a dead node agent from a silent one, faster than its lease.

A node whose agent and ranks were killed is otherwise known lost only once its
node lease lapses in etcd (the lease TTL, 5 s by default), and a spare's
replacements cannot start before that. Yet the machine's own kernel knows at once:
each agent keeps a :class:`Beacon`, a listening TCP socket, and publishes its
address in its node record (``NodeInfo.probe``). While the agent lives, a connect
to it succeeds; once the agent process is gone, the kernel closes the socket and
answers the next connect with a reset (``ECONNREFUSED``). Nothing else refuses:
a cut network, a dead machine or a stopped (SIGSTOP) agent give a timeout or
no answer, which proves nothing, and those nodes wait for their leases as
before (no split brain: a partitioned agent is never declared dead here).

An agent proven dead (:func:`refused`, twice) has lost its ranks too: they run
with a parent-death signal (:mod:`resilient.procs`), so the kernel killed them
with it. :func:`evict` then revokes the node's lease and its ranks' member
leases, so etcd drops those keys at once and every reader (spares, the other
agents, the survivors' recovery) sees what the lease expiry would have shown.
"""

from __future__ import annotations

import contextlib
import logging
import socket
import threading
import time
from collections.abc import Iterable
from typing import Final
from urllib.parse import urlsplit

from membership.etcd_client import EtcdClient
from membership.keys import JobKeys
from membership.node_info import NodeInfo
from resilient.errors import MembershipError

__all__ = ["Beacon", "evict", "open_beacon", "refused"]

logger = logging.getLogger(__name__)

# One connect's bound: an agent's kernel answers within a round trip; a timeout
# proves nothing, so a short one only ends the doubt sooner.
_CONNECT_S: Final = 0.3
# Two refusals this far apart: one stray reset (a port being rebound) is not death.
_AGAIN_S: Final = 0.1


class Beacon:
    """A listening socket that lives and dies with this process; see the module
    docstring. ``address``: ``host:port`` as other machines reach it."""

    def __init__(self, toward: str) -> None:
        """Listen on every interface; ``toward`` (an etcd URL) picks the address
        to publish: the one this machine uses to reach etcd, which the other
        agents reach too.

        Raises:
            OSError: no socket could be bound.
        """
        self._sock = socket.create_server(("0.0.0.0", 0), backlog=64)
        port = self._sock.getsockname()[1]
        self.address = f"{_source_address(toward)}:{port}"
        self._closed = False
        # Accepts and drops each probe, so the backlog never fills (a full one
        # would leave connects unanswered, a timeout: no proof either way).
        self._thread = threading.Thread(target=self._serve, name="node-beacon", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        while not self._closed:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            conn.close()

    def close(self) -> None:
        self._closed = True
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()


def open_beacon(toward: str, job: str) -> Beacon | None:
    """A :class:`Beacon`, or None (logged) when no socket could be bound: the node
    is then found lost by its lease alone."""
    try:
        return Beacon(toward)
    except OSError as exc:
        logger.warning("job %s: no node beacon (%s); a dead node is known by its lease", job, exc)
        return None


def _source_address(toward: str) -> str:
    """This machine's address on the route to ``toward``'s host (no packet sent)."""
    parts = urlsplit(toward if "//" in toward else f"//{toward}")
    host, port = parts.hostname or "127.0.0.1", parts.port or 2379
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            s.connect((host, port))
            return str(s.getsockname()[0])
        except OSError:
            return socket.gethostname()


def refused(address: str, *, tries: int = 2) -> bool:
    """Whether the agent at ``address`` (``host:port``) is dead: ``tries`` connects
    in a row, ``_AGAIN_S`` apart, each refused by its machine. False on any
    success, timeout or other error (no proof), and for an empty address."""
    host, _, port = address.rpartition(":")
    if not host or not port.isdigit():
        return False
    for i in range(tries):
        if i:
            time.sleep(_AGAIN_S)
        try:
            with socket.create_connection((host, int(port)), timeout=_CONNECT_S):
                return False
        except ConnectionRefusedError:
            continue
        except OSError:
            return False
    return True


def evict(client: EtcdClient, keys: JobKeys, node: int, ranks: Iterable[int], probed: str) -> bool:
    """Revoke dead ``node``'s lease and its ``ranks``' member leases (see the module
    docstring), so their keys go now rather than when the leases lapse. Only the
    leases of the agent whose beacon at ``probed`` refused: False (nothing done)
    when the node's key is gone or held by another agent already (a spare that
    claimed it after another prober evicted it: its lease must live).

    Raises:
        MembershipError: etcd refused or did not answer (a lease already gone is
            fine: etcd reports it as not found, which counts as done).
    """
    wanted = set(ranks)
    # The members first, then the node key: while the dead agent's key is still
    # there no spare has claimed the node, so no replacement holds a member key
    # yet, and every member lease read here is of the dead node's ranks.
    members, _ = client.get_prefix(keys.members)
    row = client.get(keys.node(node))
    try:
        holder = NodeInfo.from_json(row.value).probe if row is not None else None
    except (ValueError, KeyError, TypeError):
        holder = None
    if row is None or holder != probed:
        return False
    leases = [row.lease] if row.lease else []
    for kv in members:
        rank = kv.key.rsplit("/", 1)[-1]
        if rank.isdigit() and int(rank) in wanted and kv.lease:
            leases.append(kv.lease)
    for lease in leases:
        try:
            client.revoke_lease(lease)
        except MembershipError as exc:
            if "not found" not in str(exc).lower():
                raise
    logger.warning(
        "node %d: its agent's machine refused its beacon (the agent is dead); revoked "
        "%d lease(s) of the node and its ranks %s",
        node, len(leases), sorted(wanted),
    )  # fmt: skip
    return True
