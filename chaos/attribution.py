"""Which logged event detected a fault: the first one of a fitting kind that names
what the fault hit.

A fault hits a rank (``kill``, ``hang``, ``slow``: the process), the links of one
rank on one rail (``nic-down``, ``nic-up``, ``flap``, ``throttle``, ``drop``:
``[rank, -1, rail]``, -1 = every peer) or one link (``partition``, ``slow-link``:
``[rank, peer, rail]``), or every rank of a node (``node-kill``, ``node-partition``:
their ``ranks``). An event names a rank when its ``rank``, ``straggler`` or
``donor`` field is that rank or one of its ``links`` triples has it at either end;
it names a link when one of its triples is that link in either direction, or the
same rail (or every rail, -1) at one of its ends with peer -1 (a rail-wide
``nic.down`` or ``link.degraded`` of either end). Events of a fitting kind
(:data:`DETECT_KINDS`) that name something else are *unrelated*: they are listed,
never taken as the detection, so a busy log cannot satisfy a detection bound with
another rank's or link's trouble. A fault that names nothing an event could
(``etcd-kill``) has no fitting kinds either.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

__all__ = [
    "DETECT_KINDS",
    "Attribution",
    "Target",
    "attribute",
    "event_summary",
    "fault_target",
    "names_target",
    "unrelated_summary",
]

# Event kinds that count as the library noticing each kind of fault.
_LINK_SIGNS: Final = frozenset({"link.down", "link.degraded", "nic.down"})
DETECT_KINDS: Final = {
    "kill": frozenset({"rank.lost", "link.down"}),
    "hang": frozenset({"rank.lost", "link.down", "straggler.suspected"}),
    "slow": frozenset({"straggler.suspected", "straggler.confirmed"}),
    "slow-cpu": frozenset({"straggler.suspected", "straggler.confirmed"}),
    "etcd-kill": frozenset(),
    "etcd-leader-kill": frozenset(),
    "node-kill": frozenset({"rank.lost", "link.down"}),
    "node-partition": frozenset({"rank.lost", "link.down", "link.degraded"}),
    **{
        k: _LINK_SIGNS
        for k in ("nic-down", "nic-up", "flap", "throttle", "slow-link", "drop", "partition")
    },
}
# Faults on a process: every link of the rank, on every rail, is hit.
_RANK_FAULTS: Final = frozenset({"kill", "hang", "slow", "slow-cpu"})
# Fields besides ``links`` that name a rank an event is about.
_RANK_FIELDS: Final = ("rank", "straggler", "donor")
# How many unrelated events the report lists (all are counted).
UNRELATED_LISTED: Final = 3

Link = tuple[int, int, int]


@dataclass(frozen=True, slots=True)
class Target:
    """What a fault hit: ``rank``, and for a network fault the ``link``
    ``(rank, peer, rail)`` (peer -1: every peer of the rank on that rail)."""

    rank: int
    link: Link | None = None
    # A node fault hits every rank of the node: ``rank`` and these.
    others: tuple[int, ...] = ()

    @property
    def ranks(self) -> tuple[int, ...]:
        return (self.rank, *self.others)


@dataclass(slots=True)
class Attribution:
    """A fault's detection (None: no event named it) and the fitting-kind events
    in its window that named something else."""

    detection: Mapping[str, Any] | None = None
    unrelated: list[Mapping[str, Any]] = field(default_factory=list)


def fault_target(kind: str, params: Mapping[str, Any]) -> Target | None:
    """The rank or link a fault of ``kind`` with ``params`` hit; None where it names
    no rank (``etcd-kill``). A node fault (its ``ranks``) hits each of its ranks."""
    ranks = [int(r) for r in params.get("ranks", ())]
    if ranks:
        return Target(ranks[0], others=tuple(ranks[1:]))
    rank = params.get("rank")
    if rank is None:
        return None
    rail = params.get("rail")
    if kind in _RANK_FAULTS or rail is None:
        return Target(int(rank))
    return Target(int(rank), (int(rank), int(params.get("peer", -1)), int(rail)))


def _triples(event: Mapping[str, Any]) -> Iterable[Link]:
    """The event's well-formed ``links`` triples (a malformed one names nothing)."""
    for item in event.get("links") or ():
        try:
            a, b, c = (int(x) for x in item)
        except (TypeError, ValueError):
            continue
        yield a, b, c


def _link_names(triple: Link, link: Link) -> bool:
    """Whether an event's ``triple`` names the faulted ``link`` (see the module docstring)."""
    a, b, rail = triple
    rank, peer, fault_rail = link
    if rail not in (fault_rail, -1):
        return False
    if peer == -1:  # every link of ``rank`` on the rail: either end will do
        return rank in (a, b)
    if {a, b} == {rank, peer}:
        return True
    return b == -1 and a in (rank, peer)  # one end's rail-wide event


def names_target(event: Mapping[str, Any], target: Target) -> bool:
    """Whether ``event`` names what the fault hit (see the module docstring)."""
    if target.link is not None:
        # A network fault hits one rail: the event's writer alone does not say which.
        return any(_link_names(t, target.link) for t in _triples(event))
    ranks = target.ranks
    if any(event.get(name) in ranks for name in _RANK_FIELDS):
        return True
    return any(a in ranks or b in ranks for a, b, _ in _triples(event))


def attribute(
    kind: str,
    params: Mapping[str, Any],
    events: Sequence[Mapping[str, Any]],
    *,
    start: float,
    stop: float = float("inf"),
) -> Attribution:
    """The detection of a fault of ``kind``/``params`` that fired at ``start``: the
    earliest event in ``[start, stop)`` (absolute ``ts``) of a kind in
    :data:`DETECT_KINDS` that names its target, and the fitting-kind events in that
    window that do not (all of them, before and after the detection)."""
    signs = DETECT_KINDS.get(kind, frozenset())
    target = fault_target(kind, params)
    out = Attribution()
    for event in sorted(events, key=_ts):
        if event.get("kind") not in signs or not start <= _ts(event) < stop:
            continue
        # Nothing to tell events apart by (no rank named): every fitting one names it.
        if target is None or names_target(event, target):
            if out.detection is None:
                out.detection = event
        else:
            out.unrelated.append(event)
    return out


def _ts(event: Mapping[str, Any]) -> float:
    return float(event.get("ts", 0.0))


def event_summary(event: Mapping[str, Any], start: float) -> dict[str, Any]:
    """An event as the report lists it: kind, writer rank, links, ms after ``start``."""
    return {
        "kind": event.get("kind"),
        "rank": event.get("rank"),
        "links": event.get("links") or [],
        "after_ms": round((_ts(event) - start) * 1e3, 3),
    }


def unrelated_summary(att: Attribution, start: float) -> dict[str, Any]:
    """``count`` of the unrelated events and the first :data:`UNRELATED_LISTED`."""
    listed = [event_summary(e, start) for e in att.unrelated[:UNRELATED_LISTED]]
    return {"count": len(att.unrelated), "first": listed}
