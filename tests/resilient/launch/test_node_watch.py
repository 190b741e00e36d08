"""Node events from the agents (resilient.launch.node_watch), without etcd: a stand-in
rendezvous says which nodes are lost, a stand-in lease watch records what is
announced. The agents' real events are asserted in tests/integration/test_nodes.py."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest

from membership.nodes import NodeInfo
from recovery._resize import _unreplaced
from resilient.events import EVENT_KINDS
from resilient.launch.launch_config import LaunchConfig
from resilient.launch.node_agent import NodeMeeting
from resilient.launch.node_watch import NodeWatch, fenced_events, takeover_events
from resilient.launch.slots import Slot


class _Rendezvous:
    def __init__(self, lost: list[int], spares: int = 0) -> None:
        self.spare, self._lost, self._spares = False, lost, spares
        self.fenced: str | None = None
        self.me = NodeInfo(node_rank=0, nnodes=3, nproc_per_node=2, rails=1, host="h0", pid=10)
        self.seen = {
            k: NodeInfo(node_rank=k, nnodes=3, nproc_per_node=2, rails=1, host=f"h{k}", pid=10 + k)
            for k in range(3)
        }
        self.reads = 0
        self.probed: list[tuple[int, ...]] = []
        self.lost_why: dict[int, str] = {}

    def why_lost(self, node: int) -> str:
        return self.lost_why.get(node, "its node lease lapsed")

    def lost_nodes(self, probe: tuple[int, ...] = ()) -> list[int]:
        self.reads += 1
        self.probed.append(tuple(probe))
        return self._lost

    def spares(self) -> int:
        return self._spares

    def incarnation_of(self, rank: int) -> int:
        return 0


class _Leases:
    def __init__(self) -> None:
        self.said: list[tuple[int, int, str]] = []

    def announce(self, rank: int, incarnation: int, how: str, eta_s: float | None) -> None:
        self.said.append((rank, incarnation, how))


def _watch(
    tmp_path: Path, rendezvous: _Rendezvous, node_rank: int = 0, min_ranks: int | None = 2
) -> tuple[NodeWatch, _Leases, list[tuple[str, dict[str, Any]]]]:
    script = tmp_path / "t.py"
    script.write_text("")
    cfg = LaunchConfig(
        nproc=2, nnodes=3, node_rank=node_rank, etcd="http://127.0.0.1:1", script=str(script),
        min_ranks=min_ranks,
    )  # fmt: skip
    meeting = NodeMeeting(rendezvous, {}, "127.0.0.1", 1, None)  # type: ignore[arg-type]
    leases, said = _Leases(), []
    watch = NodeWatch(
        cfg, meeting, leases,  # type: ignore[arg-type]
        emit=lambda kind, **f: said.append((kind, f)), notice=lambda _: None,
    )  # fmt: skip
    return watch, leases, said


@pytest.mark.timeout(10)
def test_node_kinds_are_known() -> None:
    assert {"node.lost", "node.fenced", "node.taken_over", "node.returned"} <= EVENT_KINDS


@pytest.mark.timeout(10)
def test_a_lost_node_without_a_spare_is_reported_once_and_its_ranks_announced_none(
    tmp_path: Path,
) -> None:
    rendezvous = _Rendezvous(lost=[2])
    watch, leases, said = _watch(tmp_path, rendezvous)
    watch.poll()
    watch.poll()  # within the poll interval: no second read
    assert rendezvous.reads == 1
    assert leases.said == [(4, 0, "none"), (5, 0, "none")]
    kinds = [k for k, _ in said]
    assert kinds == ["node.lost", "rank.lost", "rank.lost"]
    lost = said[0][1]
    assert (lost["node"], lost["ranks"], lost["host"], lost["pid"]) == (2, [4, 5], "h2", 12)
    assert lost["seen_by"] == 0 and "goes on without ranks [4, 5]" in lost["action"]
    assert all(f["left"] for k, f in said if k == "rank.lost")
    watch._due = 0.0  # the next poll: the same loss is not reported again
    watch.poll()
    assert len(said) == 3


@pytest.mark.timeout(10)
def test_only_the_lowest_live_node_speaks_and_a_spare_keeps_survivors_quiet(
    tmp_path: Path,
) -> None:
    watch, leases, said = _watch(tmp_path, _Rendezvous(lost=[2]), node_rank=1)
    watch.poll()
    assert not said and not leases.said  # node 0 speaks for all
    watch, leases, said = _watch(tmp_path, _Rendezvous(lost=[2], spares=1))
    watch.poll()
    assert not said and not leases.said  # the spare takes it over and says so


@pytest.mark.timeout(10)
def test_below_the_floor_the_ranks_are_not_left_out(tmp_path: Path) -> None:
    watch, leases, said = _watch(tmp_path, _Rendezvous(lost=[2]), min_ranks=6)
    watch.poll()
    assert [h for *_, h in leases.said] == ["none", "none"]  # still: nothing restarts them
    assert "no shrink allowed" in said[0][1]["action"]
    assert not any(f["left"] for k, f in said if k == "rank.lost")


@pytest.mark.timeout(10)
def test_fenced_and_taken_over_events_name_node_ranks_and_agent() -> None:
    said: list[tuple[str, dict[str, Any]]] = []

    def emit(kind: str, **f: Any) -> None:
        said.append((kind, f))

    slots = [Slot(2, incarnation=0), Slot(3, incarnation=0)]
    fenced_events(emit, 1, slots, "its node lease was not refreshed for 1.6 s", 5.0)
    assert all(f["ts"] == 5.0 for _, f in said)  # dated when the fence struck
    assert said[0] == ("node.fenced", said[0][1]) and said[0][1]["pid"] == os.getpid()
    assert (said[0][1]["node"], said[0][1]["ranks"]) == (1, [2, 3]) and said[0][1]["host"]
    assert [k for k, _ in said[1:]] == ["rank.lost", "rank.lost"]
    said.clear()
    rendezvous = _Rendezvous(lost=[])
    rendezvous.took_from = rendezvous.seen[1]  # type: ignore[attr-defined]
    rendezvous.seen[1] = rendezvous.me  # once claimed, node 1's record is the spare's
    meeting = NodeMeeting(rendezvous, {}, "127.0.0.1", 1, None)  # type: ignore[arg-type]
    took = [Slot(2, incarnation=1), Slot(3, incarnation=1)]
    takeover_events(emit, meeting, 1, took)
    assert [k for k, _ in said] == [
        "node.lost", "node.taken_over", "recovery.started", "recovery.started",
    ]  # fmt: skip
    over = said[1][1]
    assert (over["node"], over["ranks"], over["pid"], over["lost_pid"]) == (1, [2, 3], 10, 11)
    assert over["incarnations"] == {"2": 1, "3": 1}
    # The node's own agent, started again, took it back: node.lost was written
    # when the loss was found, so only node.returned and the ranks' recoveries.
    said.clear()
    meeting.came_back = True
    takeover_events(emit, meeting, 1, took)
    assert [k for k, _ in said] == ["node.returned", "recovery.started", "recovery.started"]
    back = said[0][1]
    assert (back["node"], back["ranks"], back["pid"], back["incarnations"]) == (
        1, [2, 3], 10, {"2": 1, "3": 1},
    )  # fmt: skip
    assert "took lost node 1 back" in said[1][1]["action"]


class _Membership:
    def __init__(self, said: dict[int, dict[str, Any]]) -> None:
        self._said = said

    def replacements(self) -> dict[int, dict[str, Any]]:
        return self._said


class _Pg:
    def __init__(self, members: tuple[int, ...], said: dict[int, dict[str, Any]]) -> None:
        self.members, self.membership = members, _Membership(said)


@pytest.mark.timeout(10)
def test_survivors_give_up_every_member_announced_none() -> None:
    said = {2: {"how": "none"}, 3: {"how": "none"}, 1: {"how": "cold"}, 7: {"how": "none"}}
    assert _unreplaced(_Pg((0, 1, 2, 3), said)) == {2, 3}  # 7: not a member any more
    assert _unreplaced(object()) == set()  # no membership (torchrun)


@pytest.mark.parametrize(("me", "probed"), [(0, (2,)), (1, (0,)), (2, (1,))])
def test_each_agent_knocks_on_the_beacon_of_the_next_node_below_it(
    tmp_path: Path, me: int, probed: tuple[int, ...]
) -> None:
    rendezvous = _Rendezvous(lost=[])
    watch, _, _ = _watch(tmp_path, rendezvous, node_rank=me)
    watch.poll()
    assert rendezvous.probed == [probed]  # one prober per node, the lowest takes the highest
