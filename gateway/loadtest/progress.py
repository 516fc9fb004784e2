"""Progress while a run goes: a rich progress bar on a terminal, else a plain line on stderr
every few seconds."""

from __future__ import annotations

import sys
import time
from typing import Any

from gateway.loadtest.records import RequestRecord
from gateway.loadtest.report import have_rich

PLAIN_EVERY_S = 5.0


class Progress:
    def __init__(self, label: str, total: int | None, duration_s: float | None) -> None:
        self.label = label
        self.total = total
        self.duration_s = duration_s
        self.done = self.ok = 0
        self._started = time.monotonic()
        self._last_line = self._started
        self._bar: Any = None
        self._task: Any = None
        if have_rich() and sys.stderr.isatty():
            from rich.console import Console
            from rich.progress import (
                BarColumn,
                MofNCompleteColumn,
                TextColumn,
                TimeElapsedColumn,
            )
            from rich.progress import (
                Progress as RichProgress,
            )

            self._bar = RichProgress(
                TextColumn("{task.description}"),
                BarColumn(),
                MofNCompleteColumn(),
                TextColumn("ok {task.fields[ok]}"),
                TimeElapsedColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            self._bar.start()
            self._task = self._bar.add_task(label, total=total, ok=0)

    def update(self, record: RequestRecord) -> None:
        self.done += 1
        self.ok += record.ok
        if self._bar is not None:
            self._bar.update(self._task, completed=self.done, ok=self.ok)
            return
        now = time.monotonic()
        if now - self._last_line >= PLAIN_EVERY_S:
            self._last_line = now
            of = f"/{self.total}" if self.total else ""
            print(
                f"{self.label}: {self.done}{of} done, {self.ok} ok, {now - self._started:.0f} s",
                file=sys.stderr,
                flush=True,
            )

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
