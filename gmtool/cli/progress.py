"""Progress of a sweep, driven through start(total) / advance(description): a rich bar on a terminal, one line
per bucket with an ETA when the output is a pipe or a file (a bar would print nothing useful there)."""

from __future__ import annotations

import time

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class SweepProgress:
    def __init__(self, console: Console, title: str):
        self.progress = Progress(
            TextColumn("[bold]{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TimeElapsedColumn(),
            console=console,
            transient=False,
            disable=console.quiet,
        )
        self.title, self.task = title, None

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        return self.progress.__exit__(*exc)

    def start(self, total: int) -> None:
        self.task = self.progress.add_task(self.title, total=total)

    def advance(self, description: str, n: int = 1) -> None:
        self.progress.update(self.task, advance=n, description=f"{self.title}: {description}")


def _clock(seconds: float) -> str:
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}" if s >= 3600 else f"{s // 60}:{s % 60:02d}"


class LineProgress:
    """One line each time a bucket is done: rows done of planned, time so far, and the time left at the pace so
    far. A description is '<bucket>: <detail>' (the sweep's 'bucket 8: 1*8') or the bucket alone; a bucket is
    done when the next one starts, or when the last row is."""

    def __init__(self, console: Console, title: str, clock=time.monotonic):
        self.console, self.title, self.clock = console, title, clock
        self.total, self.done, self.bucket, self.t0 = 0, 0, None, clock()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False

    def start(self, total: int) -> None:
        self.total, self.done, self.bucket, self.t0 = total, 0, None, self.clock()

    def advance(self, description: str, n: int = 1) -> None:
        """n: the rows the step measured (a sweep's composition: one a mode)."""
        bucket = description.split(":", 1)[0].strip()
        if self.bucket is not None and bucket != self.bucket:
            self._line(self.bucket, self.done)  # the previous bucket's rows are all done
        self.bucket = bucket
        self.done += n
        if self.done >= self.total:
            self._line(bucket, self.done)

    def _line(self, bucket: str, done: int) -> None:
        spent = self.clock() - self.t0
        left = spent / done * (self.total - done) if done else 0.0
        eta = "done" if done >= self.total else f"ETA {_clock(left)}"
        self.console.print(
            f"{self.title}: {bucket} done, {done}/{self.total} rows, {_clock(spent)} elapsed, {eta}",
            highlight=False,
            soft_wrap=True,
        )


def progress_bars(console: Console):
    """progress(label) for the application layer: a rich bar per sweep on a terminal, lines otherwise."""
    kind = SweepProgress if console.is_terminal else LineProgress
    return lambda label: kind(console, str(label))


def make_console(stderr: bool = False) -> Console:
    """Wide enough for the tables when the output is a file or a pipe (rich would assume 80 columns)."""
    c = Console(stderr=stderr)
    return c if c.is_terminal else Console(stderr=stderr, width=170)
