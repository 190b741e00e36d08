"""The job token on every read and write (issue 43): for each key family of a job
in etcd, a client with the wrong token gets JobTokenMismatch on write and on read
and the job's keys stay as they were; a client with the right token works."""

from __future__ import annotations

import json
import pickle
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from functools import partial
from typing import Any

import pytest
import torch.distributed as dist

from membership.epoch import EPOCH_KEY, advance_epoch, current_epoch, epoch_record
from membership.etcd_client import EtcdClient
from membership.guarded import GuardedClient, JobGuard, job_client
from membership.keys import JobKeys, token_hash
from membership.members import Membership
from membership.server import EmbeddedEtcd
from membership.store import EtcdStore
from recovery.agree import Record, agree, join_requested, request_join
from resilient.config import EtcdConfig, MembershipConfig
from resilient.detect.doorbell import WatchBell
from resilient.detect.health_board import HealthBoard
from resilient.errors import JobTokenMismatch
from resilient.launch.leases import LeaseWatch
from resilient.links.fault_hook import FaultHook
from resilient.procs import wait_until

pytestmark = pytest.mark.timeout(120)

TOKEN = "right-token"
WRONG = "wrong-token"


def _snapshot(cfg: EtcdConfig, job: str) -> dict[str, bytes]:
    """Every key of the job, read without any token check."""
    client = EtcdClient(cfg)
    try:
        kvs, _ = client.get_prefix(JobKeys(job).prefix)
        return {kv.key: kv.value for kv in kvs}
    finally:
        client.close()


def _store(cfg: EtcdConfig, job: str, token: str, **kw: Any) -> EtcdStore:
    return EtcdStore(
        cfg, JobKeys(job).store + "links-1/", guard=JobGuard.for_token(job, token), **kw
    )


@pytest.fixture
def stores(etcd_config: EtcdConfig, job_name: str) -> Iterator[tuple[EtcdStore, EtcdStore]]:
    """The job's store with the right token (which creates the job) and with a wrong one."""
    right = _store(etcd_config, job_name, TOKEN)
    assert right.num_keys() == 0  # the first guarded call records the token's hash
    wrong = _store(etcd_config, job_name, WRONG, timeout=timedelta(seconds=60))
    yield right, wrong
    wrong.close()
    right.delete_prefix()
    right.close()


def _refused(calls: dict[str, Callable[[], object]], job: str) -> None:
    """Each call raises JobTokenMismatch at once (no waiting out a store timeout)."""
    for name, call in calls.items():
        start = time.monotonic()
        with pytest.raises(JobTokenMismatch) as info:
            call()
        assert time.monotonic() - start < 5.0, name
        assert info.value.job == job, name
        assert job in str(info.value) and info.value.operation, name


# -- the store (link rendezvous) -----------------------------------------------------
def test_a_guarded_store_keeps_torchs_semantics(stores: tuple[EtcdStore, EtcdStore]) -> None:
    s, _ = stores
    s.set("a", b"1")
    assert s.get("a") == b"1" and s.check(["a"]) and not s.check(["a", "nope"])
    s.wait(["a"], timedelta(seconds=1))
    s.multi_set(["b", "c"], [b"2", "3"])
    assert s.multi_get(["a", "b", "c"]) == [b"1", b"2", b"3"]
    assert s.add("n", 5) == 5 and s.add("n", -2) == 3
    s.append("log", b"x")
    s.append("log", b"y")
    assert s.get("log") == b"xy"
    assert s.compare_set("cas", "", "v1") == b"v1"
    assert s.compare_set("cas", "other", "v2") == b"v1"  # inner compare failed
    assert s.compare_set("cas", "v1", "v2", also={"side": "s"}) == b"v2"
    assert s.compare_set("missing", "x", "y") == b"x" and not s.check(["missing"])
    assert s.get("side") == b"s"
    assert s.list_keys() == ["a", "b", "c", "cas", "log", "n", "side"]
    assert s.num_keys() == 7
    assert s.delete_key("a") and not s.delete_key("a")
    with pytest.raises(dist.DistStoreError):
        s.wait(["never"], timedelta(milliseconds=100))


def test_a_wrong_token_store_reads_and_writes_nothing(
    stores: tuple[EtcdStore, EtcdStore], etcd_config: EtcdConfig, job_name: str
) -> None:
    right, wrong = stores
    right.multi_set(["a", "n", "cas"], ["1", "7", "v"])
    before = _snapshot(etcd_config, job_name)
    assert TOKEN.encode() not in b"".join(before.values())  # only the hash is stored
    _refused(
        {
            "set": lambda: wrong.set("a", "evil"),
            "multi_set": lambda: wrong.multi_set(["a", "z"], ["evil", "evil"]),
            "add": lambda: wrong.add("n", 1),
            "append": lambda: wrong.append("a", "evil"),
            "compare_set": lambda: wrong.compare_set("cas", "v", "evil"),
            "compare_set new": lambda: wrong.compare_set("new", "", "evil"),
            "delete_key": lambda: wrong.delete_key("a"),
            "delete_prefix": wrong.delete_prefix,
            "get": lambda: wrong.get("a"),
            "get missing": lambda: wrong.get("nope"),  # would wait 60 s if polled
            "wait": lambda: wrong.wait(["nope"]),
            "multi_get": lambda: wrong.multi_get(["a"]),
            "check": lambda: wrong.check(["a"]),
            "num_keys": wrong.num_keys,
            "list_keys": wrong.list_keys,
            "through torch": lambda: dist.PrefixStore("pg", wrong).get("a"),
        },
        job_name,
    )
    assert _snapshot(etcd_config, job_name) == before
    assert right.get("a") == b"1"  # the right token still works


def test_the_guard_survives_pickling_and_clone(
    stores: tuple[EtcdStore, EtcdStore], job_name: str
) -> None:
    right, wrong = stores
    right.set("k", "v")
    copy = pickle.loads(pickle.dumps(right))
    clone = wrong.clone()
    try:
        assert copy.guard == right.guard and copy.get("k") == b"v"
        assert clone.guard == wrong.guard
        assert isinstance(copy.client(), GuardedClient)
        _refused(
            {"clone get": lambda: clone.get("k"), "clone set": lambda: clone.set("k", "x")},
            job_name,
        )
        assert pickle.loads(pickle.dumps(JobGuard.for_token(job_name, TOKEN))) == right.guard
    finally:
        copy.close()
    assert right.get("k") == b"v"


def test_the_first_guarded_call_creates_the_job_and_join_then_checks_it(
    etcd_config: EtcdConfig, job_name: str
) -> None:
    # The links' store rendezvouses before any rank joined: its first call records
    # the hash, as a join would; the join with the same token then passes.
    with _store(etcd_config, job_name, TOKEN) as s:
        s.set("x", "1")
        assert _snapshot(etcd_config, job_name)[JobKeys(job_name).token] == (
            token_hash(job_name, TOKEN).encode()
        )
        config = MembershipConfig(job=job_name, lease_ttl_s=2.0)
        with Membership(etcd_config, config) as ok:
            ok.join(0, 0, ["127.0.0.1"], TOKEN)
        with Membership(etcd_config, config) as bad, pytest.raises(JobTokenMismatch):
            bad.join(1, 0, ["127.0.0.1"], WRONG)
        s.delete_prefix()


def test_ranks_that_create_a_new_job_at_once_all_pass(
    etcd_config: EtcdConfig, job_name: str
) -> None:
    """Several first calls race to record the hash: the losers look again and pass."""
    stores = [_store(etcd_config, job_name, TOKEN) for _ in range(4)]
    errors: list[BaseException] = []
    go = threading.Barrier(len(stores))

    def first_call(rank: int) -> None:
        go.wait()
        try:
            stores[rank].set(f"r{rank}", "up")
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=first_call, args=(r,)) for r in range(len(stores))]
    for th in threads:
        th.start()
    for th in threads:
        th.join(30.0)
    try:
        assert errors == []
        assert stores[0].list_keys() == ["r0", "r1", "r2", "r3"]
    finally:
        stores[0].delete_prefix()
        for st in stores:
            st.close()


def test_a_store_without_a_guard_checks_nothing(
    stores: tuple[EtcdStore, EtcdStore], etcd_config: EtcdConfig, job_name: str
) -> None:
    """Tools that never had a token keep today's behaviour (documented)."""
    right, _ = stores
    right.set("k", "v")
    with EtcdStore(etcd_config, right.prefix) as plain:
        assert plain.guard is None and plain.get("k") == b"v"


# -- the health board and its doorbell ---------------------------------------------
def test_the_health_board_keys_refuse_a_wrong_token(
    stores: tuple[EtcdStore, EtcdStore], etcd_config: EtcdConfig, job_name: str
) -> None:
    right, wrong = stores
    board = HealthBoard(rank=0, world=2, store=right)
    board.nic_changed(1, up=False)  # publishes health/e0/r0 and bumps health/e0/v
    assert json.loads(right.get("health/e0/r0"))["nic_down"] == [1]
    before = _snapshot(etcd_config, job_name)
    intruder = HealthBoard(rank=0, world=2, store=wrong)
    intruder.nic_changed(0, up=False)  # never raises; the write is refused
    peer_view = HealthBoard(rank=1, world=2, store=wrong)
    assert peer_view.peer_cut_rails(0) == set()  # it cannot read rank 0's record
    _refused(
        {
            "record set": lambda: wrong.set("health/e0/r0", "{}"),
            "version add": lambda: wrong.add("health/e0/v", 1),
            "record get": lambda: wrong.get("health/e0/r0"),
            "record check": lambda: wrong.check(["health/e0/r0"]),
        },
        job_name,
    )
    assert _snapshot(etcd_config, job_name) == before


def test_the_doorbell_watch_refuses_a_wrong_token(
    stores: tuple[EtcdStore, EtcdStore], job_name: str
) -> None:
    right, wrong = stores
    with pytest.raises(JobTokenMismatch):
        WatchBell(wrong, "health/e0")
    bell = WatchBell(right, "health/e0", safety_s=30.0)
    try:
        right.set("health/e0/r1", "{}")
        start = time.monotonic()
        bell.wait(10.0)
        assert time.monotonic() - start < 5.0
    finally:
        bell.close()


# -- the epoch and the agreement -----------------------------------------------------
def test_the_epoch_and_agreement_keys_refuse_a_wrong_token(
    stores: tuple[EtcdStore, EtcdStore], etcd_config: EtcdConfig, job_name: str
) -> None:
    right, wrong = stores
    assert advance_epoch(right, 0, {"members": [0]}) == 1
    request_join(right, 1, 3)
    plan = agree(
        right, epoch=1, world=1, record=Record(rank=0, incarnation=0, step=4), timeout_s=10
    )
    assert plan.members == (0,) and current_epoch(right) == 2
    before = _snapshot(etcd_config, job_name)
    _refused(
        {
            "advance_epoch": lambda: advance_epoch(wrong, 2, {"members": [9]}),
            "current_epoch": lambda: current_epoch(wrong),
            "epoch_record": lambda: epoch_record(wrong, 1),
            "epoch get": lambda: wrong.get(EPOCH_KEY),
            "request_join": lambda: request_join(wrong, 2, 9),
            "join_requested": lambda: join_requested(wrong, 1),
            "agree": lambda: agree(
                wrong, epoch=2, world=1, record=Record(rank=0, incarnation=0, step=9), timeout_s=30
            ),
        },
        job_name,
    )
    assert _snapshot(etcd_config, job_name) == before
    assert current_epoch(right) == 2 and epoch_record(right, 1) is not None


# -- membership records, launcher records, progress and fault records -------------------
def test_every_job_key_family_refuses_a_wrong_token_client(
    etcd_config: EtcdConfig, job_name: str
) -> None:
    keys = JobKeys(job_name)
    families = {
        "member": keys.member(0),
        "departure": keys.departed(0),
        "rank health": keys.rank_health + "000000",
        "link health": keys.link(0, 1, 0),
        "replacement": keys.replacement(1),
        "supervisor": keys.supervisor,
        "fault record": keys.chaos_faults + "f0",
        "progress": keys.sub("progress") + "000000",
    }
    base = EtcdClient(etcd_config)
    right = GuardedClient(base, JobGuard.for_token(job_name, TOKEN))
    wrong = job_client(base, job_name, WRONG)
    try:
        for key in families.values():
            right.put(key, "{}")
        assert right.get(keys.supervisor) is not None
        assert len(right.get_prefix(keys.prefix)[0]) == len(families) + 1  # and the token
        before = _snapshot(etcd_config, job_name)
        for family, key in families.items():
            parent = key.rsplit("/", 1)[0] + "/"
            _refused(
                {
                    f"{family} put": partial(wrong.put, key, "evil"),
                    f"{family} delete": partial(wrong.delete, key),
                    f"{family} get": partial(wrong.get, key),
                    f"{family} list": partial(wrong.get_prefix, parent),
                    f"{family} count": partial(wrong.count_prefix, parent),
                    f"{family} delete all": partial(wrong.delete_prefix, parent),
                },
                job_name,
            )
        assert _snapshot(etcd_config, job_name) == before
        assert right.delete_prefix(keys.chaos_faults) == 1
    finally:
        base.close()


def test_the_launcher_and_the_fault_hook_use_the_token(
    etcd_server: EmbeddedEtcd, etcd_config: EtcdConfig, job_name: str
) -> None:
    keys = JobKeys(job_name)
    owner = GuardedClient(
        EtcdClient(etcd_config), JobGuard.for_token(job_name, TOKEN), owns_base=True
    )
    fault = {"kind": "fail", "rank": 0, "rail": 0}
    owner.put(keys.chaos_faults + "f0", json.dumps(fault))
    intruder = LeaseWatch(etcd_server.url, job_name, WRONG)
    supervisor = LeaseWatch(etcd_server.url, job_name, TOKEN)
    wrong_hook, right_hook = FaultHook(), FaultHook()
    try:
        before = _snapshot(etcd_config, job_name)
        intruder.announce(1, 1, "warm", 2.0)  # never raises: refused and logged
        intruder.publish_budget(3, True)
        assert _snapshot(etcd_config, job_name) == before
        supervisor.publish_budget(3, True)
        assert owner.get(keys.supervisor) is not None
        wrong_hook.start(etcd_config, job_name, WRONG)
        right_hook.start(etcd_config, job_name, TOKEN)
        assert wait_until(lambda: bool(right_hook.faults), timeout_s=10.0)
        assert wrong_hook.faults == ()
    finally:
        wrong_hook.stop()
        right_hook.stop()
        intruder.close()
        supervisor.close()
        owner.delete_prefix(keys.prefix)
        owner.close()
