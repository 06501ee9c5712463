"""A benchmark's progress: a rich bar naming the run in flight, and a line printed as each run ends."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator


class Report:
    """What a benchmark tells its progress display: `start(where)` before a run, `done(text)` after it."""

    def __init__(self, progress, bar) -> None:
        self._progress, self._bar, self._where = progress, bar, ""

    def start(self, where: str) -> None:
        self._where = where
        self._progress.update(self._bar, description=where)

    def done(self, text: str) -> None:
        self._progress.console.print(f"{self._where}: {text}")
        self._progress.advance(self._bar)


@contextlib.contextmanager
def progress(title: str, total: int) -> Iterator[Report]:
    """Show `total` runs of `title` as they go (on the terminal; plain lines when redirected)."""
    from rich.progress import Progress

    with Progress() as shown:
        yield Report(shown, shown.add_task(title, total=total))
