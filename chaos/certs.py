"""Throwaway X.509 material for etcd over TLS: a CA, a server certificate and client
certificates, made with the ``openssl`` CLI (scenarios with ``etcd_security``, and
the tests).

EC P-256 keys keep a whole set (CA, server, two clients) well under a second even
on a slow 2-core machine; the ``cryptography`` package is deliberately not used.
A private minimal openssl config is written next to the files so the result does
not depend on the system's openssl.cnf (absent or different on some machines).
The server certificate names 127.0.0.1 and localhost, and the hosts given.
"""

from __future__ import annotations

import ipaddress
import os
import subprocess
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

__all__ = ["CertAuthority", "EtcdCerts", "issue_cert", "make_ca", "make_certs", "make_jwt_keys"]

_TIMEOUT_S = 20.0

_CONFIG = """\
[req]
distinguished_name = dn
prompt = no

[dn]
CN = unused

[ca]
basicConstraints = critical, CA:TRUE
keyUsage = critical, keyCertSign, cRLSign
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid:always

[server]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = serverAuth
subjectAltName = {alt_names}
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid, issuer

[client]
basicConstraints = critical, CA:FALSE
keyUsage = critical, digitalSignature, keyEncipherment
extendedKeyUsage = clientAuth
subjectKeyIdentifier = hash
authorityKeyIdentifier = keyid, issuer
"""


@dataclass(frozen=True, slots=True)
class CertAuthority:
    """A CA certificate, its key, and the openssl config used to sign with it."""

    cert: str
    key: str
    config: str


@dataclass(frozen=True, slots=True)
class EtcdCerts:
    """Paths of one CA, a server cert for 127.0.0.1/localhost and client certs.

    ``client_*`` (CN ``client_cn``) is for library clients; ``probe_*`` (CN
    ``resilient-health-probe``) is for :class:`membership.server.ServerTLS`'s own
    health probe and admin calls, so the server cert needs only ``serverAuth``.
    """

    ca: CertAuthority
    server_cert: str
    server_key: str
    client_cert: str
    client_key: str
    client_cn: str
    probe_cert: str
    probe_key: str


def _openssl(*args: str, cwd: Path) -> None:
    proc = subprocess.run(
        ["openssl", *args],
        cwd=cwd,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        timeout=_TIMEOUT_S,
        check=False,
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"openssl {' '.join(args[:2])} failed ({proc.returncode}): "
            f"{proc.stderr.decode(errors='replace').strip()[-600:]}"
        )


def _alt_names(hosts: Sequence[str]) -> str:
    names = []
    for host in ("127.0.0.1", "localhost", *hosts):
        try:
            entry = f"IP:{ipaddress.ip_address(host)}"
        except ValueError:
            entry = f"DNS:{host}"
        if entry not in names:
            names.append(entry)
    return ", ".join(names)


def make_ca(directory: str | Path, name: str = "ca", hosts: Sequence[str] = ()) -> CertAuthority:
    """Create ``<name>.pem``/``<name>.key`` (a self-signed CA) in ``directory``; the
    server certificates it issues name ``hosts`` too.

    Raises:
        RuntimeError: openssl failed (its stderr is in the message).
        subprocess.TimeoutExpired: openssl hung for 20 s.
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    config = d / f"{name}-openssl.cnf"
    config.write_text(_CONFIG.format(alt_names=_alt_names(hosts)))
    cert, key = d / f"{name}.pem", d / f"{name}.key"
    _openssl(
        "req", "-x509", "-new", "-nodes",
        "-config", str(config), "-extensions", "ca",
        "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
        "-keyout", str(key), "-out", str(cert),
        "-days", "2", "-subj", f"/CN=resilient-test-{name}",
        cwd=d,
    )  # fmt: skip
    return CertAuthority(cert=str(cert), key=str(key), config=str(config))


def issue_cert(
    ca: CertAuthority, directory: str | Path, name: str, *, cn: str, kind: str
) -> tuple[str, str]:
    """Issue ``<name>.pem``/``<name>.key`` signed by ``ca``; ``kind`` is ``server`` or ``client``.

    Returns:
        (cert path, key path).

    Raises:
        ValueError: unknown ``kind``.
        RuntimeError: openssl failed.
    """
    if kind not in ("server", "client"):
        raise ValueError(f"kind={kind!r}: expected 'server' or 'client'")
    d = Path(directory)
    cert, key, csr = d / f"{name}.pem", d / f"{name}.key", d / f"{name}.csr"
    _openssl(
        "req", "-new", "-nodes", "-config", ca.config,
        "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:prime256v1",
        "-keyout", str(key), "-out", str(csr), "-subj", f"/CN={cn}",
        cwd=d,
    )  # fmt: skip
    # -set_serial with a random value instead of -CAcreateserial: no shared serial
    # file, so issuing certs from parallel tests cannot race on it.
    _openssl(
        "x509", "-req", "-in", str(csr), "-CA", ca.cert, "-CAkey", ca.key,
        "-set_serial", str(int.from_bytes(os.urandom(8), "big")),
        "-days", "2", "-extfile", ca.config, "-extensions", kind, "-out", str(cert),
        cwd=d,
    )  # fmt: skip
    csr.unlink(missing_ok=True)
    return str(cert), str(key)


def make_certs(
    directory: str | Path, *, client_cn: str = "resilient-client", hosts: Sequence[str] = ()
) -> EtcdCerts:
    """A fresh CA plus server (for 127.0.0.1, localhost and ``hosts``), client and
    probe certs in ``directory`` (created if missing).

    Raises:
        RuntimeError: openssl failed.
    """
    ca = make_ca(directory, hosts=hosts)
    server_cert, server_key = issue_cert(ca, directory, "server", cn="localhost", kind="server")
    client_cert, client_key = issue_cert(ca, directory, "client", cn=client_cn, kind="client")
    probe_cert, probe_key = issue_cert(
        ca, directory, "probe", cn="resilient-health-probe", kind="client"
    )
    return EtcdCerts(
        ca=ca,
        server_cert=server_cert,
        server_key=server_key,
        client_cert=client_cert,
        client_key=client_key,
        client_cn=client_cn,
        probe_cert=probe_cert,
        probe_key=probe_key,
    )


def make_jwt_keys(directory: str | Path) -> tuple[str, str]:
    """An ES256 key pair for etcd's ``--auth-token=jwt,...``: (private key, public key) paths.

    Raises:
        RuntimeError: openssl failed.
    """
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    priv, pub = d / "jwt.key", d / "jwt.pub"
    _openssl("ecparam", "-name", "prime256v1", "-genkey", "-noout", "-out", str(priv), cwd=d)
    _openssl("ec", "-in", str(priv), "-pubout", "-out", str(pub), cwd=d)
    return str(priv), str(pub)
