"""Membership against a real etcd: leases, tokens, isolation, health."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from membership import Membership
from membership.etcd_client import EtcdClient
from membership.keys import JobKeys
from resilient.config import EtcdConfig, MembershipConfig
from resilient.errors import (
    ConfigError,
    EtcdUnavailable,
    JobTokenMismatch,
    LeaseLost,
    MembershipError,
)
from resilient.procs import wait_until

TOKEN = "s3cret-token"


def _member(cfg: EtcdConfig, job: str, ttl: float = 2.0) -> Membership:
    return Membership(cfg, MembershipConfig(job=job, lease_ttl_s=ttl))


def _snapshot(cfg: EtcdConfig, job: str) -> dict[str, bytes]:
    client = EtcdClient(cfg)
    try:
        kvs, _ = client.get_prefix(JobKeys(job).prefix)
        return {kv.key: kv.value for kv in kvs}
    finally:
        client.close()


@pytest.mark.timeout(30)
def test_join_list_leave(etcd_config: EtcdConfig, job_name: str) -> None:
    with _member(etcd_config, job_name) as a, _member(etcd_config, job_name) as b:
        a.join(0, 0, ["127.0.1.1", "127.0.2.1"], TOKEN)
        b.join(1, 0, ["127.0.1.2"], TOKEN)
        members = a.members()
        assert sorted(members) == [0, 1]
        assert members[0].rails == ("127.0.1.1", "127.0.2.1")
        assert members[1].incarnation == 0
        b.leave()
        assert sorted(a.members()) == [0]
        assert not b.joined
        # Membership keeps no epoch of its own: the job's one epoch is the counter
        # recovery moves in the job's store (membership.epoch).
        assert not [k for k in _snapshot(etcd_config, job_name) if "epoch" in k]


@pytest.mark.timeout(30)
def test_killed_member_expires_within_ttl_plus_one(
    etcd_config: EtcdConfig, job_name: str, tmp_path: Path
) -> None:
    ttl = 2.0
    script = tmp_path / "member.py"
    script.write_text(
        textwrap.dedent(
            f"""
            import sys, time
            from membership import Membership
            from resilient.config import EtcdConfig, MembershipConfig
            m = Membership(EtcdConfig(endpoints={etcd_config.endpoints!r}),
                           MembershipConfig(job={job_name!r}, lease_ttl_s={ttl}))
            m.join(1, 0, [], {TOKEN!r})
            print("joined", flush=True)
            time.sleep(60)
            """
        )
    )
    gone = threading.Event()
    gone_at: list[float] = []

    def on_change(kind: str, rank: int, info: object) -> None:
        if kind == "delete" and rank == 1:
            gone_at.append(time.monotonic())
            gone.set()

    with _member(etcd_config, job_name, ttl) as watcher:
        watcher.join(0, 0, [], TOKEN)
        watcher.watch_members(on_change)
        child = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE)
        try:
            assert child.stdout is not None
            assert child.stdout.readline().strip() == b"joined"
            # Let the keep-alive run a few rounds so the lease is demonstrably refreshed.
            time.sleep(ttl * 1.2)
            assert 1 in watcher.members()
            child.kill()
            killed_at = time.monotonic()
            child.wait(10)
            assert gone.wait(ttl + 3.0), "watcher never saw the killed member leave"
            assert gone_at[0] - killed_at <= ttl + 1.0
            assert 1 not in watcher.members()
        finally:
            child.kill()
            child.wait(10)


@pytest.mark.timeout(30)
def test_join_unreachable_etcd_fails_within_bound(job_name: str) -> None:
    from resilient.procs import free_port

    cfg = EtcdConfig(
        endpoints=(f"127.0.0.1:{free_port()}",), request_timeout_s=0.5, retry_budget_s=1.5
    )
    m = Membership(cfg, MembershipConfig(job=job_name))
    start = time.monotonic()
    with pytest.raises(EtcdUnavailable):
        m.join(0, 0, [], TOKEN)
    assert time.monotonic() - start < 1.5 + 0.5 + 1.0
    assert isinstance(EtcdUnavailable("x"), MembershipError)
    m.close()


@pytest.mark.timeout(30)
def test_wrong_token_rejected_and_nothing_read_or_changed(
    etcd_config: EtcdConfig, job_name: str
) -> None:
    with _member(etcd_config, job_name) as owner:
        owner.join(0, 0, ["127.0.1.1"], TOKEN)
        before = _snapshot(etcd_config, job_name)
        assert TOKEN.encode() not in b"".join(before.values())  # only a hash is stored
        intruder = _member(etcd_config, job_name)
        with pytest.raises(JobTokenMismatch) as info:
            intruder.join(1, 0, ["127.0.1.2"], "not-the-token")
        assert info.value.job == job_name
        assert job_name in str(info.value)
        for call in (
            intruder.members,
            intruder.rank_health,
            lambda: intruder.publish_rank_health({"x": 1}),
            lambda: intruder.watch_members(lambda *a: None),
        ):
            with pytest.raises(MembershipError):
                call()
        assert _snapshot(etcd_config, job_name) == before
        intruder.close()
        with pytest.raises(ConfigError):
            _member(etcd_config, job_name).join(2, 0, [], "")


@pytest.mark.timeout(30)
def test_two_jobs_on_one_etcd_are_isolated(etcd_config: EtcdConfig, job_name: str) -> None:
    other_job = job_name + "-b"
    seen_by_b: list[tuple[str, int]] = []
    with _member(etcd_config, job_name) as a, _member(etcd_config, other_job) as b:
        a.join(0, 0, [], TOKEN)
        b.join(0, 0, [], "another-token")  # same rank id, other job: no conflict
        b.watch_members(lambda kind, rank, info: seen_by_b.append((kind, rank)), initial=False)
        with _member(etcd_config, job_name) as a1:
            a1.join(1, 0, [], TOKEN)
        time.sleep(0.3)
        assert sorted(a.members()) == [0]
        assert sorted(b.members()) == [0]
        assert seen_by_b == []
        other_keys = _snapshot(etcd_config, other_job)
        assert all(k.startswith(f"/resilient/{other_job}/") for k in other_keys)


@pytest.mark.timeout(30)
def test_incarnation_replaces_only_older(etcd_config: EtcdConfig, job_name: str) -> None:
    with _member(etcd_config, job_name) as old, _member(etcd_config, job_name) as same:
        old.join(3, 1, [], TOKEN)
        with pytest.raises(MembershipError, match="incarnation"):
            same.join(3, 1, [], TOKEN)
        with _member(etcd_config, job_name) as new:
            new.join(3, 2, [], TOKEN)
            assert new.members()[3].incarnation == 2


@pytest.mark.timeout(30)
def test_health_records_rate_limited_and_removed_with_member(
    etcd_config: EtcdConfig, job_name: str
) -> None:
    with _member(etcd_config, job_name) as reader, _member(etcd_config, job_name) as m:
        reader.join(0, 0, [], TOKEN)
        m.join(1, 0, [], TOKEN)
        start = time.monotonic()
        i = 0
        while time.monotonic() - start < 1.6:
            m.publish_rank_health({"step": i})
            m.publish_link_health(0, 1, {"gbps": float(i)})
            i += 1
            time.sleep(0.005)
        assert wait_until(lambda: reader.rank_health().get(1, {}).get("step") == i - 1, timeout_s=3)
        assert reader.link_health()[(1, 0, 1)]["gbps"] == float(i - 1)
        assert m._health is not None
        # Two keys, <= 1 write per key per second over ~2.6 s: at most 3 writes each.
        assert m._health.writes <= 6, m._health.writes
        assert i > 50
        m.leave()
        assert wait_until(lambda: 1 not in reader.rank_health(), timeout_s=3)


@pytest.mark.timeout(30)
def test_lease_lost_is_reported(etcd_config: EtcdConfig, job_name: str) -> None:
    fired = threading.Event()
    with _member(etcd_config, job_name) as m:
        m.on_lease_lost(fired.set)
        m.join(0, 0, [], TOKEN)
        assert m.lease_id is not None
        admin = EtcdClient(etcd_config)
        admin.revoke_lease(m.lease_id)  # as if etcd expired it while we were hung
        admin.close()
        assert fired.wait(5.0)
        with pytest.raises(LeaseLost):
            m.members()


@pytest.mark.timeout(10)
def test_config_validation() -> None:
    with pytest.raises(ConfigError, match="lease_ttl_s"):
        MembershipConfig(job="ok", lease_ttl_s=1.0)
    with pytest.raises(ConfigError, match="job name"):
        MembershipConfig(job="a/b")


@pytest.mark.timeout(30)
def test_a_member_lease_etcd_dropped_fences_at_once(etcd_config: EtcdConfig, job_name: str) -> None:
    said: list[str] = []
    fenced = threading.Event()
    with _member(etcd_config, job_name) as m:
        m.join(0, 0, [], TOKEN)
        m.watch_lease(lambda why: (said.append(why), fenced.set()))
        assert m.lease_id is not None
        admin = EtcdClient(etcd_config)
        admin.revoke_lease(m.lease_id)
        admin.close()
        assert fenced.wait(5.0), "not fenced after etcd dropped the member lease"
        assert said == ["etcd says its member lease expired"] and m.lease_lost.is_set()
    with pytest.raises(MembershipError, match="not a member"):
        _member(etcd_config, job_name).watch_lease(lambda why: None)


@pytest.mark.timeout(60)
def test_a_member_cut_off_from_etcd_is_fenced_before_its_lease_could_expire(
    job_name: str,
) -> None:
    import os
    import signal

    from membership.server import EmbeddedEtcd

    server = EmbeddedEtcd(fsync=False)
    server.start()
    pid = server.member_pid(0)
    assert pid is not None
    try:
        cfg = EtcdConfig(endpoints=server.endpoints, request_timeout_s=1.0, retry_budget_s=2.0)
        fired: list[float] = []
        with _member(cfg, job_name, ttl=2.0) as m:
            m.join(3, 0, [], TOKEN)
            m.watch_lease(lambda why: fired.append(time.monotonic()))
            time.sleep(1.5)  # a few keep-alives go through
            assert not fired
            cut = time.monotonic()
            os.kill(pid, signal.SIGSTOP)  # etcd stops answering, as when cut off
            # The fence comes the TTL (2 s) after the last keep-alive etcd
            # acknowledged was sent, so no later than etcd could expire the key.
            assert wait_until(lambda: bool(fired), timeout_s=4.0), "never fenced"
            assert fired[0] - cut < 2.0 + 0.3, fired[0] - cut
            os.kill(pid, signal.SIGCONT)
    finally:
        os.kill(pid, signal.SIGCONT)
        server.stop()
