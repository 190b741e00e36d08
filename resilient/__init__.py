"""Data plane and user-facing entry points of the resilient communicator.

Importing this package is cheap (no torch): the CLI and the config/error types
live here; the process group arrives with the data-plane work.
"""

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
    "StaleEpoch",
    "StoreTimeout",
]
