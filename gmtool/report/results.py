"""results.json / results.csv and the records.jsonl journal: the stable files every command writes and
`gmtool report` reads back."""

from __future__ import annotations

import contextlib
import datetime as _dt
import json
import os
import re
import tempfile
from pathlib import Path

import pandas as pd

from gmtool.errors import GmtoolError
from gmtool.modes import GraphMode
from gmtool.records import Document, Partial, Record, Status
from gmtool.report.summary import run_tp
from gmtool import json_text

RESULTS_JSON, RESULTS_CSV, JOURNAL = "results.json", "results.csv", "records.jsonl"


# what gmtool writes into an output directory: --force clears these, so no file of an older run stays behind
OUTPUT_FILES = (
    "results.json",
    "results.csv",
    "records.jsonl",
    "report.md",
    "report.html",
    "memreport.json",
    "memreport.csv",
    "memreport.png",
    "trace-*.json",
    "plan.json",
    "plan.md",
    "plan.png",
    "verify.json",
)


def check_out_dir(out: Path, force: bool) -> None:
    """What prepare_out_dir would refuse of out, without creating or clearing anything: for a command that has
    work to do before it writes (plan's measurement)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise GmtoolError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not force:
        raise GmtoolError(
            f"output directory {out} exists and is not empty: pass --force to overwrite, or another --out"
        )


def prepare_out_dir(out: Path, force: bool) -> Path:
    """Refuse to write into a non-empty directory unless --force: never overwrite silently. With --force,
    the files an earlier gmtool run wrote there are removed first (other files are left alone)."""
    out = Path(out)
    check_out_dir(out, force)
    if out.is_dir() and any(out.iterdir()):
        try:
            for pattern in OUTPUT_FILES:
                for f in out.glob(pattern):
                    f.unlink()
        except OSError as e:
            raise GmtoolError(f"cannot clear output directory {out}: {e.strerror or e}") from None
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise GmtoolError(f"cannot create output directory {out}: {e.strerror or e}") from None
    try:  # now, not after the sweep: a read-only directory or filesystem would lose the whole run
        with tempfile.TemporaryFile(dir=out):
            pass
    except OSError as e:
        raise GmtoolError(f"cannot write into output directory {out}: {e.strerror or e}") from None
    return out


@contextlib.contextmanager
def output_dir(out: Path, force: bool):
    """prepare_out_dir, and the directories this run created (gmtool-out/ as well as gmtool-out/run-...) are
    removed again if the run fails before writing into them."""
    created = [p for p in (Path(out), *Path(out).parents) if not p.exists()]  # innermost first
    path = prepare_out_dir(out, force)
    try:
        yield path
    except BaseException:
        for d in created:
            if not d.is_dir() or any(d.iterdir()):
                break
            d.rmdir()
        raise


def default_out_dir(command: str) -> Path:
    """gmtool-out/<command>-<time>-<pid>: runs started in the same second never share one."""
    stamp = _dt.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = Path("gmtool-out") / f"{command}-{stamp}-{os.getpid()}"
    path, n = base, 1
    while path.exists():
        n += 1
        path = base.with_name(f"{base.name}-{n}")
    return path


def _write_whole(path: Path, text: str) -> None:
    """A file that is there whole or not at all: a process killed while writing results.json left it cut short
    beside a complete journal, and report refused both."""
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def write_results(out: Path, doc: Document) -> list[Path]:
    out = Path(out)
    _write_whole(out / RESULTS_JSON, doc.to_json())
    # object columns: a count left empty in some rows (eager has no pieces, a failed row no latency_ms_n) stays
    # an integer in the others, not a float column's 1.0
    table = pd.DataFrame([r.flat() for r in doc.records], dtype=object)
    columns = _csv_columns()
    table.reindex(columns=columns + [c for c in table.columns if c not in columns]).to_csv(
        out / RESULTS_CSV, index=False
    )
    return [out / RESULTS_JSON, out / RESULTS_CSV]


def _csv_columns() -> list[str]:
    """Every record field in order, each timing spread over its own columns (latency_ms_median, ...)."""
    return list(Record(mode=GraphMode.EAGER, bucket=0, composition="", status=Status.OK).flat())


class Journal:
    """records.jsonl: each record appended as one JSON line the moment it is measured, after a first line that
    holds the run's machine, model, config and planned row count. What a killed run (Ctrl-C, a crash, the
    kernel's OOM killer) still leaves behind; `gmtool report` reads it when results.json is missing."""

    def __init__(self, out: Path, command: str, planned: int):
        self.path, self.command, self.planned, self.started = Path(out) / JOURNAL, command, planned, False

    def write(self, result, rec: Record) -> None:
        """result: the SweepResult the record belongs to (its header, written before the first record)."""
        lines = []
        if not self.started:
            head = result.document(self.command)
            head.records, head.partial = [], Partial(reason="unfinished", measured=0, planned=self.planned)
            lines.append(head.to_dict())
            self.started = True
        lines.append(rec.to_dict())
        with self.path.open("a") as f:
            f.writelines(json_text.dumps(x, default=str) + "\n" for x in lines)


def _read_journal(path: Path) -> tuple[dict, list[int]]:
    """The journal's document, and the file line of each record (blank lines skipped, still counted)."""
    lines = [(n, ln) for n, ln in enumerate(path.read_text().splitlines(), 1) if ln.strip()]
    if not lines:
        raise GmtoolError(f"{path} is empty: the run measured nothing")
    rows = []
    for i, (n, ln) in enumerate(lines):
        try:
            rows.append(json.loads(ln))
        except ValueError:
            if i == len(lines) - 1:  # the line being written when the process died
                break
            raise GmtoolError(f"{path}: line {n} is not JSON") from None
    if not rows:  # killed while writing the header: nothing was measured
        raise GmtoolError(f"{path} holds one line, cut short: the run measured nothing")
    doc, records = rows[0], rows[1:]
    record_lines = [n for n, _ in lines[1 : len(rows)]]
    if not isinstance(doc, dict) or not isinstance(doc.get("partial"), dict):
        raise GmtoolError(f"{path} is not a gmtool journal")
    doc["records"] = records
    planned = doc["partial"].get("planned")
    beside = "the run's results.json is beside it" if (path.parent / RESULTS_JSON).exists() else "no results.json"
    if isinstance(planned, int) and len(records) > planned:
        raise GmtoolError(
            f"{path} holds {len(records)} rows, more than the {planned} the run planned: rows written twice?"
        )
    tp = run_tp(doc.get("config"))  # under --tp the journal is rank 0's rows: never the whole run
    if isinstance(planned, int) and len(records) >= planned and tp == 1:  # every row measured: the whole run
        doc["partial"] = None
        doc.setdefault("notes", []).append(f"read from the journal ({beside}): all {planned} planned rows measured")
        return doc, record_lines
    doc["partial"]["measured"] = len(records)
    doc.setdefault("notes", []).append(
        f"partial run: {len(records)} of {planned} rows measured (read from the journal; {beside})"
    )
    return doc, record_lines


def results_file(path: Path) -> Path:
    """The file load_results reads for path: itself, or a directory's results.json, else its journal."""
    path = Path(path)
    if path.is_dir() and not (path / RESULTS_JSON).exists() and (path / JOURNAL).exists():
        return path / JOURNAL
    return path / RESULTS_JSON if path.is_dir() else path


def load_results(path: Path) -> Document:
    """results.json (or a directory holding it; without one, the directory's records.jsonl), checked: a missing
    key or a value of the wrong type is one GmtoolError naming it."""
    path = results_file(path)
    record_lines: list[int] = []
    try:
        if path.suffix == ".jsonl":
            doc, record_lines = _read_journal(path)
        else:
            doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise GmtoolError(f"no results file at {path}") from None
    except (OSError, ValueError) as e:  # ValueError: bad JSON, or bytes that are not UTF-8
        journal = path.with_name(JOURNAL)
        if path.name != RESULTS_JSON or path.suffix == ".jsonl" or not journal.exists():
            raise GmtoolError(f"cannot read results file {path}: {e}") from None
        doc, record_lines = _read_journal(journal)  # the run's rows as measured, beside a damaged results.json
        doc["notes"].append(f"{path} cannot be read ({str(e).splitlines()[0][:80]}): read from {journal}")
        path = journal
    try:
        return Document.from_dict(doc)
    except GmtoolError as e:
        if str(e) == "not a gmtool results file":
            raise GmtoolError(f"{path} is not a gmtool results file") from None
        text = str(e)
        if path.suffix == ".jsonl":  # the journal's lines: its header, then the records
            text = re.sub(r"^record (\d+)", lambda m: f"record {m[1]} (line {_line_of(record_lines, m[1])})", text)
        raise GmtoolError(f"{path}: {text}") from None


def _line_of(record_lines: list[int], number: str) -> int | str:
    """The journal line of record `number` (as Document.from_dict counts records: from 1)."""
    i = int(number) - 1
    return record_lines[i] if 0 <= i < len(record_lines) else "?"


REPORT_MD, REPORT_HTML = "report.md", "report.html"
# what the reports' overview reads of each section (a results.json edited by hand may lack them)
REPORT_KEYS = {
    "model": ("name", "source"),
    "machine": ("backend", "torch", "transformers"),
    "config": ("scenario", "dtype", "bucket_sizes", "num_iters", "num_iters_warmup", "max_kv_len"),
}


def check_renderable(doc: Document, path: Path) -> None:
    """A GmtoolError naming the first key the reports need that the document lacks."""
    for section, keys in REPORT_KEYS.items():
        missing = [k for k in keys if k not in getattr(doc, section)]
        if missing:
            raise GmtoolError(
                f"{results_file(path)}: the {section!r} section lacks {', '.join(missing)} (needed for the report)"
            )


def write_reports(out: Path, doc: Document) -> list[Path]:
    """report.md and the self-contained report.html, both rendered from the results document alone."""
    from gmtool.report.html import render_html  # matplotlib: only commands that write reports pay for it
    from gmtool.report.markdown import render_markdown

    out, data = Path(out), doc.to_dict()
    (out / REPORT_MD).write_text(render_markdown(data))
    (out / REPORT_HTML).write_text(render_html(data))
    return [out / REPORT_MD, out / REPORT_HTML]
