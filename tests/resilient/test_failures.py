"""FailureSite: counts, a rate-limited warning, one event per failing streak, reset."""

from __future__ import annotations

import logging
import threading
from typing import Any

import pytest

from resilient import failures
from resilient.errors import ConfigError
from resilient.events import EVENT_KINDS
from resilient.failures import FailureConfig, FailureSite

pytestmark = pytest.mark.timeout(30)

LOGGER = "resilient.failures"


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def emitted(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, dict[str, Any]]]:
    seen: list[tuple[str, dict[str, Any]]] = []
    monkeypatch.setattr("resilient.events.emit", lambda kind, **f: seen.append((kind, f)))
    return seen


def _warnings(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]


def _site(clock: Clock, **config: Any) -> FailureSite:
    return FailureSite(
        "health board watch", rank=3, epoch=2, action="retrying every 0.2 s",
        config=FailureConfig(**config), clock=clock,
    )  # fmt: skip


def test_warnings_are_rate_limited_and_carry_the_counts(
    caplog: pytest.LogCaptureFixture, emitted: list[Any]
) -> None:
    caplog.set_level(logging.DEBUG, LOGGER)
    clock = Clock()
    site = _site(clock, warn_every_s=10.0, event_after=100)
    for _ in range(5):  # one failure a second
        site.failed(OSError("etcd unreachable"))
        clock.now += 1.0
    warned = _warnings(caplog)
    assert warned == [
        "rank 3: health board watch failed (1 in a row, 1 in all, 0 not logged since the last "
        "warning); retrying every 0.2 s: OSError: etcd unreachable"
    ]
    # Only the first warning of a streak has the traceback; the others went to DEBUG.
    first = next(r for r in caplog.records if r.levelno == logging.WARNING)
    assert first.exc_info is not None
    assert sum(r.levelno == logging.DEBUG for r in caplog.records) == 4
    clock.now += 5.0  # 10 s after the first warning
    site.failed(TimeoutError("again"))
    warned = _warnings(caplog)
    assert len(warned) == 2
    assert "(6 in a row, 6 in all, 4 not logged since the last warning)" in warned[1]
    assert warned[1].endswith("TimeoutError: again")
    warning = [r for r in caplog.records if r.levelno == logging.WARNING][1]
    assert warning.exc_info is None
    assert site.consecutive == site.total == 6 and emitted == []


def test_one_event_per_failing_streak_and_one_recovery(
    caplog: pytest.LogCaptureFixture, emitted: list[tuple[str, dict[str, Any]]]
) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    clock = Clock()
    site = _site(clock, warn_every_s=10.0, event_after=3)
    for _ in range(10):
        site.failed(RuntimeError("store gone"))
    assert [k for k, _ in emitted] == ["monitor.failing"]
    _, fields = emitted[0]
    assert fields["site"] == "health board watch" and fields["failures"] == 3
    assert fields["epoch"] == 2 and fields["action"] == "retrying every 0.2 s"
    assert "3 failures in a row" in fields["reason"] and "store gone" in fields["reason"]
    site.succeeded()
    site.succeeded()  # nothing failing: nothing said
    assert [k for k, _ in emitted] == ["monitor.failing", "monitor.recovered"]
    assert emitted[1][1]["failures"] == 10
    infos = [r.getMessage() for r in caplog.records if r.levelno == logging.INFO]
    assert infos == ["rank 3: health board watch recovered after 10 failures"]
    # A new streak is a new story: reported once more, after 3 failures again.
    site.failed(RuntimeError("x"), epoch=5)
    site.failed(RuntimeError("x"))
    assert len(emitted) == 2
    site.failed(RuntimeError("x"), epoch=5)
    assert [k for k, _ in emitted][2:] == ["monitor.failing"] and emitted[2][1]["epoch"] == 5
    assert {k for k, _ in emitted} <= EVENT_KINDS


def test_success_resets_the_streak_but_not_the_warning_rate(
    caplog: pytest.LogCaptureFixture, emitted: list[Any]
) -> None:
    caplog.set_level(logging.DEBUG, LOGGER)
    clock = Clock()
    site = _site(clock, warn_every_s=60.0, event_after=3)
    site.failed(OSError("a"))
    site.failed(OSError("b"))
    site.succeeded()
    assert site.consecutive == 0 and site.total == 2 and not site.reported
    assert emitted == []  # the streak never reached event_after: no recovery event either
    clock.now += 1.0  # well inside warn_every_s: the new streak is counted, not warned
    assert site.failed(OSError("c")) == 1
    site.succeeded()
    clock.now += 60.0
    site.failed(OSError("d"))
    warned = _warnings(caplog)
    assert len(warned) == 2 and "(1 in a row, 4 in all, 2 not logged" in warned[1]
    told = [(r.levelno, r.getMessage()) for r in caplog.records if "recovered" in r.getMessage()]
    assert told == [
        (logging.INFO, "rank 3: health board watch recovered after 2 failures"),
        (logging.DEBUG, "rank 3: health board watch recovered after 1 failures"),
    ]


def test_a_flapping_site_logs_at_the_bounded_rate(
    caplog: pytest.LogCaptureFixture, emitted: list[Any]
) -> None:
    caplog.set_level(logging.INFO, LOGGER)
    clock = Clock()
    site = _site(clock, warn_every_s=10.0, event_after=3)
    for _ in range(100):  # fails every other round, 10 rounds a second
        site.failed(OSError("flap"))
        site.succeeded()
        clock.now += 0.1
    infos = [r for r in caplog.records if r.levelno == logging.INFO]
    assert len(_warnings(caplog)) == 1 and len(infos) == 1
    assert site.total == 100 and emitted == []  # never 3 in a row: no event


def test_the_caller_context_and_an_unnamed_rank() -> None:
    records: list[logging.LogRecord] = []

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)

    log = logging.getLogger("tests.failures.site")
    log.addHandler(Keep())
    log.propagate = False
    try:
        site = FailureSite("stall check", config=FailureConfig(warn_every_s=0.0), log=log)
        site.failed(ValueError(), about="<Link 0-1 rail 0>")
        site.failed(ValueError("bad fd"))
    finally:
        log.propagate = True
    messages = [r.getMessage() for r in records]
    assert messages[0].startswith("stall check failed (1 in a row")  # no rank prefix
    assert messages[0].endswith("retrying: '<Link 0-1 rail 0>': ValueError")
    assert "(2 in a row, 2 in all, 0 not logged" in messages[1]  # warn_every_s=0: each one


def test_backoff_doubles_per_failure_up_to_its_bound() -> None:
    site = FailureSite("repair", config=FailureConfig(event_after=100))
    assert site.backoff_s(0.05, 1.0) == 0.05
    delays = []
    for _ in range(8):
        site.failed(OSError())
        delays.append(site.backoff_s(0.05, 1.0))
    assert delays == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]
    for _ in range(2000):  # a long outage never overflows
        site.failed(OSError())
    assert site.backoff_s(0.05, 1.0) == 1.0
    site.succeeded()
    assert site.backoff_s(0.05, 1.0) == 0.05


def test_a_failing_event_log_never_reaches_the_loop(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    def broken(kind: str, **fields: Any) -> None:
        raise OSError("disk full")

    monkeypatch.setattr("resilient.events.emit", broken)
    site = FailureSite("watch", config=FailureConfig(event_after=1))
    assert site.failed(RuntimeError("x")) == 1
    assert any("monitor.failing event not emitted" in m for m in _warnings(caplog))


def test_threads_failing_at_once_count_every_failure_and_report_once(
    emitted: list[tuple[str, dict[str, Any]]],
) -> None:
    site = FailureSite("publish", config=FailureConfig(warn_every_s=60.0, event_after=50))
    start = threading.Barrier(4)

    def fail() -> None:
        start.wait()
        for _ in range(100):
            site.failed(OSError())

    threads = [threading.Thread(target=fail) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(10.0)
    assert site.consecutive == site.total == 400
    assert [k for k, _ in emitted] == ["monitor.failing"]


def test_the_default_config_is_read_when_the_site_is_made(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(failures, "DEFAULT_CONFIG", FailureConfig(event_after=2))
    assert FailureSite("x").config.event_after == 2


@pytest.mark.parametrize(
    "bad",
    [
        {"warn_every_s": -1.0},
        {"warn_every_s": float("nan")},
        {"warn_every_s": float("inf")},
        {"event_after": 0},
    ],
)
def test_config_is_validated(bad: dict[str, Any]) -> None:
    with pytest.raises(ConfigError):
        FailureConfig(**bad)
