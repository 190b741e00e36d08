"""EtcdStore: torch Store semantics against a real etcd, and gloo rendezvous through it."""

from __future__ import annotations

import gc
import json
import multiprocessing as mp
import pickle
import threading
import time
from collections.abc import Callable, Iterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
import torch.distributed as dist

from membership.etcd_client import EtcdClient
from membership.server import EmbeddedEtcd
from membership.store import EtcdStore, EtcdStoreTimeout
from resilient.config import EtcdConfig
from resilient.errors import EtcdUnavailable, MembershipError, StoreTimeout
from tests.membership import _gloo_store_worker

SHORT = timedelta(milliseconds=300)


@pytest.fixture
def prefix(job_name: str) -> str:
    return f"/resilient/{job_name}/store/"


@pytest.fixture
def store(etcd_config: EtcdConfig, prefix: str) -> Iterator[EtcdStore]:
    s = EtcdStore(etcd_config, prefix)
    yield s
    s.delete_prefix()
    s.close()


def _outcome(fn: Callable[[], Any]) -> Any:
    """A comparable summary of a call: its result, or the torch-visible kind of its error."""
    try:
        return ("ok", fn())
    except dist.DistStoreError:
        return ("timeout",)
    except ValueError:
        return ("value-error",)


# (name, operation) run in order on an EtcdStore and on a HashStore; outcomes must match.
_SCRIPT: list[tuple[str, Callable[[Any], Any]]] = [
    ("set str", lambda s: s.set("a", "x")),
    ("get", lambda s: s.get("a")),
    ("set binary", lambda s: s.set("b", bytes(range(256)))),
    ("get binary", lambda s: s.get("b")),
    ("set empty", lambda s: s.set("e", b"")),
    ("get empty", lambda s: s.get("e")),
    ("overwrite", lambda s: s.set("a", b"y")),
    ("get overwritten", lambda s: s.get("a")),
    ("check present", lambda s: s.check(["a", "e"])),
    ("check partial", lambda s: s.check(["a", "zz"])),
    ("check none", lambda s: s.check([])),
    ("add creates", lambda s: s.add("c", 5)),
    ("get added", lambda s: s.get("c")),
    ("add negative", lambda s: s.add("c", -7)),
    ("add zero", lambda s: s.add("c", 0)),
    ("add zero creates", lambda s: s.add("z", 0)),
    ("add to non-int", lambda s: s.add("a", 1)),
    ("add to ' 7'", lambda s: (s.set("d", " 7"), s.add("d", 1))),
    ("cas missing empty", lambda s: s.compare_set("m1", "", "v")),
    ("cas missing get", lambda s: s.get("m1")),
    ("cas missing non-empty", lambda s: s.compare_set("m2", "x", "v")),
    ("cas left missing", lambda s: s.check(["m2"])),
    ("cas equal", lambda s: s.compare_set("m1", "v", "w")),
    ("cas differs", lambda s: s.compare_set("m1", "zzz", "q")),
    ("cas existing, empty expected", lambda s: s.compare_set("m1", "", "q")),
    ("cas after", lambda s: s.get("m1")),
    ("cas empty value", lambda s: s.compare_set("e", "", "filled")),
    ("num_keys", lambda s: s.num_keys()),
    ("delete", lambda s: s.delete_key("a")),
    ("delete again", lambda s: s.delete_key("a")),
    ("num_keys after delete", lambda s: s.num_keys()),
    ("multi_set", lambda s: s.multi_set(["x1", "x2"], ["1", b"2"])),
    ("multi_get", lambda s: s.multi_get(["x2", "x1"])),
    ("append creates", lambda s: s.append("ap", "ab")),
    ("append", lambda s: s.append("ap", b"cd")),
    ("get appended", lambda s: s.get("ap")),
    ("extended api", lambda s: s.has_extended_api()),
    ("wait present", lambda s: s.wait(["x1", "b"])),
    ("wait none", lambda s: s.wait([])),
    ("wait timeout", lambda s: s.wait(["x1", "nope"], SHORT)),
    ("get timeout", lambda s: (s.set_timeout(SHORT), s.get("nope"))[1]),
    ("multi_get timeout", lambda s: s.multi_get(["x1", "nope"])),
    ("timeout property", lambda s: s.timeout),
    ("prefix set", lambda s: dist.PrefixStore("p", s).set("k", "v")),
    ("prefix get raw", lambda s: s.get("p/k")),
    ("prefix add", lambda s: dist.PrefixStore("p", s).add("n", 2)),
    ("prefix cas", lambda s: dist.PrefixStore("p", s).compare_set("n", "2", "9")),
    ("prefix check", lambda s: dist.PrefixStore("p", s).check(["k", "n"])),
    ("prefix multi_get", lambda s: dist.PrefixStore("p", s).multi_get(["k", "n"])),
    ("prefix num_keys", lambda s: dist.PrefixStore("p", s).num_keys()),
    ("prefix delete", lambda s: dist.PrefixStore("p", s).delete_key("k")),
    ("prefix wait timeout", lambda s: dist.PrefixStore("p", s).wait(["k"], SHORT)),
    ("prefix get timeout", lambda s: dist.PrefixStore("p", s).get("k")),
    ("list_keys", lambda s: sorted(s.list_keys())),
]


@pytest.mark.timeout(60)
def test_semantics_match_hashstore(store: EtcdStore) -> None:
    reference = dist.HashStore()
    for name, op in _SCRIPT:
        got = _outcome(lambda op=op: op(store))
        want = _outcome(lambda op=op: op(reference))
        assert got == want, f"{name}: EtcdStore {got!r} != HashStore {want!r}"


@pytest.mark.timeout(30)
def test_get_blocks_until_the_key_is_set(store: EtcdStore, etcd_config: EtcdConfig) -> None:
    other = EtcdStore(etcd_config, store.prefix)
    timer = threading.Timer(0.3, other.set, args=("late", b"here"))
    start = time.monotonic()
    timer.start()
    try:
        assert store.get("late") == b"here"
        elapsed = time.monotonic() - start
    finally:
        timer.join()
        other.close()
    assert 0.25 <= elapsed < 2.0


@pytest.mark.timeout(30)
def test_wait_timeout_is_prompt_and_names_the_missing_keys(store: EtcdStore) -> None:
    store.set("here", b"1")
    start = time.monotonic()
    with pytest.raises(EtcdStoreTimeout) as info:
        store.wait(["here", "missing-a", "missing-b"], timedelta(milliseconds=400))
    elapsed = time.monotonic() - start
    assert 0.39 <= elapsed < 1.5
    err = info.value
    assert isinstance(err, dist.DistStoreError)
    assert isinstance(err, StoreTimeout)
    assert isinstance(err, TimeoutError)
    assert err.missing == ("missing-a", "missing-b")
    assert err.timeout == timedelta(milliseconds=400)
    assert "missing-a" in str(err) and "missing-b" in str(err) and "0.400 s" in str(err)


@pytest.mark.timeout(30)
def test_get_uses_the_store_timeout_through_a_prefix_store(
    etcd_config: EtcdConfig, prefix: str
) -> None:
    with EtcdStore(etcd_config, prefix, timeout=timedelta(milliseconds=250)) as s:
        assert s.timeout == timedelta(milliseconds=250)
        start = time.monotonic()
        with pytest.raises(dist.DistStoreError, match=r"'pg/never'.*0\.250 s"):
            dist.PrefixStore("pg", s).get("never")
        assert time.monotonic() - start < 1.5


@pytest.mark.timeout(30)
def test_two_prefixes_are_isolated(etcd_config: EtcdConfig, job_name: str) -> None:
    client = EtcdClient(etcd_config)
    a = EtcdStore(client, f"/resilient/{job_name}/a")
    b = EtcdStore(client, f"/resilient/{job_name}/ab/")  # "/a" must not see "/ab/"
    try:
        a.set("k", b"from-a")
        b.set("k", b"from-b")
        b.set("only-b", b"1")
        assert a.get("k") == b"from-a" and b.get("k") == b"from-b"
        assert not a.check(["only-b"])
        assert (a.num_keys(), b.num_keys()) == (1, 2)
        assert a.delete_prefix() == 1
        assert b.list_keys() == ["k", "only-b"]
    finally:
        b.delete_prefix()
        a.close()
        b.close()
        client.close()


def _hammer(config: EtcdConfig, prefix: str, n: int, out: list[int]) -> None:
    with EtcdStore(config, prefix) as s:  # own client: real concurrent etcd traffic
        for _ in range(n):
            out.append(s.add("counter", 1))
            s.append("log", b"x")


@pytest.mark.timeout(60)
def test_add_and_append_are_atomic_under_contention(
    store: EtcdStore, etcd_config: EtcdConfig
) -> None:
    threads_n, per_thread = 4, 25
    seen: list[int] = []
    threads = [
        threading.Thread(target=_hammer, args=(etcd_config, store.prefix, per_thread, seen))
        for _ in range(threads_n)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=50)
    total = threads_n * per_thread
    assert sorted(seen) == list(range(1, total + 1))  # every add saw a distinct value
    assert store.add("counter", 0) == total
    assert store.get("log") == b"x" * total


@pytest.mark.timeout(30)
def test_compare_set_has_one_winner(store: EtcdStore, etcd_config: EtcdConfig) -> None:
    results: dict[int, bytes] = {}

    def contend(i: int) -> None:
        with EtcdStore(etcd_config, store.prefix) as s:
            results[i] = s.compare_set("leader", b"", f"rank{i}".encode())

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=20)
    winner = store.get("leader")
    assert set(results.values()) == {winner}


@pytest.mark.timeout(30)
def test_lazy_client_pickle_clone_and_close(etcd_config: EtcdConfig, prefix: str) -> None:
    s = EtcdStore(etcd_config, prefix, timeout=timedelta(seconds=7))
    assert s._client is None  # no gRPC channel before first use: safe across fork/spawn
    copy = pickle.loads(pickle.dumps(s))
    assert isinstance(copy, EtcdStore) and copy.prefix == prefix
    assert copy.timeout == timedelta(seconds=7) and copy._client is None
    copy.set("k", b"v")
    assert s.get("k") == b"v"
    clone = dist.PrefixStore("x", s).clone()  # torch calls EtcdStore.clone
    gc.collect()
    clone.set("c", b"1")  # the Python clone must still be alive behind the C++ one
    assert s.get("x/c") == b"1"
    copy.close()
    s.delete_prefix()
    s.close()
    s.close()
    with pytest.raises(MembershipError, match="closed"):
        s.get("k")


@pytest.mark.timeout(30)
def test_store_held_only_by_torch_stays_usable_until_closed(
    etcd_config: EtcdConfig, prefix: str
) -> None:
    wrapped = dist.PrefixStore("pg", EtcdStore(etcd_config, prefix))  # no Python reference
    gc.collect()
    wrapped.set("k", b"v")
    assert wrapped.get("k") == b"v"
    inner = wrapped.underlying_store
    assert isinstance(inner, EtcdStore)
    assert inner.list_keys() == ["pg/k"]
    assert inner.delete_prefix() == 1
    inner.close()


@pytest.mark.timeout(30)
def test_close_leaves_a_shared_client_open(etcd_config: EtcdConfig, prefix: str) -> None:
    client = EtcdClient(etcd_config)
    try:
        with EtcdStore(client, prefix) as s:
            s.set("k", b"v")
        assert client.get(prefix + "k") is not None
        assert client.delete_prefix(prefix) == 1
    finally:
        client.close()


# -- etcd outages ----------------------------------------------------------------------


@pytest.fixture
def private_etcd() -> Iterator[EmbeddedEtcd]:
    """An etcd this test alone may kill and restart."""
    with EmbeddedEtcd(fsync=False) as server:
        yield server


def _fast_config(server: EmbeddedEtcd) -> EtcdConfig:
    return EtcdConfig(endpoints=server.endpoints, request_timeout_s=0.5, retry_budget_s=1.0)


@pytest.mark.timeout(60)
def test_a_waiting_get_survives_an_etcd_restart(private_etcd: EmbeddedEtcd) -> None:
    cfg = _fast_config(private_etcd)
    waiter = EtcdStore(cfg, "/r/store/", timeout=timedelta(seconds=30))
    setter = EtcdStore(cfg, "/r/store/")
    got: list[bytes] = []
    thread = threading.Thread(target=lambda: got.append(waiter.get("k")))
    try:
        waiter.set("warm", b"1")
        thread.start()
        time.sleep(0.2)
        private_etcd.kill(0)
        time.sleep(1.5)  # longer than the client's retry budget: polls fail meanwhile
        private_etcd.restart(0)
        setter.set("k", b"after-restart")
        thread.join(timeout=20)
        assert got == [b"after-restart"]
    finally:
        thread.join(timeout=20)
        waiter.close()
        setter.close()


@pytest.mark.timeout(60)
def test_etcd_down_bounds_calls(private_etcd: EmbeddedEtcd) -> None:
    s = EtcdStore(_fast_config(private_etcd), "/r/store/", timeout=timedelta(seconds=1.5))
    try:
        s.set("warm", b"1")
        private_etcd.kill(0)
        start = time.monotonic()
        with pytest.raises(EtcdStoreTimeout, match="etcd unreachable") as info:
            s.get("k")
        assert 1.5 <= time.monotonic() - start < 3.5
        assert isinstance(info.value.__cause__, EtcdUnavailable)
        start = time.monotonic()
        with pytest.raises(EtcdUnavailable):
            s.set("k", b"v")
        assert time.monotonic() - start < 3.5
    finally:
        s.close()


# -- gloo rendezvous -------------------------------------------------------------------


def _run_ranks(
    config: EtcdConfig, prefix: str, world: int, pg_prefixes: list[str], out: Path
) -> dict[int, Any]:
    """Spawn ``world`` children running the worker; always reap them; return their reports."""
    ctx = mp.get_context("spawn")
    procs = [
        ctx.Process(
            target=_gloo_store_worker.run_rank,
            args=(config, prefix, rank, world, pg_prefixes, str(out)),
            daemon=True,
        )
        for rank in range(world)
    ]
    try:
        for p in procs:
            p.start()
        deadline = time.monotonic() + 100
        for p in procs:
            p.join(timeout=max(0.1, deadline - time.monotonic()))
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
            p.join(timeout=10)
    reports = {}
    for rank in range(world):
        path = out / f"rank{rank}.json"
        reports[rank] = json.loads(path.read_text()) if path.exists() else None
    codes = [p.exitcode for p in procs]
    assert codes == [0] * world, f"exit codes {codes}; reports {reports}"
    return reports


@pytest.mark.timeout(150)
def test_gloo_group_of_four_rendezvous_through_etcd(
    store: EtcdStore, etcd_config: EtcdConfig, tmp_path: Path
) -> None:
    world = 4
    reports = _run_ranks(etcd_config, store.prefix, world, ["pg0"], tmp_path)
    expected = [float(sum(range(1, world + 1)))] * 8
    for rank, report in reports.items():
        assert report is not None and report["ok"], f"rank {rank}: {report}"
        assert report["results"]["pg0"] == expected
    assert all(k.startswith("pg0/") for k in store.list_keys())
    assert store.num_keys() >= world  # one address record per rank


@pytest.mark.timeout(150)
def test_two_rank_group_rebuilt_under_a_new_prefix(
    store: EtcdStore, etcd_config: EtcdConfig, tmp_path: Path
) -> None:
    reports = _run_ranks(etcd_config, store.prefix, 2, ["link-0-1/e1", "link-0-1/e2"], tmp_path)
    for rank, report in reports.items():
        assert report is not None and report["ok"], f"rank {rank}: {report}"
        assert report["results"] == {"link-0-1/e1": [3.0] * 8, "link-0-1/e2": [3.0] * 8}
    keys = store.list_keys()
    assert any(k.startswith("link-0-1/e1/") for k in keys)
    assert any(k.startswith("link-0-1/e2/") for k in keys)
    assert store.delete_prefix() == len(keys)
    assert store.num_keys() == 0


@pytest.mark.timeout(60)
def test_gloo_rendezvous_without_peer_raises_store_timeout(store: EtcdStore) -> None:
    opts = dist.ProcessGroupGloo._Options()
    opts._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    opts._timeout = timedelta(seconds=1)
    start = time.monotonic()
    with pytest.raises(EtcdStoreTimeout) as info:
        dist.ProcessGroupGloo(dist.PrefixStore("lonely", store), 0, 2, opts)
    assert time.monotonic() - start < 5
    assert info.value.missing == ("lonely/0/1",)
    assert info.value.timeout == timedelta(seconds=1)
