"""Progress of the CLI's long work (builds, tuning, benchmarks) on a terminal and in a log.

On a terminal: click's progress bar. Elsewhere (a CI log, `... > run.log`, a remote command whose output comes back
later) click's bar prints its label once and nothing until the end, so a run stopped by a time limit says nothing of
how far it got; there each step that ends prints one line with its count, what it was and the time so far, at most one
line every `interval` seconds (the last always).
"""

from __future__ import annotations

import sys
import time
from contextlib import contextmanager
from typing import Callable, Iterator, TextIO

import click

# A step's line in a log at most this often: ninja's steps of a build come many a second, a benchmark's one a few.
LOG_INTERVAL_S = 5.0


class LogProgress:
    """Lines of progress for a stream that is not a terminal (see the module docstring)."""

    def __init__(self, length: int, label: str, stream: TextIO, interval: float = LOG_INTERVAL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.length, self.label, self.stream, self.interval, self.clock = length, label, stream, interval, clock
        self.done = 0
        self.started = clock()
        self.printed_at: float | None = None
        print(f"{label}: {length} step(s)", file=stream, flush=True)

    def grow(self, length: int) -> None:
        """More steps than first counted (ninja's graph, known once it runs)."""
        self.length = max(self.length, length)

    def update(self, steps: int = 1, what: str = "") -> None:
        self.done += steps
        now = self.clock()
        if self.done < self.length and self.printed_at is not None and now - self.printed_at < self.interval:
            return
        self.printed_at = now
        detail = f" {what}" if what else ""
        print(f"{self.label}: {self.done}/{self.length}{detail} ({now - self.started:.0f} s)", file=self.stream,
              flush=True)


class _BarProgress:
    def __init__(self, bar) -> None:
        self.bar = bar

    def grow(self, length: int) -> None:
        self.bar.length = max(self.bar.length, length)

    def update(self, steps: int = 1, what: str = "") -> None:
        self.bar.update(steps)


@contextmanager
def progress(length: int, label: str, stream: TextIO | None = None) -> Iterator[LogProgress | _BarProgress]:
    """A progress report of `length` steps: `.update(steps=1, what="")` as each ends (what: a few words on it,
    shown in a log only), `.grow(length)` where more steps turn up. A bar on a terminal, lines otherwise; on
    standard error unless `stream` says."""
    stream = stream or sys.stderr
    if stream.isatty():
        with click.progressbar(length=length, label=label, file=stream, show_pos=True) as bar:
            yield _BarProgress(bar)
    else:
        yield LogProgress(length, label, stream)
