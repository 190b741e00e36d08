"""The two-rank process groups a :class:`~resilient.links.link.Link` runs over.

A CPU link over gloo (``data_transport`` or ``control_transport`` "gloo") is a
two-rank gloo group bound to this rank's address on the rail, its connection found
and watched through :mod:`resilient.links.gloo_sockets`; a CUDA link is a two-rank
NCCL communicator. Socket links (the default for CPU links,
:mod:`resilient.links.socket_link`) build no group: their pair is a plain socket.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any, Final

from torch._C._distributed_c10d import ProcessGroupGloo, Store

from resilient.config import DataPlaneConfig
from resilient.links import gloo_connects, gloo_sockets

__all__ = ["build_gloo", "gloo_pair", "nccl_pair"]

# gloo waits five times its timeout for a pair's connection (tcp Pair::
# waitUntilConnected), so a rendezvous whose peer gave up lasted 5x its bound
# (measured: 26 s past a 5 s bound, on a flapping NIC). Where both ends are known
# to be at the rendezvous already (first builds of several rails, repairs), gloo
# gets a fifth of the bound. A pair that gives up while its SYN is still pending
# would leave gloo's connect callback bound to freed memory (SIGSEGV once a
# partition healed): resilient.links.gloo_connects ends such an attempt first.
_GLOO_CONNECT_FACTOR: Final = 5
_MIN_GLOO_TIMEOUT_S: Final = 0.5

_DEVICES: dict[str, Any] = {}
_DEVICES_LOCK = threading.Lock()


def _rail_device(address: str) -> Any:
    """One gloo device per rail address, shared by every link on that rail.

    Each gloo device runs its own event-loop thread; one per link would mean a
    thread per peer and rail, and on a busy CPU their wake-ups cost more than the
    transfers. Links stay separate groups (separate pairs and failure domains); a
    rail's links share its NIC anyway.
    """
    with _DEVICES_LOCK:
        device = _DEVICES.get(address)
        if device is None:
            device = _DEVICES[address] = ProcessGroupGloo.create_device(hostname=address)
        return device


def gloo_pair(store: Store, index: int, address: str, timeout_s: float) -> Any:
    """A two-rank gloo group; gloo's timeout ``timeout_s`` bounds its store waits,
    five times it the wait for the connection."""
    opts: Any = getattr(ProcessGroupGloo, "_Options")()  # noqa: B009 - private, untyped
    opts._timeout = timedelta(seconds=timeout_s)
    opts._devices = [_rail_device(address)]
    return ProcessGroupGloo(store, index, 2, opts)


def build_gloo(
    store: Store,
    index: int,
    address: str,
    config: DataPlaneConfig,
    over: Callable[[], bool] | None,
    *,
    peer: int,
    label: str,
    met: bool = False,
    background: bool = False,
) -> tuple[Any, list[gloo_sockets.Conn]]:
    """A gloo pair bound to ``address`` and its connections (found as gloo makes
    them, to cut and watch later). ``met``: both ends are known to be at this
    rendezvous already, so the whole rendezvous is bounded by
    ``connect_timeout_s``; ``background``: a repair (see gloo_sockets.capture);
    ``label`` names the link in logs.

    Raises:
        RuntimeError, DistError: the rendezvous failed or timed out.
    """
    bound = timeout = config.connect_timeout_s
    if met:
        timeout = max(bound / _GLOO_CONNECT_FACTOR, _MIN_GLOO_TIMEOUT_S)
    with (
        gloo_sockets.capture(bound, over, address=address, peer=peer, background=background) as got,
        gloo_connects.unanswered_aborted(store, index, address, timeout, label),
    ):
        pg = gloo_pair(store, index, address, timeout)
    return pg, gloo_sockets.pair_up(store, index, got, config.connect_timeout_s, address)


def nccl_pair(store: Store, index: int, config: DataPlaneConfig) -> Any:
    """A two-rank NCCL communicator for CUDA tensors (ranks on distinct GPUs).

    NCCL picks its own NIC (NCCL_SOCKET_IFNAME / NCCL_IB_HCA), so a CUDA link is not
    bound to one rail's address the way a gloo link is; the rail split still gives
    each rail its own communicator and its own share of the bytes.
    """
    from torch.distributed import ProcessGroupNCCL  # absent from CPU-only builds

    opts: Any = ProcessGroupNCCL.Options()
    opts._timeout = timedelta(seconds=config.connect_timeout_s)
    return ProcessGroupNCCL(store, index, 2, opts)
