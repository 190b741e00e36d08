"""Step progress records: rate-limited, newest first, never blocking the loop."""

from __future__ import annotations

import json
import sys
import threading
import time
import types

import pytest

from resilient.config import RankEnv
from resilient.errors import ConfigError
from resilient.progress import StepReporter, pass_counts


class _Client:
    """Counts puts (pure logic: the interval, not etcd, is under test)."""

    def __init__(self) -> None:
        self.puts: list[dict[str, object]] = []
        self.lock = threading.Lock()

    def put(self, key: str, value: str) -> None:
        with self.lock:
            self.puts.append(json.loads(value))

    def close(self) -> None:
        pass


@pytest.mark.timeout(20)
def test_steps_are_written_at_most_once_per_interval_and_the_last_is_kept() -> None:
    client = _Client()
    reporter = StepReporter(client, job="j", rank=1, min_interval_s=0.2)  # type: ignore[arg-type]
    start = time.monotonic()
    for n in range(200):  # 200 steps in ~0.6 s
        reporter.step(n, loss=1.0 / (n + 1))
        time.sleep(0.003)
    elapsed = time.monotonic() - start
    reporter.finish(params_sha256="abc")
    steps = [p["step"] for p in client.puts]
    # One write per 0.2 s (plus the first and the final one), newest step each time.
    assert len(client.puts) <= elapsed / 0.2 + 3, (len(client.puts), elapsed)
    assert steps == sorted(steps) and steps[-1] == 199
    assert client.puts[-1]["done"] is True and client.puts[-1]["params_sha256"] == "abc"


@pytest.mark.timeout(10)
def test_the_interval_comes_from_the_environment() -> None:
    base = {"RANK": "0", "WORLD_SIZE": "1"}
    assert RankEnv.from_env(base).progress_interval_s == 0.25
    env = RankEnv.from_env({**base, "RESILIENT_PROGRESS_INTERVAL_S": "0.02"})
    assert env.progress_interval_s == 0.02
    with pytest.raises(ConfigError):
        RankEnv.from_env({**base, "RESILIENT_PROGRESS_INTERVAL_S": "0"})


@pytest.mark.timeout(20)
def test_records_carry_the_rail_passes_once_the_data_plane_is_loaded(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # Not loaded (never imported here: it would import torch): no counts.
    monkeypatch.delitem(sys.modules, "resilient.links.native_steps", raising=False)
    assert pass_counts() == {}
    stats = {"steps": 0, "stopped": 0, "c_passes": 5, "python_passes": 1}
    fake = types.ModuleType("resilient.links.native_steps")
    fake.STATS = stats  # type: ignore[attr-defined]
    fake.available = lambda: True  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "resilient.links.native_steps", fake)
    client = _Client()
    reporter = StepReporter(client, job="j", rank=0, min_interval_s=0.01)  # type: ignore[arg-type]
    reporter.step(0)
    time.sleep(0.1)
    stats["c_passes"] += 4
    reporter.finish(params_sha256="abc")
    first, last = client.puts[0], client.puts[-1]
    assert (first["c_passes"], first["python_passes"], first["c_built"]) == (5, 1, True)
    assert (last["c_passes"], last["python_passes"], last["done"]) == (9, 1, True)


@pytest.mark.timeout(10)
def test_every_written_record_counts_the_processs_fds_and_threads() -> None:
    client = _Client()
    reporter = StepReporter(client, job="j", rank=0, min_interval_s=0.0)  # type: ignore[arg-type]
    reporter.step(0)
    reporter.finish()
    assert client.puts, "nothing was written"
    for rec in client.puts:
        assert isinstance(rec["fds"], int) and rec["fds"] > 0, rec
        assert isinstance(rec["threads"], int) and rec["threads"] >= 1, rec
