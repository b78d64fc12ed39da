"""Progress of long jobs, seen wherever they run: a rich bar on a terminal; elsewhere (CI logs,
`nohup`, a pipe) one plain line every `every_s` seconds and one at the end, so a log shows that a
long job is alive and how far it got. A job shorter than `every_s` prints no progress at all
(its errors stay one line).
"""

from __future__ import annotations

import sys
import time
from types import TracebackType

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TaskID,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

LOG_EVERY_S = 10.0


class ProgressReport:
    """`with ProgressReport("sweep x", "runs", total=12) as p: p.update(3)`; `p.note(line)` prints a
    line above the bar (on a terminal) or into the log (elsewhere), e.g. one finished trial."""

    def __init__(self, description: str, unit: str, total: int | None = None, *,
                 console: Console | None = None, every_s: float = LOG_EVERY_S,
                 extra: str = "") -> None:
        self.description = description
        self.unit = unit
        self.total = total
        self.done = 0
        self.extra = extra  # a short status shown after the count, e.g. "lag 0.2 s"
        self.console = console or Console(stderr=True)
        self.every_s = every_s
        self._bar: Progress | None = None
        self._task: TaskID | None = None
        self._start = time.monotonic()
        self._last_log = time.monotonic()
        self._logged = False

    @property
    def live(self) -> bool:
        return self.console.is_terminal

    def __enter__(self) -> ProgressReport:
        self._start = self._last_log = time.monotonic()
        if self.live:
            self._bar = Progress(TextColumn("{task.description}"), BarColumn(),
                                 MofNCompleteColumn(), TextColumn(self.unit),
                                 TextColumn("{task.fields[extra]}"), TimeElapsedColumn(),
                                 TimeRemainingColumn(), console=self.console, transient=True)
            self._bar.start()
            self._task = self._bar.add_task(self.description, total=self.total, extra=self.extra)
        return self

    def update(self, done: int, total: int | None = None, extra: str | None = None) -> None:
        self.done = done
        if total is not None:
            self.total = total
        if extra is not None:
            self.extra = extra
        if self._bar is not None and self._task is not None:
            self._bar.update(self._task, completed=done, total=self.total, extra=self.extra)
        else:
            self._log()

    def note(self, line: str) -> None:
        """A line that stays: above the bar on a terminal, in the log elsewhere."""
        if self._bar is not None:
            self._bar.console.print(line, highlight=False)
        else:
            print(line, file=sys.stderr, flush=True)

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        if self._bar is not None:
            self._bar.stop()
        elif kind is None and self._logged:
            self._log(force=True, final=True)

    def _log(self, force: bool = False, final: bool = False) -> None:
        now = time.monotonic()
        if not force and now - self._last_log < self.every_s:
            return
        self._last_log = now
        self._logged = True
        of = f"/{self.total}" if self.total is not None else ""
        state = "done" if final else "progress"
        extra = f", {self.extra}" if self.extra else ""
        print(f"{self.description}: {state} {self.done}{of} {self.unit}{extra}, "
              f"{now - self._start:.0f} s", file=sys.stderr, flush=True)
