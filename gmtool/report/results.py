"""results.json / results.csv: the stable files every command writes and `gmtool report` reads back."""
from __future__ import annotations

import contextlib
import datetime as _dt
import os
import json
from pathlib import Path

import pandas as pd

from gmtool.errors import GmtoolError

SCHEMA_VERSION = 1
RECORD_KEYS = ("mode", "bucket", "composition", "status")  # what every report reads of a record
RESULTS_JSON, RESULTS_CSV = "results.json", "results.csv"


# what gmtool writes into an output directory: --force clears these, so no file of an older run stays behind
OUTPUT_FILES = ("results.json", "results.csv", "report.md", "report.html", "memreport.json", "memreport.csv",
                "memreport.png", "trace-*.json", "verify.json")


def prepare_out_dir(out: Path, force: bool) -> Path:
    """Refuse to write into a non-empty directory unless --force: never overwrite silently. With --force,
    the files an earlier gmtool run wrote there are removed first (other files are left alone)."""
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise GmtoolError(f"--out {out} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()):
        if not force:
            raise GmtoolError(f"output directory {out} exists and is not empty: pass --force to overwrite, or "
                              "another --out")
        for pattern in OUTPUT_FILES:
            for f in out.glob(pattern):
                f.unlink()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise GmtoolError(f"cannot create output directory {out}: {e.strerror or e}") from None
    return out


@contextlib.contextmanager
def output_dir(out: Path, force: bool):
    """prepare_out_dir, and a directory this run created is removed again if the run fails before writing."""
    created = not Path(out).exists()
    path = prepare_out_dir(out, force)
    try:
        yield path
    except BaseException:
        if created and path.is_dir() and not any(path.iterdir()):
            path.rmdir()
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


def to_document(result, command: str) -> dict:
    return {
        "schema_version": SCHEMA_VERSION, "tool": "gmtool", "command": command,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "wall_s": result.wall_s, "machine": result.machine, "model": result.model, "config": result.config,
        "notes": result.notes, "errors": result.errors, "records": result.records,
    }


def flat_records(records: list[dict]) -> pd.DataFrame:
    """One row per record; nested timing dicts become latency_ms_median, host_us_p90, ..."""
    rows = []
    for r in records:
        row = {}
        for k, v in r.items():
            if isinstance(v, dict):
                for sk, sv in v.items():
                    row[f"{k}_{sk}"] = sv
            else:
                row[k] = v
        rows.append(row)
    return pd.DataFrame(rows)


def write_results(out: Path, doc: dict) -> list[Path]:
    out = Path(out)
    (out / RESULTS_JSON).write_text(json.dumps(doc, indent=2, default=str))
    flat_records(doc["records"]).to_csv(out / RESULTS_CSV, index=False)
    return [out / RESULTS_JSON, out / RESULTS_CSV]


def load_results(path: Path) -> dict:
    path = Path(path)
    if path.is_dir():
        path = path / RESULTS_JSON
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise GmtoolError(f"no results file at {path}") from None
    except (OSError, ValueError) as e:  # ValueError: bad JSON, or bytes that are not UTF-8
        raise GmtoolError(f"cannot read results file {path}: {e}") from None
    if not isinstance(doc, dict) or doc.get("tool") != "gmtool" or not isinstance(doc.get("records"), list):
        raise GmtoolError(f"{path} is not a gmtool results file")
    for key in ("model", "config", "machine"):
        if not isinstance(doc.get(key), dict):
            raise GmtoolError(f"{path} is not a complete gmtool results file: no {key!r} section")
    for i, r in enumerate(doc["records"]):
        missing = [k for k in RECORD_KEYS if not isinstance(r, dict) or k not in r]
        if missing:
            raise GmtoolError(f"{path}: record {i} lacks {', '.join(missing)}")
    return doc


REPORT_MD, REPORT_HTML = "report.md", "report.html"


def write_reports(out: Path, doc: dict) -> list[Path]:
    """report.md and the self-contained report.html, both rendered from the results document alone."""
    from gmtool.report.html import render_html  # matplotlib: only commands that write reports pay for it
    from gmtool.report.markdown import render_markdown

    out = Path(out)
    (out / REPORT_MD).write_text(render_markdown(doc))
    (out / REPORT_HTML).write_text(render_html(doc))
    return [out / REPORT_MD, out / REPORT_HTML]
