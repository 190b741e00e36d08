"""Node leases fence their agent, and spare nodes claim lost ones (membership.nodes),
against a real etcd: a cut-off agent is told to stop its ranks before etcd could
expire its node key; of two spares only one takes a lost node over, and only once
its ranks' member keys are gone too; a finished node is not lost; node 0 is not
survivable."""

from __future__ import annotations

import json
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import replace

import pytest

from membership.etcd_client import EtcdClient
from membership.keys import JobKeys
from membership.nodes import DONE, NodeInfo, NodeRendezvous, fence_margin
from membership.server import EmbeddedEtcd
from resilient.config import EtcdConfig
from resilient.errors import ConfigError, MembershipError
from tests.membership import _nodes
from tests.membership._nodes import TOKEN, info

TTL_S = 2.0


def node(
    made: list[NodeRendezvous], cfg: EtcdConfig, job: str, me: NodeInfo, *, spare: bool = False
) -> NodeRendezvous:
    r = NodeRendezvous(cfg, job, TOKEN, me, lease_ttl_s=TTL_S, spare=spare)
    made.append(r)
    return r


def running_job(made: list[NodeRendezvous], cfg: EtcdConfig, job: str) -> list[NodeRendezvous]:
    return _nodes.running_job(made, cfg, job, ttl_s=TTL_S)


@pytest.fixture
def own_etcd() -> Iterator[EmbeddedEtcd]:
    """An etcd of this test's own, to freeze (SIGSTOP) without disturbing others."""
    server = EmbeddedEtcd(fsync=False)
    server.start()
    try:
        yield server
    finally:
        pid = server.member_pid(0)
        if pid is not None:
            os.kill(pid, signal.SIGCONT)
        server.stop()


@pytest.mark.timeout(60)
def test_an_agent_cut_off_from_etcd_is_fenced_before_its_lease_could_expire(
    own_etcd: EmbeddedEtcd, job_name: str, made: list[NodeRendezvous]
) -> None:
    cfg = EtcdConfig(endpoints=own_etcd.endpoints, request_timeout_s=1.0, retry_budget_s=2.0)
    agent = node(made, cfg, job_name, info(1))
    agent.register()
    fired: list[tuple[float, str]] = []
    done = threading.Event()

    def fence(why: str) -> None:
        fired.append((time.monotonic(), why))
        done.set()

    agent.watch_lease(fence)
    time.sleep(1.5)  # a few keep-alives go through
    assert not fired
    pid = own_etcd.member_pid(0)
    assert pid is not None
    cut = time.monotonic()
    os.kill(pid, signal.SIGSTOP)  # etcd stops answering: connections hang, as when cut off
    assert done.wait(TTL_S + 1.0), "not fenced within the lease TTL + 1 s"
    at, why = fired[0]
    # The last acknowledged keep-alive was sent at fence_at() + margin - TTL: etcd
    # expires the key no earlier than TTL after it; the fence came margin before.
    acked = agent.fence_at() + agent.fence_margin_s - TTL_S
    assert acked <= cut
    assert agent.fence_at() - 0.05 <= at <= agent.fence_at() + 0.3, (at - acked, why)
    assert at - acked < TTL_S - fence_margin(TTL_S) / 2
    assert "node lease was not refreshed for" in why and agent.fenced == why
    assert len(fired) == 1


@pytest.mark.timeout(30)
def test_a_lease_etcd_dropped_fences_at_once(
    etcd_config: EtcdConfig, job_name: str, made: list[NodeRendezvous]
) -> None:
    agent = node(made, etcd_config, job_name, info(1))
    agent.register()
    done = threading.Event()
    agent.watch_lease(lambda why: done.set())
    client = EtcdClient(etcd_config)
    try:
        row = client.get(JobKeys(job_name).node(1))
        assert row is not None
        dropped = time.monotonic()
        client.revoke_lease(row.lease)
    finally:
        client.close()
    assert done.wait(TTL_S), "not fenced after etcd dropped the lease"
    assert time.monotonic() - dropped < TTL_S / 3 + 0.5  # the next keep-alive found it gone
    assert agent.fenced == "etcd says its node lease expired"


@pytest.mark.timeout(60)
def test_of_two_spares_one_takes_a_lost_node_over_with_the_next_incarnations(
    etcd_config: EtcdConfig, job_name: str, made: list[NodeRendezvous]
) -> None:
    agents = running_job(made, etcd_config, job_name)
    spares = [node(made, etcd_config, job_name, info(-1, pid=2000 + i), spare=True) for i in (0, 1)]
    for s in spares:
        s.register_spare()
    keys = JobKeys(job_name)
    client = EtcdClient(etcd_config)
    try:
        # Node 1's rank 3 runs as incarnation 2 (a member key); rank 2 was last
        # restarted as incarnation 4 (its supervisor's replacement record).
        member = {"rank": 3, "incarnation": 2, "rails": [], "host": "h", "pid": 1, "joined_at": 0}
        client.put(keys.member(3), json.dumps(member))
        client.put(keys.replacement(2), json.dumps({"incarnation": 4, "how": "cold"}))
        stop = threading.Event()
        won: list[tuple[int, int | None]] = []
        errors: list[BaseException] = []

        def wait(i: int) -> None:
            try:
                won.append((i, spares[i].wait_for_loss(stop.is_set)))
            except MembershipError as exc:
                errors.append(exc)

        threads = [threading.Thread(target=wait, args=(i,), daemon=True) for i in (0, 1)]
        for t in threads:
            t.start()
        time.sleep(0.6)
        assert not won, "a spare claimed a node that is running"
        agents[1].close()  # node 1's key goes, its state still says running
        time.sleep(0.6)
        assert not won, "a spare claimed a node whose rank 3 still holds its member key"
        client.delete(keys.member(3))  # its ranks are gone too: node 1 is lost
        assert wait_for(lambda: bool(won), 10.0)
        time.sleep(0.6)  # the other spare polls and finds nothing lost
        stop.set()
        for t in threads:
            t.join(5.0)
        assert len(won) == 1 and won[0][1] == 1, won
        assert len(errors) == 1 and "stopped waiting" in str(errors[0])
        winner = spares[won[0][0]]
        assert winner.me.node_rank == 1 and not winner.spare
        held = client.get(keys.node(1))
        assert held is not None and NodeInfo.from_json(held.value).pid == winner.me.pid
        assert winner.incarnations(range(2, 4)) == {2: 5, 3: 3}
        # Its spare key went in the same transaction; the loser's is still there.
        rows, _ = client.get_prefix(keys.spare_nodes)
        assert len(rows) == 1
    finally:
        client.close()


def wait_for(predicate: Callable[[], bool], timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return False


@pytest.mark.timeout(60)
def test_a_finished_node_is_not_lost_and_a_spare_leaves_when_all_are_done(
    etcd_config: EtcdConfig, job_name: str, made: list[NodeRendezvous]
) -> None:
    agents = running_job(made, etcd_config, job_name)
    spare = node(made, etcd_config, job_name, info(-1), spare=True)
    spare.register_spare()
    got: list[int | None] = []
    waiter = threading.Thread(target=lambda: got.append(spare.wait_for_loss()), daemon=True)
    waiter.start()
    agents[1].set_state(DONE)
    agents[1].close()
    time.sleep(0.8)
    assert waiter.is_alive(), "a spare took a finished node over"
    agents[0].set_state(DONE)
    agents[0].close()
    waiter.join(5.0)
    assert got == [None]


@pytest.mark.timeout(60)
def test_a_spare_leaves_once_node_0_is_done_even_if_another_node_was_lost(
    etcd_config: EtcdConfig, job_name: str, made: list[NodeRendezvous]
) -> None:
    # The job shrank by node 1 (no spare then) and finished: nothing to take over.
    agents = running_job(made, etcd_config, job_name)
    agents[1].close()
    agents[0].set_state(DONE)
    agents[0].close()
    spare = node(made, etcd_config, job_name, info(-1), spare=True)
    spare.register_spare()
    assert spare.wait_for_loss() is None


@pytest.mark.timeout(60)
def test_a_lost_node_0_is_not_survivable(
    etcd_config: EtcdConfig, job_name: str, made: list[NodeRendezvous]
) -> None:
    agents = running_job(made, etcd_config, job_name)
    spare = node(made, etcd_config, job_name, info(-1), spare=True)
    spare.register_spare()
    agents[0].close()
    with pytest.raises(MembershipError, match="node 0 was lost; it hosts torch's init store"):
        spare.wait_for_loss()


@pytest.mark.timeout(60)
def test_under_a_run_id_a_spare_takes_node_0_over_with_an_init_store_of_its_own(
    etcd_config: EtcdConfig, job_name: str, made: list[NodeRendezvous]
) -> None:
    agents = [node(made, etcd_config, job_name, replace(info(0), run="run-1"))]
    agents.append(node(made, etcd_config, job_name, info(1)))
    threads = [threading.Thread(target=a.join, args=(20.0,), daemon=True) for a in agents]
    for t in threads:
        t.start()
    for t in threads:
        t.join(25.0)
    spare = node(made, etcd_config, job_name, info(-1), spare=True)
    spare.register_spare()
    assert sorted(spare.agreeing()) == [0, 1]  # a waiting spare has read node 0's record
    agents[0].close()
    assert spare.wait_for_loss(store=lambda: "127.0.0.1:4242") == 0
    now = agents[1].agreeing()[0]
    assert (now.store, now.run, now.pid) == ("127.0.0.1:4242", "run-1", spare.me.pid)
    assert spare.took_from is not None and spare.took_from.pid == 1000


@pytest.mark.timeout(30)
def test_a_spare_that_disagrees_with_the_nodes_is_refused(
    etcd_config: EtcdConfig, job_name: str, made: list[NodeRendezvous]
) -> None:
    node(made, etcd_config, job_name, info(0)).register()
    spare = node(made, etcd_config, job_name, info(-1, nproc=3), spare=True)
    with pytest.raises(ConfigError, match=r"a spare node disagrees with node 0 .*--nproc-per-node"):
        spare.register_spare()
