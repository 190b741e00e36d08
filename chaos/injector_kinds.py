"""Which injector a fault gets: a real one, or a record for the loopback testbed.

On the netns testbed every fault kind has a real injector (:mod:`chaos.injectors`,
:mod:`chaos.slow_link`, :mod:`chaos.node_faults` for whole nodes).
On the loopback testbed there is no NIC to take down, so network faults become
records that the ranks' in-process fault hook applies (:mod:`chaos.loopback_faults`).
"""

from __future__ import annotations

from chaos.etcd_leader import EtcdLeaderKill
from chaos.injectors import NETNS_KINDS, InjectionContext, Injector, needs_netns
from chaos.loopback_faults import LOOPBACK_KINDS
from chaos.node_faults import NODE_INJECTORS
from chaos.scenario import Fault
from chaos.slow_link import SlowLink
from resilient.errors import ChaosError

__all__ = ["make_injector"]


def make_injector(fault: Fault, ctx: InjectionContext) -> Injector:
    """The injector for ``fault``: a real one on the netns testbed, an in-process one
    (through ``ctx.control``) for network faults on the loopback testbed.

    Raises:
        ChaosError: an unknown kind.
    """
    if needs_netns(fault) and ctx.testbed.kind == "loopback" and ctx.control is not None:
        if fault.kind not in LOOPBACK_KINDS:
            raise ChaosError(
                f'{fault.kind}: needs the netns testbed (topology = "netns", as root); '
                "the loopback testbed has no per-link shaping"
            )
        return LOOPBACK_KINDS[fault.kind](fault, ctx)
    kinds: dict[str, type[Injector]] = {
        **NETNS_KINDS, **NODE_INJECTORS, "slow-link": SlowLink, "etcd-leader-kill": EtcdLeaderKill,
    }  # fmt: skip
    try:
        cls = kinds[fault.kind]
    except KeyError as exc:
        raise ChaosError(f"no injector for fault kind {fault.kind!r}") from exc
    return cls(fault, ctx)
