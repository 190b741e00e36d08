"""Control plane: job membership, epochs, watches and health records in etcd v3.

Also an embedded etcd for local runs and tests, and an etcd-backed
``torch.distributed.Store`` for rendezvous without a TCPStore on rank 0.
"""

from membership._etcd import EtcdClient
from membership.health import HealthPublisher
from membership.members import MemberInfo, Membership
from membership.server import EmbeddedEtcd, EtcdCluster, ServerTLS, find_etcd_binary
from membership.watch import PrefixWatch, WatchEvent

__all__ = [
    "EmbeddedEtcd",
    "EtcdClient",
    "EtcdCluster",
    "EtcdStore",
    "HealthPublisher",
    "MemberInfo",
    "Membership",
    "PrefixWatch",
    "ServerTLS",
    "WatchEvent",
    "find_etcd_binary",
]


def __getattr__(name: str) -> object:
    # EtcdStore needs torch; importing it lazily keeps `import membership` light.
    if name == "EtcdStore":
        from membership.store import EtcdStore

        return EtcdStore
    raise AttributeError(f"module 'membership' has no attribute {name!r}")
