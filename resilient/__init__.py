"""Data plane and user-facing entry points of the resilient communicator.

Importing this package is cheap: torch is imported only when a data-plane name
(``init``, ``register``, ``ResilientProcessGroup``) is first used, so the CLI starts
fast. The ``"resilient"`` backend is registered by name in any import order: torch
calls :func:`torch_autoload` at the end of ``import torch`` (an entry point), and
importing this package after torch calls it too.
"""

import sys
from typing import Any

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
    "torch_autoload",
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


def _create_group(options: Any, backend_options: Any = None) -> Any:
    # What torch calls to make a group: the data plane is imported only now.
    from resilient.backend import create_group

    return create_group(options, backend_options)


def torch_autoload() -> None:
    """Register the ``"resilient"`` backend by name (idempotent), without importing
    the data plane: that happens when torch first makes a group of it.

    torch calls this at the end of ``import torch`` (the ``torch.backends`` entry
    point in pyproject.toml), so ``init_process_group("resilient")`` works whatever
    was imported first; ``TORCH_DEVICE_BACKEND_AUTOLOAD=0`` turns that off, and then
    ``import resilient`` after torch, or ``resilient.register()``, does it.
    """
    import torch.distributed as dist

    if dist.is_available() and "resilient" not in dist.Backend.backend_list:
        dist.Backend.register_backend(
            "resilient", _create_group, devices=["cpu", "cuda"], extended_api=True
        )


if "torch.distributed" in sys.modules:
    torch_autoload()
