"""PrefixWatch against a real etcd that is killed, restarted and compacted."""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from membership import EmbeddedEtcd, PrefixWatch, WatchEvent
from membership.etcd_client import EtcdClient
from resilient import failures
from resilient.config import EtcdConfig
from resilient.failures import FailureConfig
from resilient.procs import wait_until


class Recorder:
    def __init__(self) -> None:
        self.events: list[WatchEvent] = []
        self.lock = threading.Lock()

    def __call__(self, ev: WatchEvent) -> None:
        with self.lock:
            self.events.append(ev)

    def keys(self, kind: str | None = None) -> list[str]:
        with self.lock:
            return [e.key for e in self.events if kind is None or e.kind == kind]


@pytest.fixture
def own_etcd() -> Iterator[EmbeddedEtcd]:
    """A private server this test may kill and restart."""
    with EmbeddedEtcd(fsync=False) as server:
        yield server


def _client(server: EmbeddedEtcd) -> EtcdClient:
    return EtcdClient(
        EtcdConfig(endpoints=server.endpoints, request_timeout_s=1.0, retry_budget_s=10.0)
    )


@pytest.mark.timeout(30)
def test_delivers_puts_and_deletes_in_order(etcd_config: EtcdConfig, job_name: str) -> None:
    prefix = f"/resilient/{job_name}/w/"
    client = EtcdClient(etcd_config)
    client.put(prefix + "before", "0")
    rec = Recorder()
    with PrefixWatch(client, prefix, rec, initial=True) as w:
        client.put(prefix + "a", "1")
        client.put(f"/resilient/{job_name}/other", "x")  # outside the prefix
        client.put(prefix + "a", "2")
        client.delete(prefix + "a")
        assert wait_until(lambda: len(rec.events) == 4, timeout_s=5)
        kinds = [(e.kind, e.key.rsplit("/", 1)[1], e.value) for e in rec.events]
        assert kinds == [
            ("put", "before", b"0"),
            ("put", "a", b"1"),
            ("put", "a", b"2"),
            ("delete", "a", None),
        ]
        assert rec.events[0].synthetic and not rec.events[1].synthetic
        assert w.snapshot() == {prefix + "before": b"0"}
    client.close()


@pytest.mark.timeout(60)
def test_keeps_delivering_after_etcd_restart(own_etcd: EmbeddedEtcd) -> None:
    client = _client(own_etcd)
    writer = _client(own_etcd)
    rec = Recorder()
    with PrefixWatch(client, "/p/", rec) as w:
        writer.put("/p/1", "a")
        assert wait_until(lambda: rec.keys() == ["/p/1"], timeout_s=5)
        own_etcd.kill(0)
        own_etcd.restart(0)  # same ports, same data dir
        writer.put("/p/2", "b")
        writer.delete("/p/1")
        assert wait_until(lambda: len(rec.events) == 3, timeout_s=15), rec.events
        assert [(e.kind, e.key) for e in rec.events] == [
            ("put", "/p/1"),
            ("put", "/p/2"),
            ("delete", "/p/1"),
        ]
        assert w.reconnects >= 1
        assert w.snapshot() == {"/p/2": b"b"}
    client.close()
    writer.close()


@pytest.mark.timeout(60)
def test_relists_when_resume_revision_was_compacted(own_etcd: EmbeddedEtcd) -> None:
    client = _client(own_etcd)
    writer = _client(own_etcd)
    writer.put("/p/a", "1")
    writer.put("/p/b", "1")
    real_add = client.add_watch_prefix
    calls = {"n": 0}

    def add_with_changes_while_away(*args: Any, **kwargs: Any) -> int:
        calls["n"] += 1
        if calls["n"] == 2:
            # Between the stream dying and the watch resuming, the prefix changes and
            # etcd compacts past the watch's revision: resuming must re-list.
            writer.delete("/p/a")
            writer.put("/p/b", "2")
            writer.put("/p/c", "1")
            rev = writer.get("/p/c")
            assert rev is not None
            writer.call("compact", lambda c: c.compact(rev.mod_revision, physical=True))
        return real_add(*args, **kwargs)

    client.add_watch_prefix = add_with_changes_while_away  # type: ignore[method-assign]
    rec = Recorder()
    with PrefixWatch(client, "/p/", rec) as w:
        own_etcd.kill(0)
        own_etcd.restart(0)
        assert wait_until(lambda: w.relists == 1 and len(rec.events) == 3, timeout_s=15)
        got = sorted((e.kind, e.key, e.value, e.synthetic) for e in rec.events)
        assert got == [
            ("delete", "/p/a", None, True),
            ("put", "/p/b", b"2", True),
            ("put", "/p/c", b"1", True),
        ]
        writer.put("/p/d", "live")  # the resumed stream still delivers
        assert wait_until(lambda: "/p/d" in rec.keys("put"), timeout_s=10)
        assert w.snapshot() == {"/p/b": b"2", "/p/c": b"1", "/p/d": b"live"}
    client.close()
    writer.close()


@pytest.fixture
def emitted(
    emitted: list[tuple[str, dict[str, Any]]], monkeypatch: pytest.MonkeyPatch
) -> list[tuple[str, dict[str, Any]]]:
    """The events emitted (tests/conftest.py), with a FailureSite reporting after 3."""
    monkeypatch.setattr(failures, "DEFAULT_CONFIG", FailureConfig(warn_every_s=60.0, event_after=3))
    return emitted


@pytest.mark.timeout(30)
def test_a_failing_callback_is_warned_at_a_bounded_rate_and_reported_once(
    etcd_config: EtcdConfig,
    job_name: str,
    emitted: list[tuple[str, dict[str, Any]]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "membership.watch")
    prefix = f"/resilient/{job_name}/cb/"
    client = EtcdClient(etcd_config)
    rec = Recorder()

    def callback(ev: WatchEvent) -> None:
        if ev.key.endswith("/bad"):
            raise ValueError("cannot parse the record")
        rec(ev)

    with PrefixWatch(client, prefix, callback, name="cb") as w:
        for i in range(4):
            client.put(f"{prefix}{i}/bad", "x")
        client.put(prefix + "ok", "1")
        assert wait_until(lambda: rec.keys() == [prefix + "ok"], timeout_s=10)
        assert w.callback_failures.total == 4 and w.callback_failures.consecutive == 0
    client.close()
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1, warned  # not one traceback per event
    assert warned[0].startswith("watch cb: callback failed (1 in a row, 1 in all")
    assert warned[0].endswith(f"'put {prefix}0/bad': ValueError: cannot parse the record")
    assert [k for k, _ in emitted] == ["monitor.failing", "monitor.recovered"]
    assert emitted[0][1]["site"] == "watch cb: callback" and emitted[0][1]["failures"] == 3
    assert any(r.getMessage() == "watch cb: callback recovered after 4 failures"
               for r in caplog.records)  # fmt: skip


@pytest.mark.timeout(60)
def test_an_etcd_outage_is_counted_and_reported_once_then_the_watch_resumes(
    own_etcd: EmbeddedEtcd,
    emitted: list[tuple[str, dict[str, Any]]],
    caplog: pytest.LogCaptureFixture,
) -> None:
    caplog.set_level(logging.INFO, "membership.watch")
    # Short bounds: each try at a dead etcd fails within a second.
    config = EtcdConfig(endpoints=own_etcd.endpoints, request_timeout_s=0.5, retry_budget_s=1.0)
    client = EtcdClient(config)
    rec = Recorder()
    with PrefixWatch(client, "/p/", rec, name="outage") as w:
        own_etcd.kill(0)
        # Retried forever with backoff (up to 1 s); each try fails within the
        # client's retry budget.
        assert wait_until(lambda: w.subscribe_failures.consecutive >= 3, timeout_s=40)
        own_etcd.restart(0)
        assert wait_until(lambda: w.subscribe_failures.consecutive == 0, timeout_s=20)
        writer = _client(own_etcd)
        writer.put("/p/after", "1")
        assert wait_until(lambda: rec.keys() == ["/p/after"], timeout_s=10)
        writer.close()
    client.close()
    sites = [(k, f["site"]) for k, f in emitted]
    assert sites == [("monitor.failing", "watch outage: resubscribe"),
                     ("monitor.recovered", "watch outage: resubscribe")]  # fmt: skip
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "resubscribe failed (1 in a row" in warned[0]
