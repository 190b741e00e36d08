"""The recovery event log (writer, reader) and the `resilient events` command."""

from __future__ import annotations

import itertools
import json
import time
from pathlib import Path

import pytest

import resilient.events as events_mod
from recovery.cli import filter_events, format_table
from resilient.cli import main
from resilient.events import SCHEMA_VERSION, EventLog, read_events

REQUIRED = {"schema_version", "ts", "job", "epoch", "rank", "incarnation", "kind", "links",
            "duration_ms", "reason", "action"}  # fmt: skip


def _write_run(run: Path) -> None:
    chaos = EventLog(run, job="j", rank=-1, name="chaos")
    r1 = EventLog(run, job="j", rank=1, incarnation=2)
    r0 = EventLog(run, job="j", rank=0)
    chaos.emit("fault.injected", rank=1, links=[(1, -1, 0)], reason="nic-down(rail=0, rank=1)")
    time.sleep(0.01)
    r1.emit("link.down", epoch=3, links=[(1, 2, 0)], reason="reset by peer", step=7)
    time.sleep(0.01)
    r0.emit("recovery.finished", epoch=3, duration_ms=412.5, action="rerouted to rail 1")
    for log in (chaos, r1, r0):
        log.close()


@pytest.mark.timeout(10)
def test_events_are_json_lines_with_the_schema_fields(tmp_path: Path) -> None:
    _write_run(tmp_path)
    files = sorted(p.name for p in (tmp_path / "events").iterdir())
    assert files == ["chaos.jsonl", "rank-00000.jsonl", "rank-00001.jsonl"]
    (line,) = (tmp_path / "events" / "rank-00001.jsonl").read_text().splitlines()
    ev = json.loads(line)
    assert set(ev) >= REQUIRED
    assert ev["schema_version"] == SCHEMA_VERSION
    assert (ev["rank"], ev["incarnation"], ev["epoch"]) == (1, 2, 3)
    assert ev["links"] == [[1, 2, 0]] and ev["step"] == 7


@pytest.mark.timeout(10)
def test_read_merges_writers_in_time_order_and_skips_torn_lines(tmp_path: Path) -> None:
    _write_run(tmp_path)
    with (tmp_path / "events" / "rank-00000.jsonl").open("a") as f:
        f.write('{"ts": 1.0, "kind": "link.do')  # a crash mid-write
    kinds = [e["kind"] for e in read_events(tmp_path)]
    assert kinds == ["fault.injected", "link.down", "recovery.finished"]


@pytest.mark.timeout(10)
def test_unknown_kinds_are_refused(tmp_path: Path) -> None:
    log = EventLog(tmp_path, job="j", rank=0)
    with pytest.raises(ValueError):
        log.emit("link.exploded")
    log.close()


@pytest.mark.timeout(10)
def test_an_unwritable_log_never_raises_into_the_caller(tmp_path: Path) -> None:
    blocker = tmp_path / "run"
    blocker.write_text("a file where the run directory should be")
    log = EventLog(blocker, job="j", rank=0)
    log.emit("link.down", reason="x")  # must not raise
    log.close()
    assert log.written == 0 and log.dropped == 1


@pytest.mark.timeout(10)
def test_default_log_comes_from_the_rank_env(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(events_mod, "_DEFAULT", None)
    for key, value in {"RANK": "3", "WORLD_SIZE": "4", "RESILIENT_JOB": "jobx",
                       "RESILIENT_RUN_DIR": str(tmp_path)}.items():  # fmt: skip
        monkeypatch.setenv(key, value)
    events_mod.emit("nic.down", links=[(3, -1, 1)])
    log = events_mod.default_log()
    assert log is not None
    log.close()
    monkeypatch.setattr(events_mod, "_DEFAULT", None)
    (ev,) = read_events(tmp_path)
    assert (ev["job"], ev["rank"], ev["kind"]) == ("jobx", 3, "nic.down")


@pytest.mark.timeout(10)
def test_filters_and_table(tmp_path: Path) -> None:
    _write_run(tmp_path)
    evs = read_events(tmp_path)
    assert [e["kind"] for e in filter_events(evs, kinds="link.,recovery.finished")] == [
        "link.down",
        "recovery.finished",
    ]
    assert [e["kind"] for e in filter_events(evs, rank=0)] == ["recovery.finished"]
    assert filter_events(evs, since=3600.0) == []
    table = format_table(evs)
    assert "1-2@r0" in table and "1-*@r0" in table and "412.5" in table
    assert table.splitlines()[0].split()[:4] == ["t+s", "rank/inc", "epoch", "kind"]


@pytest.mark.timeout(60)
def test_the_command_prints_json_and_draws_a_plot(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    _write_run(tmp_path)
    png = tmp_path / "t.png"
    assert main(["events", str(tmp_path), "--json", "--plot", str(png)]) == 0
    out = capsys.readouterr().out
    doc = json.loads(out.strip().splitlines()[-1])
    assert doc["schema_version"] == SCHEMA_VERSION and len(doc["events"]) == 3
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert main(["events", str(tmp_path / "nowhere")]) == 2


@pytest.mark.timeout(10)
def test_plot_labels_count_repeats_and_never_print_over_each_other() -> None:
    from recovery._plot import _LEVELS, _labels, _seconds_per_char

    # Four ranks confirm the same straggler, then eight key events land within
    # 0.4 s in the lane of a 10 s run: more than its rows can hold side by side.
    ts = [1.00, 1.01, 1.02, 1.03]
    events = [{"ts": t, "kind": "straggler.confirmed", "rank": 3} for t in ts]
    kinds = ["rank.lost", "rank.joined", "state.restored", "epoch.changed",
             "recovery.finished", "rank.evicted", "nic.down", "nic.up"]  # fmt: skip
    events += [{"ts": 1.1 + 0.05 * i, "kind": k, "rank": 3} for i, k in enumerate(kinds)]
    events.append({"ts": 10.0, "kind": "fault.cleared", "rank": -1})
    labels = _labels(events, {"rank 3": 0, "chaos": 1}, t0=0.0, span=10.0)
    texts = [text for _, _, text, _ in labels]
    assert "straggler.confirmed x4" in texts
    # Every key kind is named once, and no two labels share a row where they overlap.
    named = [k.split(" x")[0] for text in texts for k in text.split(", ")]
    assert sorted(named) == sorted(["straggler.confirmed", *kinds, "fault.cleared"])
    per_char = _seconds_per_char(10.0)
    rows: dict[tuple[int, int], list[tuple[float, float]]] = {}
    for t, lane, text, level in labels:
        assert 0 <= level < len(_LEVELS)
        rows.setdefault((lane, level), []).append((t, t + len(text) * per_char))
    for spans in rows.values():
        spans.sort()
        assert all(a_end <= b_start for (_, a_end), (b_start, _) in itertools.pairwise(spans))
