"""The one exception tree of the project.

Every error the library raises on purpose derives from :class:`ResilientError`,
so a training loop can catch the whole family in one clause. Errors from gloo,
gRPC (etcd) and sockets are translated at the boundary with ``raise ... from exc``
so the original cause stays attached.

::

    ResilientError
    ├── ConfigError                 bad flag, env var, file or argument (also a ValueError)
    ├── MembershipError             the control plane (etcd) refused or failed
    │   ├── EtcdUnavailable         etcd unreachable within the call's time bound
    │   ├── JobTokenMismatch        joined, read or wrote a job with the wrong token
    │   ├── StaleEpoch              lost a compare-and-swap on the epoch counter
    │   ├── LeaseLost               this member's lease expired; the job sees it as gone
    │   └── StoreTimeout            a Store get/wait did not see its keys in time
    ├── CommunicationError          the data plane failed an operation
    │   ├── LinkError               one (rank, rank, rail) link failed or missed its deadline
    │   ├── CollectiveTimeout       a collective as a whole missed its deadline
    │   ├── CollectiveMismatch      ranks called a collective with different arguments
    │   └── PeerLost                a rank of the group is gone (crash, kill, hang)
    ├── RecoveryError               a recovery action could not complete
    │   └── JobFinished             a replacement found the job finished without it
    ├── LauncherError               the local launcher could not start or supervise ranks
    └── ChaosError                  the chaos testbed or a fault injector failed (not root,
                                    a command failed, a target process is gone)
"""

from __future__ import annotations

__all__ = [
    "ChaosError",
    "CollectiveMismatch",
    "CollectiveTimeout",
    "CommunicationError",
    "ConfigError",
    "EtcdUnavailable",
    "JobFinished",
    "JobTokenMismatch",
    "LauncherError",
    "LeaseLost",
    "LinkError",
    "MembershipError",
    "PeerLost",
    "RecoveryError",
    "ResilientError",
    "StaleEpoch",
    "StoreTimeout",
]


class ResilientError(Exception):
    """Root of every error this library raises on purpose."""


class ConfigError(ResilientError, ValueError):
    """A configuration value (flag, env var, argument, file) is invalid."""


class MembershipError(ResilientError):
    """The control plane refused an operation or could not be reached."""


class EtcdUnavailable(MembershipError):
    """etcd could not be reached within the time bound of the call."""


class JobTokenMismatch(MembershipError):
    """A join, or a read or write of the job's keys, presented a token whose hash
    differs from the job's recorded one (``operation`` names the refused call)."""

    def __init__(self, job: str, operation: str | None = None) -> None:
        what = f" ({operation})" if operation else ""
        super().__init__(
            f"job {job!r}{what}: the token does not match the one this job was created "
            "with; nothing of the job was read or changed"
        )
        self.job = job
        self.operation = operation


class StaleEpoch(MembershipError):
    """A compare-and-swap on the epoch lost: another member advanced it first."""

    def __init__(self, job: str, expected: int, current: int) -> None:
        super().__init__(f"job {job!r}: epoch is {current}, not the expected {expected}")
        self.job = job
        self.expected = expected
        self.current = current


class LeaseLost(MembershipError):
    """This member's lease expired or was revoked; the job no longer lists it."""


class StoreTimeout(MembershipError, TimeoutError):
    """A Store ``get``/``wait`` did not see its keys before the timeout."""


class CommunicationError(ResilientError):
    """A data-plane operation failed."""


class LinkError(CommunicationError):
    """One link (rank pair on one rail) failed or missed its deadline."""


class CollectiveTimeout(CommunicationError, TimeoutError):
    """A collective did not complete before its deadline."""


class CollectiveMismatch(CommunicationError):
    """Ranks called a collective with different shapes, dtypes or ops.

    ``calls`` maps each rank to a description of its call; ``fields`` names what differed.
    """

    def __init__(
        self,
        message: str,
        *,
        calls: dict[int, str] | None = None,
        fields: tuple[str, ...] = (),
    ) -> None:
        super().__init__(message)
        self.calls = calls or {}
        self.fields = fields


class PeerLost(CommunicationError):
    """A rank of the group is gone (crashed, killed, hung past its lease).

    ``peer`` is the lost rank (-1 when unknown), ``epoch`` the epoch it was lost in.
    """

    def __init__(self, message: str, *, peer: int = -1, epoch: int = 0) -> None:
        super().__init__(message)
        self.peer = peer
        self.epoch = epoch


class RecoveryError(ResilientError):
    """A recovery action (repair, restore, replay) could not complete."""


class JobFinished(RecoveryError):
    """A replacement waiting to be admitted found that every other member of the
    epoch finished all its steps and shut its group down: nobody is left to admit
    it, and there is nothing left to train (:mod:`recovery.finish`)."""


class LauncherError(ResilientError):
    """The local launcher could not start or supervise its ranks."""


class ChaosError(ResilientError):
    """The chaos testbed could not be built or torn down, or a fault could not be injected."""
