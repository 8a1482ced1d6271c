"""gmtool: make CUDA graph mode for LLM inference visible and measurable."""

from __future__ import annotations

import inspect
import sys
from typing import Annotated, Optional

import typer
from rich.console import Console
from rich.markup import escape

from gmtool.errors import GmtoolError, Interrupted, RunFailure

app = typer.Typer(
    name="gmtool",
    no_args_is_help=True,
    add_completion=True,
    pretty_exceptions_enable=False,
    help="Capture CUDA graphs of a Hugging Face causal LM per token bucket, check every replay against eager, "
    "and measure memory and latency. Without CUDA, the CPU tape backend emulates capture/replay.",
)
err_console = Console(stderr=True)


def _version(value: bool) -> None:
    if value:
        from gmtool import __version__

        print(f"gmtool {__version__}")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        Optional[bool],
        typer.Option("--version", callback=_version, is_eager=True, help="Print gmtool's version and exit."),
    ] = None,
) -> None:
    """gmtool: CUDA graph capture, replay and memory, measured against eager."""


def _register() -> None:
    from gmtool.cli import bench, capture, compare, memreport, plan, report, verify

    for name, fn in [
        ("capture", capture.capture),
        ("memreport", memreport.memreport),
        ("compare", compare.compare),
        ("report", report.report),
        ("bench", bench.bench),
        ("plan", plan.plan),
        ("verify", verify.verify),
    ]:
        app.command(name, short_help=_summary(fn))(fn)


def _summary(fn) -> str:
    """A command's line in `gmtool --help`: its docstring's first paragraph as one line (rich keeps the
    docstring's line breaks there, and a wrapped line ended mid-sentence)."""
    return " ".join(inspect.getdoc(fn).split("\n\n")[0].split())


_register()


def main() -> None:
    try:
        from gmtool.cli.repeats import refuse_repeated

        refuse_repeated(typer.main.get_command(app), sys.argv[1:])
        rc = app(standalone_mode=False, prog_name="gmtool")  # typer.Exit(n) comes back as the return value here
        if rc == 130:  # typer turns a Ctrl-C that no command caught (verify, plan) into Exit(130), silently
            err_console.print("[yellow]interrupted[/]")
        sys.exit(rc if isinstance(rc, int) else 0)
    except Interrupted as e:  # says how far the run got; what it measured is written
        err_console.print(f"[yellow]{escape(str(e))}[/]", highlight=False, soft_wrap=True)
        sys.exit(130)
    except GmtoolError as e:
        err_console.print(f"[bold red]error:[/] {escape(str(e))}", highlight=False, soft_wrap=True)
        sys.exit(1 if isinstance(e, RunFailure) else 2)
    except PermissionError as e:  # a folder or file the user cannot read or write, wherever it was met
        err_console.print(
            f"[bold red]error:[/] {escape(str(e.filename) + ': ' if e.filename else '')}permission denied",
            highlight=False,
            soft_wrap=True,
        )
        sys.exit(2)
    except KeyboardInterrupt:
        err_console.print("[yellow]interrupted[/]")
        sys.exit(130)
    except (typer.Exit, SystemExit) as e:
        sys.exit(getattr(e, "exit_code", getattr(e, "code", 0)))
    except Exception as e:
        # click's usage errors (typer may vendor click): one line, as gmtool's own errors
        if hasattr(e, "format_message") and hasattr(e, "exit_code"):
            if type(e).__name__ == "NoArgsIsHelpError":
                e.show()
                sys.exit(0)
            msg = e.format_message().replace("Value error, ", "")
            err_console.print(
                f"[bold red]error:[/] {escape(msg[:1].lower() + msg[1:])}", highlight=False, soft_wrap=True
            )
            sys.exit(e.exit_code)
        if type(e).__name__ == "Abort":
            sys.exit(1)
        raise


if __name__ == "__main__":
    main()
