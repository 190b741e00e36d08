"""Control plane: job membership, watches and health records in etcd v3, and the
job's epoch (:mod:`membership.epoch`: one counter in the job's store).

Also an embedded etcd for local runs and tests, and an etcd-backed
``torch.distributed.Store`` for rendezvous without a TCPStore on rank 0.
"""

import os

# gRPC runs fork handlers that wait for its own threads to quiesce; a fork() while
# one of them is busy can then hang for good (seen once in this project's tests: a
# subprocess.Popen of etcd stuck in cygrpc's prefork handler, 10 minutes; the
# family of grpc/grpc#37259). Nothing here uses gRPC in a forked child before exec
# (ranks and etcd are exec'd, multiprocessing uses spawn), so the handlers are off
# unless the user chose otherwise. Set before the first import of grpc.
os.environ.setdefault("GRPC_ENABLE_FORK_SUPPORT", "false")

from membership.etcd_client import EtcdClient
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
