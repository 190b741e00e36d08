"""How the ranks of a job agree on the next epoch after a rank was lost.

Every rank that takes part in the next epoch writes one record under
``recovery/e<epoch>/r<rank>`` in the job's store: its incarnation, the last step it
committed (-1 before the first: the state every rank started training from, which
DDP made the same everywhere; :data:`NO_STATE` for a replacement), and the op
counters of its links still standing.
Once the records of all ``world`` ranks are there, every rank computes the same
:class:`Plan` from the same records, then moves the job's one epoch counter with a
compare-and-swap (:func:`membership.epoch.advance_epoch`: key ``epoch`` of the
store, ``epoch`` -> ``epoch + 1``, with the history record ``epochs/<epoch + 1>``:
members, joined ranks, step, donors). Nothing else is exchanged: the plan is a pure
function of the records.

**Shrink.** With ``shrink_after_s``, ranks stop waiting for missing records (no
replacement came) once that long has passed and at least ``min_ranks`` records are
in: the next epoch goes on with the ranks that reported. Which ranks those are is
decided once, by whichever rank gets there first, with a compare-and-set on
``recovery/e<epoch>/members`` (a replacement reporting just then could otherwise
be counted by some ranks and not by others); everyone uses that decision. A
record that arrives later (a slow replacement) is left out of this epoch.

**Grow.** A replacement that finds the group shrunk asks to join with
:func:`request_join` (after writing its record); the members see the request at
a step boundary (:func:`join_requested`, agreed on with one small all_reduce),
report for the next epoch, and the next epoch takes in every record present. A
replacement never decides: it waits for the members' decision, and if it was
left out it asks again at the next epoch.

**Finished.** A replacement may come after every other member finished the job
and left (its rank was killed or hung at the last step): nobody is left to
decide. ``finished`` (:func:`recovery.joining.job_finished`), polled while it
waits, says so, and it raises :class:`~resilient.errors.JobFinished`.

The plan keeps a link if both ends still hold it and no thread at either end is
blocked on one of its ops. Ops the given-up call left half done may stay pending
(unmatched, unwaited): every epoch salts its tags (:mod:`resilient.links.ledger`), so a
stale receive never swallows a message of the next epoch; a link whose leftovers
were posted under the next epoch's salt (16 epochs ago) is not kept. The
donors are the ranks with the highest committed step; every rank behind them,
the replacement included, receives the state from one of them. The ranks
furthest ahead are ranked by the health of their links: the most rails up, then
the fastest measured rails, then the lowest rank (the joiner has no links yet to
compare). Replacements are given the best ranked donors, then the survivors that
are behind (a kill between two ranks' commits of a step); each donor serves its
own receivers, so two receivers are served at once when two ranks are ahead. With
sharded state (HSDP) a donor must hold the receiver's shards: records carry a
replica key (:mod:`recovery.replicas`) and donors are picked among equal keys.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final

from torch._C._distributed_c10d import Store

from membership.epoch import EPOCH_KEY, advance_epoch
from resilient.detect.doorbell import watch_or_poll
from resilient.errors import JobFinished, RecoveryError, StaleEpoch
from resilient.links.ledger import salt_of
from resilient.links.table import Counters

__all__ = [
    "NO_STATE",
    "Plan",
    "Record",
    "agree",
    "join_requested",
    "make_plan",
    "request_join",
]

# A record's step when the rank holds no state at all (a replacement). Step -1 is
# a state: the one training started from, before the first commit.
NO_STATE: Final = -2
_POLL_S: Final = 0.01
_SAFETY_S: Final = 0.1  # with a watch: timers (shrink, give_up) still run

Counter = Counters  # (peer, rail, tx_ops, rx_ops, open_ops, dirty)


@dataclass(frozen=True, kw_only=True, slots=True)
class Record:
    """What one rank reports for the next epoch."""

    rank: int
    incarnation: int
    step: int
    data: list[Counter] = field(default_factory=list)
    ctl: list[Counter] | None = field(default_factory=list)
    # How well this rank could send its state: rails with their NIC up and the
    # measured rate of its rails together (bytes/s; 0 = not measured).
    rails_up: int = 0
    rate: float = 0.0
    # Which shards this rank's state holds (recovery.replicas.replica_key): only
    # a rank with the same key can be its donor. "": the whole state (DDP).
    replica: str = ""

    def to_json(self) -> str:
        return json.dumps(
            {"rank": self.rank, "incarnation": self.incarnation, "step": self.step,
             "data": self.data, "ctl": self.ctl, "rails_up": self.rails_up, "rate": self.rate,
             "replica": self.replica}
        )  # fmt: skip

    @classmethod
    def from_json(cls, raw: bytes | str) -> Record:
        d = json.loads(raw)
        ctl = d.get("ctl")
        return cls(
            rank=int(d["rank"]),
            incarnation=int(d["incarnation"]),
            step=int(d["step"]),
            data=[_counter(c) for c in d.get("data", [])],
            ctl=None if ctl is None else [_counter(c) for c in ctl],
            rails_up=int(d.get("rails_up", 0)),
            rate=float(d.get("rate", 0.0)),
            replica=str(d.get("replica", "")),
        )


def _counter(raw: Sequence[Any]) -> Counter:
    p, r, tx, rx, op, *dirty = (int(x) for x in raw)
    return (p, r, tx, rx, op, dirty[0] if dirty else 0)


@dataclass(frozen=True, kw_only=True, slots=True)
class Plan:
    """The next epoch, the same on every rank."""

    epoch: int
    members: tuple[int, ...]  # the ranks of the next epoch (fewer than world: shrunk)
    step: int  # the donors' committed step: training resumes at step + 1
    donor: int  # the best placed donor
    receivers: tuple[int, ...]
    # receiver -> the donor that sends it the state (every receiver is a key)
    donors: Mapping[int, int] = field(default_factory=dict)
    joined: tuple[int, ...]  # ranks with a new incarnation (replacements)
    keep_data: Mapping[int, list[tuple[int, int]]]
    keep_ctl: Mapping[int, list[tuple[int, int]] | None]


def _kept(
    records: Mapping[int, Record], table: str, epoch: int
) -> dict[int, list[tuple[int, int]] | None]:
    """Per rank, the links kept into ``epoch``: held at both ends, no thread blocked
    on one of its ops at either end, and not dirty for ``epoch``'s tag salt."""
    salt_bit = 1 << salt_of(epoch)

    def counters(rec: Record) -> dict[tuple[int, int], Counter] | None:
        rows = rec.data if table == "data" else rec.ctl
        return None if rows is None else {(c[0], c[1]): c for c in rows}

    views = {r: counters(rec) for r, rec in records.items()}
    out: dict[int, list[tuple[int, int]] | None] = {}
    for me, mine in views.items():
        if mine is None:
            out[me] = None
            continue
        keep = []
        for (peer, rail), (_, _, _, _, blocked, dirty) in sorted(mine.items()):
            theirs = (views.get(peer) or {}).get((me, rail))
            # Ops left half done by the given-up call (counts that differ) do not
            # matter: the next epoch's tags never match them (resilient.links.ledger).
            idle = theirs is not None and (blocked, theirs[4]) == (0, 0)
            if idle and theirs is not None and not (dirty | theirs[5]) & salt_bit:
                keep.append((peer, rail))
        out[me] = keep
    return out


def make_plan(epoch: int, records: Mapping[int, Record], *, rollback: bool = False) -> Plan:
    """The plan for leaving ``epoch``, from every rank's record. With ``rollback``
    (every rank goes back to a checkpoint: no peer sends a state) it names no
    receivers and no donors.

    Raises:
        RecoveryError: no rank holds a state to restore from (every record is a
            replacement's).
    """
    survivors = [r for r in records.values() if r.step != NO_STATE]
    if not survivors:
        raise RecoveryError(f"epoch {epoch}: no rank holds a state to restore from")
    step = max(r.step for r in survivors)
    # Of the ranks furthest ahead, the one best placed to send: most rails up,
    # then the fastest measured rails, then the lowest rank (every rank computes
    # the same from the same records).
    ahead = [r for r in survivors if r.step == step]
    ranked = [r.rank for r in sorted(ahead, key=lambda r: (-r.rails_up, -r.rate, r.rank))]
    # Replacements first: they get the best donors. In a rollback every rank loads
    # the checkpoint: none is sent a state, so none needs a donor.
    behind = [] if rollback else sorted(
        (r for r in records.values() if r.step < step),
        key=lambda r: (r.step != NO_STATE, r.rank),
    )  # fmt: skip
    data, ctl = _kept(records, "data", epoch + 1), _kept(records, "ctl", epoch + 1)
    return Plan(
        epoch=epoch + 1,
        members=tuple(sorted(records)),
        step=step,
        donor=ranked[0],
        donors=_pick_donors(epoch, records, ranked, behind),
        receivers=tuple(sorted(r.rank for r in behind)),
        joined=tuple(sorted(r.rank for r in records.values() if r.step == NO_STATE)),
        keep_data={r: keep or [] for r, keep in data.items()},
        keep_ctl=ctl,
    )


def _pick_donors(
    epoch: int, records: Mapping[int, Record], ranked: list[int], behind: list[Record]
) -> dict[int, int]:
    """Receiver -> donor: each receiver in turn gets the next best ranked donor that
    holds the same shards (the same ``replica`` key; all alike without sharding).

    Raises:
        RecoveryError: no rank ahead holds a receiver's shards (every replica of
            them was lost at once).
    """
    served: dict[str, int] = {}
    donors = {}
    for rec in behind:
        pool = [d for d in ranked if records[d].replica == rec.replica]
        if not pool:
            raise RecoveryError(
                f"epoch {epoch}: no rank ahead holds the shards of rank {rec.rank} "
                f"(replica key {rec.replica!r}); every replica of them was lost"
            )
        turn = served.get(rec.replica, 0)
        donors[rec.rank] = pool[turn % len(pool)]
        served[rec.replica] = turn + 1
    return donors


def request_join(store: Store, epoch: int, rank: int) -> None:
    """Ask the members of ``epoch`` to take ``rank`` in (its record is written)."""
    store.set(f"recovery/e{epoch}/join", str(rank))


def join_requested(store: Store, epoch: int) -> bool:
    """Whether a replacement asked to join the group during ``epoch``."""
    return bool(store.check([f"recovery/e{epoch}/join"]))


def agree(
    store: Store,
    *,
    epoch: int,
    world: int,
    record: Record,
    timeout_s: float,
    expect: Collection[int] | None = None,
    decide: bool = True,
    shrink_after_s: float | None = None,
    min_ranks: int = 1,
    give_up: Callable[[], Collection[int]] | None = None,
    rollback: bool = False,
    finished: Callable[[], bool] | None = None,
) -> Plan:
    """Publish ``record`` for leaving ``epoch``, wait for the records of the ranks in
    ``expect`` (default: all ``world``; after ``shrink_after_s``, of those that
    reported: see the module docstring), and return the plan after moving the job's
    epoch to ``epoch + 1`` (with its history record, :mod:`membership.epoch`).
    Records present beyond ``expect`` are taken in too.
    With ``decide`` False (a replacement) this rank only waits for the decision.
    ``give_up`` (polled while waiting) names ranks not to wait for any longer (the
    policy found no replacement coming for them, or shrinking cheaper): once every
    other expected rank reported, the next epoch goes on without them.
    ``rollback``: every rank goes back to a checkpoint (:func:`make_plan`).
    ``finished`` (polled while a replacement, ``decide`` False, waits for the
    decision): every other member finished the job and left (module doc).

    Raises:
        JobFinished: ``finished`` said so before any decision.
        RecoveryError: ranks did not report within ``timeout_s`` (named), or the
            next epoch was decided without this rank.
        StaleEpoch: the epoch counter is neither ``epoch`` nor ``epoch + 1``.
    """
    prefix = f"recovery/e{epoch}/r"
    store.set(f"{prefix}{record.rank}", record.to_json())
    members = _decide(
        store, epoch=epoch, world=world, me=record.rank, timeout_s=timeout_s,
        expect=set(range(world) if expect is None else expect) if decide else None,
        shrink_after_s=shrink_after_s, min_ranks=min_ranks, give_up=give_up,
        finished=None if decide else finished,
    )  # fmt: skip
    if record.rank not in members:
        raise RecoveryError(
            f"rank {record.rank} (epoch {epoch}): epoch {epoch + 1} was decided without it "
            f"(members {list(members)}): it reported after the group shrank"
        )
    records = {r: Record.from_json(bytes(store.get(f"{prefix}{r}"))) for r in members}
    plan = make_plan(epoch, records, rollback=rollback)
    history = {
        "from": epoch, "world": world, "members": list(plan.members),
        "joined": list(plan.joined), "step": plan.step,
        "donors": {str(r): d for r, d in sorted(plan.donors.items())},
        "rank": record.rank, "incarnation": record.incarnation,
    }  # fmt: skip
    now = advance_epoch(store, epoch, history)
    if now != epoch + 1:
        raise StaleEpoch(EPOCH_KEY, expected=epoch, current=now)
    return plan


def _decide(
    store: Store,
    *,
    epoch: int,
    world: int,
    me: int,
    timeout_s: float,
    expect: set[int] | None,
    shrink_after_s: float | None,
    min_ranks: int,
    give_up: Callable[[], Collection[int]] | None = None,
    finished: Callable[[], bool] | None = None,
) -> tuple[int, ...]:
    """The ranks of epoch ``epoch + 1``, decided once for every rank (module doc);
    ``expect`` None: wait for someone else's decision, or for ``finished``.

    Raises:
        JobFinished: ``finished`` said so before any decision (``expect`` None).
        RecoveryError: not decided within ``timeout_s``.
    """
    prefix, decided = f"recovery/e{epoch}/r", f"recovery/e{epoch}/members"
    # Through etcd a watch wakes the loop on every record; a 10 ms poll there took
    # CPU (gRPC, etcd) from the replacement starting on the same machine.
    bell = watch_or_poll(store, f"recovery/e{epoch}/", poll_s=_POLL_S, safety_s=_SAFETY_S)
    try:
        start = time.monotonic()
        seen: set[int] = set()  # records are never taken back: only the others are polled
        while True:
            if store.check([decided]):
                return _members(store.get(decided))
            # Asked only after the decision key: members that decided and then
            # finished did take this rank in.
            if expect is None and finished is not None and finished():
                raise JobFinished(
                    f"rank {me} (epoch {epoch}): every other member finished the job and "
                    "left; nobody is left to admit this replacement"
                )
            seen |= {r for r in range(world) if r not in seen and store.check([f"{prefix}{r}"])}
            present = sorted(seen)
            waited = time.monotonic() - start
            shrink = shrink_after_s is not None and waited >= shrink_after_s
            if expect is not None and not shrink and give_up is not None:
                gone = set(give_up())
                shrink = bool(gone) and expect - gone <= set(present)
            ready = expect is not None and expect <= set(present)
            if expect is not None and (ready or (shrink and len(present) >= min_ranks)):
                return _members(store.compare_set(decided, "", json.dumps(present)))
            if waited > timeout_s:
                missing = sorted((expect or set(range(world))) - set(present))
                few = (
                    f"; {len(present)} reported, fewer than min_ranks={min_ranks}" if shrink else ""
                )
                raise RecoveryError(
                    f"rank {me} (epoch {epoch}): ranks {missing} did not report for epoch "
                    f"{epoch + 1} within {timeout_s:.0f} s (no replacement came{few})"
                )
            bell.wait(bell.safety_s)
    finally:
        bell.close()


def _members(raw: Any) -> tuple[int, ...]:
    return tuple(sorted(int(r) for r in json.loads(bytes(raw).decode())))
