"""Data plane and user-facing entry points of the resilient communicator.

Importing this package is cheap: torch is imported only when a data-plane name
(``init``, ``register``, ``ResilientProcessGroup``) is first used, so the CLI starts
fast. If torch is already imported, the ``"resilient"`` backend is registered right
away, so ``import resilient`` then ``dist.init_process_group("resilient")`` works.
"""

import sys

from resilient.config import EtcdConfig, MembershipConfig, RankEnv
from resilient.errors import (
    CollectiveMismatch,
    CollectiveTimeout,
    CommunicationError,
    ConfigError,
    EtcdUnavailable,
    JobTokenMismatch,
    LauncherError,
    LeaseLost,
    LinkError,
    MembershipError,
    PeerLost,
    RecoveryError,
    ResilientError,
    StaleEpoch,
    StoreTimeout,
)

__all__ = [
    "CollectiveMismatch",
    "CollectiveTimeout",
    "CommunicationError",
    "ConfigError",
    "EtcdConfig",
    "EtcdUnavailable",
    "JobTokenMismatch",
    "LauncherError",
    "LeaseLost",
    "LinkError",
    "MembershipConfig",
    "MembershipError",
    "PeerLost",
    "RankEnv",
    "RecoveryError",
    "ResilientError",
    "ResilientProcessGroup",
    "StaleEpoch",
    "StoreTimeout",
    "init",
    "register",
]

_LAZY = {
    "init": "resilient.backend",
    "register": "resilient.backend",
    "ResilientProcessGroup": "resilient.process_group",
}


def __getattr__(name: str) -> object:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module 'resilient' has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(module), name)


if "torch.distributed" in sys.modules:
    from resilient.backend import register as _register

    _register()
