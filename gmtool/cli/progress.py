"""A rich progress bar the sweep drives through start(total) / advance(description)."""
from __future__ import annotations

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn


class SweepProgress:
    def __init__(self, console: Console, title: str):
        self.progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TimeElapsedColumn(), console=console, transient=False,
                                 disable=not console.is_terminal and console.quiet)
        self.title, self.task = title, None

    def __enter__(self):
        self.progress.__enter__()
        return self

    def __exit__(self, *exc):
        return self.progress.__exit__(*exc)

    def start(self, total: int) -> None:
        self.task = self.progress.add_task(self.title, total=total)

    def advance(self, description: str) -> None:
        self.progress.update(self.task, advance=1, description=f"{self.title}: {description}")


def progress_bars(console: Console):
    """progress(label) for the application layer: a rich bar per sweep, on this console."""
    return lambda label: SweepProgress(console, str(label))


def make_console(stderr: bool = False) -> Console:
    """Wide enough for the tables when the output is a file or a pipe (rich would assume 80 columns)."""
    c = Console(stderr=stderr)
    return c if c.is_terminal else Console(stderr=stderr, width=170)
