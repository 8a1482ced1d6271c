"""Where a command's output goes under --format: tables and notes for people, the document for programs, or
only what went wrong and the verdict."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

from rich.markup import escape

from gmtool.cli.options import OutputFormat
from gmtool.cli.progress import make_console
from gmtool.errors import Interrupted


class Output:
    def __init__(self, fmt: OutputFormat = OutputFormat.HUMAN):
        self.fmt = OutputFormat(fmt)
        human = self.fmt == OutputFormat.HUMAN
        # notes and progress: stdout for people; stderr under json (stdout holds the document alone); none quiet
        self.console = make_console(stderr=not human)
        self.console.quiet = self.fmt == OutputFormat.QUIET
        # errors, whatever the format
        self.problems = self.console if human else make_console(stderr=True)

    @property
    def human(self) -> bool:
        return self.fmt == OutputFormat.HUMAN

    def note(self, text: str) -> None:
        self.console.print(f"[yellow]note:[/] {escape(text)}", highlight=False, soft_wrap=True)

    def show(self, *renderables, **kw) -> None:
        """Tables, warnings and the files written: for people only."""
        if self.human:
            for r in renderables:
                self.console.print(r, **kw)

    def document(self, text: str) -> None:
        """The command's document (JSON text) on stdout, under --format json only."""
        if self.fmt == OutputFormat.JSON:
            sys.stdout.write(text.rstrip("\n") + "\n")
            sys.stdout.flush()

    def verdict(self, line: str, good: bool, label: str = "verdict") -> None:
        """The run's one-line verdict: under the tables, or alone on stdout under --format quiet. label: what
        precedes it ('' for a line that names itself)."""
        head = f"{label}: " if label else ""
        if self.human:
            style = "green" if good else "bold red"
            said = escape(line)  # a verdict quotes inputs and errors: brackets in them are not markup
            shown = f"[{style}]{head}[/]{said}" if head else f"[{style}]{said}[/]"  # unlabelled: all in colour
            self.console.print(shown, highlight=False, soft_wrap=True)
        elif self.fmt == OutputFormat.QUIET:
            print(f"{head}{line}", flush=True)


@contextlib.contextmanager
def document_if_interrupted(out: Output, path: Path):
    """Ctrl-C: under --format json, the partial document the run wrote at path goes to stdout, as a finished
    run's document does (its "partial" section says how far it got)."""
    from gmtool.parallel.launch import writes_here

    try:
        yield
    except Interrupted:
        # this run's: marked partial (a file left by an earlier phase, as memreport --check's sampled one, is
        # not), and once (a torchrun rank other than 0 writes nothing)
        text = path.read_text() if writes_here() and path.is_file() else ""
        try:
            partial = isinstance(doc := json.loads(text), dict) and "partial" in doc
        except ValueError:  # half-written, or nothing
            partial = False
        if partial:
            out.document(text)
        raise
