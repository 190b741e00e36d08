"""Throwaway X.509 material for the TLS tests: :mod:`chaos.certs`, under the names the
tests use."""

from __future__ import annotations

from chaos.certs import CertAuthority, issue_cert, make_ca, make_certs, make_jwt_keys
from chaos.certs import EtcdCerts as TestCerts

__all__ = ["CertAuthority", "TestCerts", "issue_cert", "make_ca", "make_certs", "make_jwt_keys"]
