"""Live progress of a chaos run on stderr: a bar of steps per rank and each fault."""

from __future__ import annotations

import sys
import threading
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Final, TextIO

if TYPE_CHECKING:
    from chaos._progress_watch import RankTrack
    from chaos.report import FaultRecord

_BAR: Final = 20
# Without a terminal, one status line every this many seconds (a log stays readable).
_PLAIN_EVERY_S: Final = 5.0
_TTY_EVERY_S: Final = 0.2


class Display:
    """Draws progress (a redrawn line on a terminal, periodic lines otherwise).

    Notices and fault lines are always written; ``progress=False`` leaves out the
    step bar; ``silent=True`` writes nothing at all (library use).
    """

    def __init__(
        self,
        steps: int,
        *,
        progress: bool = True,
        silent: bool = False,
        stream: TextIO | None = None,
    ) -> None:
        self._steps = max(1, steps)
        self._progress = progress and not silent
        self._silent = silent
        self._stream = stream or sys.stderr
        self._tty = bool(getattr(self._stream, "isatty", lambda: False)())
        self._lock = threading.Lock()
        self._last_draw = -1e9
        self._line_open = False

    def _write(self, text: str) -> None:
        if self._silent:
            return
        with self._lock:
            if self._line_open:
                self._stream.write("\r\033[K")
                self._line_open = False
            self._stream.write(text)
            self._stream.flush()

    def notice(self, message: str) -> None:
        self._write(f"[chaos] {message}\n")

    def fault(self, rec: FaultRecord, what: str) -> None:
        params = ", ".join(f"{k}={v}" for k, v in sorted(rec.params.items()))
        t = rec.stopped_s if what == "undone" else rec.fired_s
        step = f" at step {rec.fired_step}" if what != "undone" else ""
        err = f": {rec.error}" if rec.error and what != "undone" else ""
        self._write(
            f"[chaos] t={t or 0.0:6.2f}s fault[{rec.index}] {rec.kind}({params}) "
            f"{what}{step}{err}\n"
        )

    def tick(
        self, now: float, tracks: Mapping[int, RankTrack], faults: Sequence[FaultRecord]
    ) -> None:
        every = _TTY_EVERY_S if self._tty else _PLAIN_EVERY_S
        if not self._progress or now - self._last_draw < every:
            return
        self._last_draw = now
        done = min((t.step + 1 for t in tracks.values()), default=0)
        fill = int(_BAR * done / self._steps)
        ranks = " ".join(f"r{r}:{t.step + 1}" for r, t in sorted(tracks.items()))
        fired = sum(1 for f in faults if f.fired_s is not None)
        line = (
            f"t={now:6.1f}s [{'#' * fill}{'.' * (_BAR - fill)}] {done}/{self._steps} "
            f"{ranks}  faults {fired}/{len(faults)}"
        )
        if self._tty:
            with self._lock:
                self._stream.write("\r\033[K" + line)
                self._stream.flush()
                self._line_open = True
        else:
            self._write(line + "\n")

    def done(self) -> None:
        with self._lock:
            if self._line_open:
                self._stream.write("\n")
                self._stream.flush()
                self._line_open = False
