"""Node agents meeting in a real etcd (membership.nodes): the wait, and bad input
refused with the node and the mismatch named while the others are untouched."""

from __future__ import annotations

import re
import threading
from collections.abc import Iterator

import pytest

from membership.etcd_client import EtcdClient
from membership.keys import JobKeys
from membership.nodes import NodeInfo, NodeRendezvous
from resilient.config import EtcdConfig
from resilient.errors import ConfigError, JobTokenMismatch, MembershipError

TOKEN = "t0ken"


def info(node_rank: int, *, nnodes: int = 2, nproc: int = 2, rails: int = 1) -> NodeInfo:
    return NodeInfo(
        node_rank=node_rank, nnodes=nnodes, nproc_per_node=nproc, rails=rails,
        host="host", pid=1000 + node_rank, store="127.0.0.1:29500" if node_rank == 0 else "",
    )  # fmt: skip


@pytest.fixture
def agents(etcd_config: EtcdConfig, job_name: str) -> Iterator[list[NodeRendezvous]]:
    """Every agent a test makes is closed after it."""
    made: list[NodeRendezvous] = []
    yield made
    for agent in made:
        agent.close()


def agent(
    made: list[NodeRendezvous], cfg: EtcdConfig, job: str, me: NodeInfo, token: str = TOKEN
) -> NodeRendezvous:
    a = NodeRendezvous(cfg, job, token, me, lease_ttl_s=2.0)
    made.append(a)
    return a


def node_keys(cfg: EtcdConfig, job: str) -> list[str]:
    client = EtcdClient(cfg)
    try:
        rows, _ = client.get_prefix(JobKeys(job).nodes)
        return [kv.key for kv in rows]
    finally:
        client.close()


@pytest.mark.timeout(30)
def test_agents_wait_for_each_other_and_see_node_0s_store(
    agents: list[NodeRendezvous], etcd_config: EtcdConfig, job_name: str
) -> None:
    first = agent(agents, etcd_config, job_name, info(1))
    got: dict[int, NodeInfo] = {}
    waiter = threading.Thread(target=lambda: got.update(first.join(20.0)), daemon=True)
    waiter.start()
    waiter.join(0.6)
    assert waiter.is_alive(), "node 1 must wait for node 0"
    nodes = agent(agents, etcd_config, job_name, info(0)).join(20.0)
    waiter.join(20.0)
    assert not waiter.is_alive()
    assert sorted(nodes) == sorted(got) == [0, 1]
    assert got[0].store == "127.0.0.1:29500" and got[1].pid == 1001
    agents[0].close()
    assert node_keys(etcd_config, job_name) == [JobKeys(job_name).node(0)]


@pytest.mark.timeout(30)
def test_two_agents_claiming_one_node_rank(
    agents: list[NodeRendezvous], etcd_config: EtcdConfig, job_name: str
) -> None:
    holder = agent(agents, etcd_config, job_name, info(1))
    holder.register()
    second = agent(agents, etcd_config, job_name, info(1, nproc=4))
    with pytest.raises(ConfigError, match=r"node rank 1 is already held by agent pid 1001 on host"):
        second.join(5.0)
    # The holder is untouched: its record, not the newcomer's, is there.
    assert list(holder.agreeing()) == [1]
    assert holder.agreeing()[1].nproc_per_node == 2
    assert node_keys(etcd_config, job_name) == [JobKeys(job_name).node(1)]


@pytest.mark.parametrize(
    ("late", "what"),
    [
        (info(1, nproc=3), "--nproc-per-node 2 there, 3 here"),
        (info(1, rails=2), "rail count (--rails) 1 there, 2 here"),
        (info(1, nnodes=3), "--nnodes 2 there, 3 here"),
    ],
)
@pytest.mark.timeout(30)
def test_a_later_agent_that_disagrees_is_refused_and_the_earlier_waits_on(
    agents: list[NodeRendezvous],
    etcd_config: EtcdConfig,
    job_name: str,
    late: NodeInfo,
    what: str,
) -> None:
    early = agent(agents, etcd_config, job_name, info(0))
    early.register()
    bad = agent(agents, etcd_config, job_name, late)
    with pytest.raises(ConfigError) as caught:
        bad.join(5.0)
    assert re.search(r"node 1 disagrees with node 0 \(agent pid 1000 on host\)", str(caught.value))
    assert what in str(caught.value)
    assert node_keys(etcd_config, job_name) == [JobKeys(job_name).node(0)]
    # The earlier agent still waits, and a good node 1 completes the job.
    nodes = agent(agents, etcd_config, job_name, info(1)).join(10.0)
    assert sorted(nodes) == [0, 1] and sorted(early.wait(5.0)) == [0, 1]


@pytest.mark.timeout(30)
def test_an_agent_with_another_token_reads_and_writes_nothing(
    agents: list[NodeRendezvous], etcd_config: EtcdConfig, job_name: str
) -> None:
    agent(agents, etcd_config, job_name, info(0)).register()
    intruder = agent(agents, etcd_config, job_name, info(1), token="other")
    with pytest.raises(JobTokenMismatch, match=job_name):
        intruder.join(5.0)
    assert node_keys(etcd_config, job_name) == [JobKeys(job_name).node(0)]


@pytest.mark.timeout(30)
def test_waiting_is_bounded_and_names_the_missing_nodes(
    agents: list[NodeRendezvous], etcd_config: EtcdConfig, job_name: str
) -> None:
    lonely = agent(agents, etcd_config, job_name, info(2, nnodes=4))
    missing = r"waited 0.5 s for 4 node agents; node\(s\) \[0, 1, 3\]"
    with pytest.raises(MembershipError, match=missing):
        lonely.join(0.5)
    assert node_keys(etcd_config, job_name) == []  # its key went with its lease


def test_bad_arguments_are_refused_before_etcd(etcd_config: EtcdConfig) -> None:
    with pytest.raises(ConfigError, match="node rank 2"):
        NodeRendezvous(etcd_config, "j", TOKEN, info(2), lease_ttl_s=5.0)
    with pytest.raises(ConfigError, match="RESILIENT_TOKEN"):
        NodeRendezvous(etcd_config, "j", "", info(0), lease_ttl_s=5.0)


def test_node_records_round_trip_and_name_their_differences() -> None:
    me = info(0)
    assert NodeInfo.from_json(me.to_json()) == me
    assert me.mismatch(info(1)) is None
    assert me.mismatch(info(1, nproc=4, rails=3)) == (
        "--nproc-per-node 4 there, 2 here; rail count (--rails) 3 there, 1 here"
    )


@pytest.mark.timeout(60)
def test_a_lost_node_comes_back_only_to_a_job_that_runs_on(
    agents: list[NodeRendezvous], etcd_config: EtcdConfig, job_name: str
) -> None:
    from membership.members import Membership
    from resilient.config import MembershipConfig

    first = [agent(agents, etcd_config, job_name, info(k)) for k in (0, 1)]
    waiter = threading.Thread(target=lambda: first[1].join(20.0), daemon=True)
    waiter.start()
    first[0].join(20.0)
    waiter.join(20.0)
    first[1].close()  # node 1 is lost: its key goes with its lease, its state says running
    back = agent(agents, etcd_config, job_name, info(1))
    # No rank holds a member key: the records of a start that ended or crashed.
    assert not back.was_lost()
    members = [Membership(etcd_config, MembershipConfig(job=job_name)) for _ in range(2)]
    try:
        members[0].join(0, 0, ["127.0.0.1"], TOKEN)  # node 0's rank 0 trains on
        members[1].join(2, 0, ["127.0.0.1"], TOKEN)  # node 1's rank 2 still holds its key
        assert back.was_lost()
        with pytest.raises(MembershipError, match=r"node 1 came back, but its ranks \[2\] still"):
            back.take_back(1.0)
        members[1].leave()
        back.take_back(10.0)
        assert back.me.node_rank == 1 and not back.spare
        assert JobKeys(job_name).node(1) in node_keys(etcd_config, job_name)
        # Held again: a third agent for node 1 meets the others (and is refused there).
        assert not agent(agents, etcd_config, job_name, info(1)).was_lost()
    finally:
        for m in members:
            m.close()
