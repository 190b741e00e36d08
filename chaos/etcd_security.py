"""A scenario's etcd with its security on (``[job] etcd_security = true``): TLS with
client certificates, and user/password auth with the job's user confined to the
``/resilient/`` prefix, as a production cluster runs it.

Every client of the run reads its credentials from the ``RESILIENT_ETCD_*``
variables (:func:`resilient.config.etcd_config`): this process's own (the progress
watch, fault records), the launcher it hosts and, through it, every rank. So
:func:`client_env` sets them for the run and puts the old values back after.
"""

from __future__ import annotations

import contextlib
import os
import secrets
import subprocess
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from chaos.certs import make_certs
from membership.server import ServerTLS
from resilient.config import ENV_PREFIX
from resilient.errors import ChaosError

__all__ = ["ROOT_PASSWORD", "EtcdSecurity", "client_env", "etcd_security"]

# etcd's root user exists only to turn auth on; nothing of the run uses it after.
ROOT_PASSWORD = secrets.token_hex(16)


@dataclass(frozen=True, kw_only=True, slots=True)
class EtcdSecurity:
    """The server's TLS, the job's etcd user, and the client environment."""

    server: ServerTLS
    user: str
    password: str
    env: Mapping[str, str] = field(default_factory=dict)


def etcd_security(directory: Path, host: str) -> EtcdSecurity:
    """Fresh certificates in ``directory`` (the server's for ``host``) and a user.

    Raises:
        ChaosError: openssl failed or hung.
    """
    try:
        certs = make_certs(directory, hosts=(host,))
    except (RuntimeError, OSError, subprocess.TimeoutExpired) as exc:
        raise ChaosError(f"etcd_security: could not make certificates: {exc}") from exc
    user, password = "resilient-job", secrets.token_hex(16)
    p = ENV_PREFIX
    env = {
        p + "ETCD_CA": certs.ca.cert,
        p + "ETCD_CERT": certs.client_cert,
        p + "ETCD_KEY": certs.client_key,
        p + "ETCD_USER": user,
        p + "ETCD_PASSWORD": password,
    }
    server = ServerTLS(
        cert=certs.server_cert, key=certs.server_key, ca=certs.ca.cert,
        client_cert=certs.probe_cert, client_key=certs.probe_key,
    )  # fmt: skip
    return EtcdSecurity(server=server, user=user, password=password, env=env)


@contextlib.contextmanager
def client_env(env: Mapping[str, str]) -> Iterator[None]:
    """``os.environ`` with ``env`` set, as it was again afterwards."""
    before = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for key, value in before.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
