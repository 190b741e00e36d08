"""Prometheus metrics of a job, served by the launcher (``resilient run --metrics-port``).

``GET /metrics`` answers in the Prometheus text format (version 0.0.4), computed at
each scrape from what the launcher already has: its rank slots and restarts, the
JSON-lines event logs of every writer under ``RUN_DIR/events/`` (read from where
the previous scrape stopped), and the ranks' progress records in etcd. Nothing is
pushed and training never waits for a scrape.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

__all__ = ["EventTally", "JobMetrics", "MetricsServer", "Sample", "render"]

logger = logging.getLogger(__name__)

Sample = tuple[str, dict[str, str], float]  # name, labels, value

_HELP = {
    "resilient_ranks": ("gauge", "ranks of the job by state"),
    "resilient_rank_incarnation": ("gauge", "the incarnation holding each rank"),
    "resilient_restarts_total": ("counter", "single-rank restarts used by the job"),
    "resilient_events_total": ("counter", "recovery event log entries, by kind"),
    "resilient_recoveries_total": ("counter", "rank recoveries finished (recovery.finished)"),
    "resilient_recovery_seconds_sum": ("counter", "time spent in those recoveries"),
    "resilient_links_down": ("gauge", "links reported down and not repaired or replaced since"),
    "resilient_straggler_score": (
        "gauge",
        "latest relative score of a rank (1 = its peers' median)",
    ),
    "resilient_step": ("gauge", "last step each rank reported"),
    "resilient_step_seconds": ("gauge", "duration of that step"),
}


@dataclass
class EventTally:
    """Running totals over the event logs under ``run_dir``; :meth:`update` reads
    only what was appended since its last call."""

    run_dir: Path
    kinds: dict[str, int] = field(default_factory=dict)
    recovery_s: float = 0.0
    down: set[tuple[int, int, int]] = field(default_factory=set)
    scores: dict[int, float] = field(default_factory=dict)
    _offsets: dict[Path, int] = field(default_factory=dict)

    def update(self) -> None:
        for path in sorted((self.run_dir / "events").glob("*.jsonl")):
            with path.open("rb") as f:
                f.seek(self._offsets.get(path, 0))
                data = f.read()
            end = data.rfind(b"\n") + 1  # a line being written stays for the next scrape
            self._offsets[path] = self._offsets.get(path, 0) + end
            for line in data[:end].splitlines():
                if line.strip():
                    self._add(json.loads(line))

    def _add(self, ev: dict[str, Any]) -> None:
        kind = str(ev.get("kind"))
        self.kinds[kind] = self.kinds.get(kind, 0) + 1
        links = {(int(a), int(b), int(c)) for a, b, c in ev.get("links", []) if c is not None}
        if kind == "link.down":
            self.down |= {lk for lk in links if lk[2] >= 0}
        elif kind == "link.repaired":
            self.down -= links
        elif kind == "epoch.changed":
            self.down = {lk for lk in self.down if lk[0] != ev.get("rank")}
        elif kind == "recovery.finished" and ev.get("duration_ms") is not None:
            self.recovery_s += float(ev["duration_ms"]) / 1e3
        elif kind.startswith("straggler.") and ev.get("relative") is not None:
            self.scores[int(ev.get("rank", -1))] = float(ev["relative"])

    def samples(self) -> list[Sample]:
        out: list[Sample] = [
            ("resilient_events_total", {"kind": k}, float(n)) for k, n in sorted(self.kinds.items())
        ]
        out.append(
            ("resilient_recoveries_total", {}, float(self.kinds.get("recovery.finished", 0)))
        )
        out.append(("resilient_recovery_seconds_sum", {}, round(self.recovery_s, 3)))
        out.append(("resilient_links_down", {}, float(len(self.down))))
        out += [
            ("resilient_straggler_score", {"rank": str(r)}, s)
            for r, s in sorted(self.scores.items())
        ]
        return out


class JobMetrics:
    """What the launcher serves: ``slots()`` gives (rank, incarnation, state) per
    rank, ``restarts()`` the restarts used; events come from ``run_dir`` and step
    progress from etcd, each when configured."""

    def __init__(
        self,
        *,
        job: str,
        slots: Callable[[], list[tuple[int, int, str]]],
        restarts: Callable[[], int],
        run_dir: str | None,
        etcd_url: str | None,
    ) -> None:
        self.job, self._slots, self._restarts = job, slots, restarts
        self._tally = EventTally(Path(run_dir)) if run_dir else None
        self._etcd_url = etcd_url
        self._client: Any = None
        self._lock = threading.Lock()  # scrapes may overlap

    def collect(self) -> list[Sample]:
        with self._lock:
            slots = self._slots()
            out: list[Sample] = []
            for state in ("running", "done", "restarting"):
                n = sum(1 for _, _, s in slots if s == state)
                out.append(("resilient_ranks", {"state": state}, float(n)))
            out += [("resilient_rank_incarnation", {"rank": str(r)}, float(i)) for r, i, _ in slots]
            out.append(("resilient_restarts_total", {}, float(self._restarts())))
            if self._tally is not None:
                self._tally.update()
                out += self._tally.samples()
            return out + self._progress()

    def _progress(self) -> list[Sample]:
        """Each rank's last step and its duration, from its etcd progress record."""
        if not self._etcd_url:
            return []
        from membership.etcd_client import EtcdClient
        from resilient.config import etcd_config
        from resilient.errors import MembershipError
        from resilient.progress import progress_prefix

        if self._client is None:
            self._client = EtcdClient(
                etcd_config(self._etcd_url, request_timeout_s=1.0, retry_budget_s=1.0)
            )
        try:
            rows, _ = self._client.get_prefix(progress_prefix(self.job))
        except MembershipError as exc:  # etcd away: no progress this scrape
            logger.debug("metrics: reading progress failed: %s", exc)
            return []
        out: list[Sample] = []
        for kv in rows:
            rec = json.loads(kv.value)
            rank = {"rank": str(rec.get("rank", -1))}
            out.append(("resilient_step", rank, float(rec.get("step", -1))))
            if rec.get("step_ms") is not None:
                out.append(("resilient_step_seconds", rank, float(rec["step_ms"]) / 1e3))
        return out

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


def _labels(labels: dict[str, str]) -> str:
    if not labels:
        return ""
    body = ",".join(f'{k}="{v}"' for k, v in sorted(labels.items()))
    return "{" + body + "}"


def render(samples: Iterable[Sample]) -> str:
    """The Prometheus text exposition of ``samples`` (HELP/TYPE once per name)."""
    lines, seen = [], set()
    for name, labels, value in samples:
        if name not in seen:
            seen.add(name)
            kind, text = _HELP.get(name, ("gauge", name))
            lines += [f"# HELP {name} {text}", f"# TYPE {name} {kind}"]
        lines.append(f"{name}{_labels(labels)} {value:g}")
    return "\n".join(lines) + "\n"


class MetricsServer:
    """Serves ``render(collect())`` on ``GET /metrics`` from a daemon thread."""

    def __init__(self, host: str, port: int, collect: Callable[[], list[Sample]]) -> None:
        collect_ = collect

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:
                if self.path.split("?")[0] != "/metrics":
                    self.send_error(404, "only /metrics is served")
                    return
                try:
                    body = render(collect_()).encode()
                except Exception as exc:  # a scrape must never take the launcher down
                    logger.exception("metrics collection failed")
                    self.send_error(500, f"collecting metrics failed: {exc}")
                    return
                self.send_response(200)
                self.send_header("Content-Type", "text/plain; version=0.0.4; charset=utf-8")
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: Any) -> None:
                logger.debug("metrics request: %s", format % args)

        self._server = ThreadingHTTPServer((host, port), Handler)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(
            target=self._server.serve_forever, name="metrics", daemon=True
        )

    def start(self) -> MetricsServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5.0)
