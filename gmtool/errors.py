"""gmtool's errors: each becomes one line at the entry point, never a traceback.

A GmtoolError is something the user can fix in what they asked for (exit 2). A RunFailure happened while
measuring what they asked for (exit 1): inside a sweep it becomes the row's status and the run goes on."""


class GmtoolError(Exception):
    """A problem with the user's input or environment (exit 2)."""


class RunFailure(GmtoolError):
    """The run could not do what was asked (exit 1)."""


class CaptureError(RunFailure):
    """Graph capture failed (an op that cannot be captured, or a host sync inside capture)."""


class InputsNotLoaded(RunFailure):
    """A graph replayed over another bucket's inputs: a caller skipped the load (executor.prepare) before it."""


class OutOfMemory(RunFailure):
    """The device ran out of memory; what was done before it is kept."""


class Interrupted(Exception):
    """Ctrl-C during a run, after what was measured was written (exit 130); its text says how far it got. Not a
    KeyboardInterrupt: typer turns those into a silent exit 130."""


def first_line(e: BaseException, typed: bool = False) -> str:
    """An exception said in one line: its message's first line (its type's name where it has none); typed: the
    type's name before it, for exceptions whose message does not name what went wrong."""
    lines = str(e).strip().splitlines()
    text = lines[0] if lines else ""
    if typed:
        return f"{type(e).__name__}: {text}" if text else type(e).__name__
    return text or type(e).__name__
