"""gmtool report: render report.md / report.html (and the terminal table) again from a results.json."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from gmtool.cli import options as o
from gmtool.cli.output import Output
from gmtool.cli.run_sweep import finish
from gmtool.errors import GmtoolError
from gmtool.report.baseline import attach_baseline, load_baseline
from gmtool.report.results import (
    OUTPUT_FILES,
    REPORT_HTML,
    REPORT_MD,
    check_renderable,
    load_results,
    prepare_out_dir,
    results_file,
    write_reports,
)
from gmtool.report.summary import verdict
from gmtool.report.tables import baseline_line, compare_table, noise_warning

BaselineOpt = Annotated[
    Optional[Path],
    typer.Option(
        "--baseline",
        help="An older results.json (or its directory) of the same model: adds each row's latency and error change.",
    ),
]


def report(
    results: Annotated[Path, typer.Argument(help="A results directory, or its results.json.")],
    baseline: BaselineOpt = None,
    out: Annotated[
        Optional[Path],
        typer.Option("--out", "-o", help="Where to write report.md / report.html (default: next to the results)."),
    ] = None,
    force: o.ForceOpt = False,
    fmt: o.FormatOpt = o.OutputFormat.HUMAN,
) -> None:
    """Re-render the reports of a finished run; --baseline adds the change against an older run."""
    out_ = Output(fmt)
    doc = load_results(results)
    check_renderable(doc, results)
    if baseline is not None:
        attach_baseline(doc, load_baseline(baseline), baseline)
    src_dir = results if results.is_dir() else results.parent
    if out is None or out.resolve() == src_dir.resolve():
        out_dir = src_dir  # re-rendering in place replaces only the two report files
    else:
        theirs = sorted({f.name for p in OUTPUT_FILES if out.is_dir() for f in out.glob(p)} - {REPORT_MD, REPORT_HTML})
        if theirs:  # --force would delete another run's results to write two report files beside nothing
            raise GmtoolError(
                f"--out {out} holds another run's files ({', '.join(theirs)}): report writes only "
                f"{REPORT_MD} and {REPORT_HTML}, give a directory of their own"
            )
        out_dir = prepare_out_dir(out, force)
    files = write_reports(out_dir, doc)
    data = doc.to_dict()
    out_.document(doc.to_json())
    out_.show(compare_table(data))
    if base := baseline_line(data):
        out_.show(escape(base), highlight=False)
    noise = noise_warning(data)
    if noise:
        out_.show(f"[yellow]warning:[/] {escape(noise)}", highlight=False)
    out_.show(escape(f"from {results_file(results)}: wrote " + ", ".join(str(f) for f in files)), highlight=False)
    # the run's errors and unexpected UNSAFE rows, its verdict and its exit code, as the run itself ended
    finish(doc, out_.problems, lambda: out_.verdict(verdict(data), doc.exit_code() == 0))
