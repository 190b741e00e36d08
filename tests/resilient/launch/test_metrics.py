"""The launcher's Prometheus metrics: event totals read incrementally, text format."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from resilient.launch.metrics import EventTally, render

pytestmark = pytest.mark.timeout(10)


def _line(**ev: object) -> str:
    return json.dumps(ev) + "\n"


def test_event_totals_follow_the_logs_as_they_grow(tmp_path: Path) -> None:
    events = tmp_path / "events"
    events.mkdir()
    log = events / "rank-00000.jsonl"
    log.write_text(
        _line(kind="link.down", rank=0, links=[[0, 1, 0]])
        + _line(kind="straggler.suspected", rank=2, links=[], relative=0.8)
        + '{"kind": "recovery.fini'  # a line still being written
    )
    tally = EventTally(tmp_path)
    tally.update()
    assert tally.kinds == {"link.down": 1, "straggler.suspected": 1}
    assert tally.down == {(0, 1, 0)} and tally.scores == {2: 0.8}
    with log.open("a") as f:
        f.write('shed", "rank": 0, "links": [], "duration_ms": 1500.0}\n')
        f.write(_line(kind="link.repaired", rank=0, links=[[0, 1, 0]]))
    tally.update()
    assert tally.kinds["recovery.finished"] == 1 and tally.recovery_s == 1.5
    assert tally.down == set()
    text = render(tally.samples())
    assert "resilient_recoveries_total 1\n" in text
    assert 'resilient_straggler_score{rank="2"} 0.8\n' in text
    assert text.count("# TYPE resilient_events_total counter") == 1
