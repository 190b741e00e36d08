"""A dead node agent is known by its machine's refusal, not its lease (membership.node_probe),
against a real etcd: an agent whose process is gone (its beacon closed, no more
keep-alives) is found lost and evicted in well under its lease TTL, with its
ranks' member keys, and a spare claims it as soon; an agent that merely stops
answering (a cut network, a stopped process) proves nothing and waits for its lease."""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator

import pytest

from membership.etcd_client import EtcdClient
from membership.keys import JobKeys
from membership.node_probe import Beacon, evict, refused
from membership.nodes import NodeInfo, NodeRendezvous
from resilient.config import EtcdConfig
from tests.membership._nodes import TOKEN, info, running_job

# Long, so that a node found lost within a couple of seconds was found by its beacon.
TTL_S = 10.0


@pytest.fixture
def silent() -> Iterator[str]:
    """An address whose connects go unanswered, as across a cut network: a listener
    whose accept queue is full (the kernel drops further SYNs, no reset)."""
    server = socket.create_server(("127.0.0.1", 0), backlog=0)
    address = f"127.0.0.1:{server.getsockname()[1]}"
    held = []
    for _ in range(4):
        c = socket.socket()
        c.setblocking(False)
        c.connect_ex(server.getsockname())
        held.append(c)
    time.sleep(0.2)  # the handshakes that fit are done; the queue is full
    try:
        yield address
    finally:
        for c in held:
            c.close()
        server.close()


def running(
    made: list[NodeRendezvous], cfg: EtcdConfig, job: str, probe_of_1: str = ""
) -> list[NodeRendezvous]:
    return running_job(made, cfg, job, ttl_s=TTL_S, probe_of_1=probe_of_1)


def member(client: EtcdClient, keys: JobKeys, rank: int) -> None:
    """``rank`` holding its member key under a lease of its own, as a live rank does."""
    lease = client.grant_lease(int(TTL_S))
    record = {"rank": rank, "incarnation": 0, "rails": [], "host": "h", "pid": 1, "joined_at": 0}
    client.put(keys.member(rank), json.dumps(record), lease=lease)


def die(agent: NodeRendezvous) -> None:
    """What a SIGKILL does to an agent: no more keep-alives, its sockets closed."""
    agent._stop.set()
    assert agent._beacon is not None
    agent._beacon.close()


@pytest.mark.timeout(20)
def test_a_live_beacon_answers_and_a_closed_one_is_refused() -> None:
    beacon = Beacon("http://127.0.0.1:2379")
    assert beacon.address.startswith("127.0.0.1:")
    try:
        for _ in range(100):  # more than a listen backlog: each probe is accepted
            assert not refused(beacon.address)
    finally:
        beacon.close()
    assert refused(beacon.address)


@pytest.mark.timeout(20)
@pytest.mark.parametrize("address", ["silent", "", "no-port", "host:x"])
def test_no_answer_or_no_address_proves_nothing(address: str, silent: str) -> None:
    began = time.monotonic()
    assert not refused(silent if address == "silent" else address)
    assert time.monotonic() - began < 2.0  # bounded: one connect's timeout at most


@pytest.mark.timeout(60)
def test_a_dead_agents_node_is_lost_and_evicted_well_before_its_lease_lapses(
    etcd_config: EtcdConfig, job_name: str, made: list[NodeRendezvous]
) -> None:
    agents = running(made, etcd_config, job_name)
    keys, client = JobKeys(job_name), EtcdClient(etcd_config)
    try:
        member(client, keys, 2)  # node 1's ranks: 2 and 3
        member(client, keys, 0)  # node 0's, untouched
        assert agents[0].lost_nodes(probe=(1,)) == []  # alive: its beacon answers
        die(agents[1])
        began = time.monotonic()
        lost: list[int] = []
        while not lost and time.monotonic() - began < 3.0:
            lost = agents[0].lost_nodes(probe=(1,))
            time.sleep(0.05)
        assert lost == [1], "a dead agent's node was not found lost by its beacon"
        assert time.monotonic() - began < TTL_S / 3
        assert client.get(keys.node(1)) is None and client.get(keys.member(2)) is None
        assert client.get(keys.member(0)) is not None and client.get(keys.node(0)) is not None
        assert "refused its agent's beacon" in agents[0].lost_why[1]
    finally:
        client.close()


@pytest.mark.timeout(60)
def test_a_spare_claims_a_dead_agents_node_at_once(
    etcd_config: EtcdConfig, job_name: str, made: list[NodeRendezvous]
) -> None:
    agents = running(made, etcd_config, job_name)
    spare = NodeRendezvous(etcd_config, job_name, TOKEN, info(-1), lease_ttl_s=TTL_S, spare=True)
    made.append(spare)
    spare.register_spare()
    die(agents[1])
    began = time.monotonic()
    assert spare.wait_for_loss(lambda: time.monotonic() - began > 5.0) == 1
    assert time.monotonic() - began < TTL_S / 3
    assert spare.me.node_rank == 1 and spare.me.probe  # it publishes a beacon of its own
    # A slower prober that also found the old agent dead comes after the claim: it
    # must leave the spare's lease alone (it revoked the spare once, fencing it).
    keys, client = JobKeys(job_name), EtcdClient(etcd_config)
    try:
        assert not evict(client, keys, 1, (2, 3), agents[1].me.probe)
        held = client.get(keys.node(1))
        assert held is not None and NodeInfo.from_json(held.value).probe == spare.me.probe
        assert agents[0].lost_nodes(probe=(1,)) == []  # the spare's beacon answers
    finally:
        client.close()


@pytest.mark.timeout(60)
def test_an_agent_that_only_stops_answering_waits_for_its_lease(
    etcd_config: EtcdConfig, job_name: str, made: list[NodeRendezvous], silent: str
) -> None:
    # Node 1's beacon answers nothing (a partition, a SIGSTOPped agent): no proof.
    agents = running(made, etcd_config, job_name, probe_of_1=silent)
    agents[1]._stop.set()  # no more keep-alives either
    deadline = time.monotonic() + 2.0
    while time.monotonic() < deadline:
        assert agents[0].lost_nodes(probe=None) == []
        time.sleep(0.1)
    assert agents[0].lost_why == {}
