"""Records and documents typed in one place: JSON out and back in unchanged, a malformed results file refused in
one line naming what is wrong, and results.csv's columns as the README names them."""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd
import pytest

from gmtool.errors import GmtoolError
from gmtool.records import Document, Partial, Record, Status, Timing
from gmtool.report.results import write_results
from tests.test_compare import one_error, run_cli
from tests.test_report import make_doc, timing

README = Path(__file__).resolve().parent.parent / "README.md"


def test_document_round_trips_through_json():
    t = Timing(median=1.5, p90=2.0, p99=2.5, min=1.0, iqr=0.25, n=7, noisy=False)
    doc = Document(
        command="compare",
        machine={"backend": "cpu-tape"},
        model={"name": "tiny-qwen3"},
        config={"modes": ["eager", "full"]},
        notes=["n"],
        errors=["e"],
        records=[
            Record(
                mode="full",
                bucket=4,
                composition="1*4",
                status=Status.OK,
                latency_ms=t,
                host_steady_us=t,
                max_rel_err=float("inf"),
                stale_metadata=False,
                baseline={"status": "ok", "latency_ms": 3.0},
            ),
            Record(mode="eager", bucket=4, composition="1*4", status=Status.ERROR, error="x"),
        ],
        partial=Partial(reason="interrupted", measured=2, planned=6),
    )
    text = doc.to_json()
    json.loads(text, parse_constant=lambda c: pytest.fail(f"{c} in results.json: not standard JSON"))
    back = Document.from_json(text)
    assert back.records[0].max_rel_err is None  # an infinite error (a replay that left NaN) is written as null
    back.records[0].max_rel_err = float("inf")
    assert back == doc
    assert isinstance(back.records[0].status, Status) and isinstance(back.records[0].latency_ms, Timing)
    assert back.records[0].mode == "full" and back.records[0].latency_ms.n == 7
    # a hand-built results file (the reports' tests' own) reads back to the same JSON
    plain = make_doc()
    again = Document.from_dict(plain).to_dict()
    for r, s in zip(plain["records"], again["records"]):
        assert {k: v for k, v in s.items() if v is not None} == {k: v for k, v in r.items() if v is not None}
    assert {k: again[k] for k in plain if k != "records"} == {k: plain[k] for k in plain if k != "records"}
    assert "partial" not in again and "baseline" not in again  # only when there is one


def test_exit_code_is_the_documents():
    def code(*rows):
        return Document(
            machine={},
            model={},
            config={},
            records=[Record(mode=m, bucket=1, composition="1", status=s) for m, s in rows],
        ).exit_code()

    assert code(("full", "ok"), ("full-narrow", "UNSAFE")) == 0
    assert code(("full", "ok"), ("piecewise", "UNSAFE")) == 3
    assert code(("full", "oom"), ("piecewise", "UNSAFE")) == 1


@pytest.mark.parametrize(
    "change, message",
    [
        (lambda d: d["records"][2].update(bucket="8"), 'record 3: bucket is "8", not an integer'),
        (lambda d: d["records"][0].update(status="fine"), "record 1: status is 'fine', not one of ok, skipped"),
        (
            lambda d: d["records"][3]["latency_ms"].update(median="fast"),
            'record 4: latency_ms: median is "fast", not a number',
        ),
        (lambda d: d["records"][1].update(mode="turbo"), "record 2: mode is 'turbo', not one of eager, full"),
        (lambda d: d["records"][4]["latency_ms"].pop("n"), "record 5: latency_ms lacks 'n'"),
        (lambda d: d.update(errors="none"), "errors is not a list"),
        (lambda d: d.update(schema_version=99), "a results file of schema version 99, from a newer gmtool"),
    ],
)
def test_a_malformed_results_file_is_one_line(tmp_path, change, message):
    doc = make_doc()
    change(doc)
    (tmp_path / "results.json").write_text(json.dumps(doc))
    code, _, err = run_cli("report", tmp_path)
    assert code == 2 and message in one_error(err), err
    assert not (tmp_path / "report.md").exists()
    with pytest.raises(GmtoolError, match="not a gmtool results file"):
        Document.from_dict({"tool": "other", "records": []})


def test_results_csv_has_no_always_empty_timing_columns(tmp_path):
    """Each timing is spread over <field>_median, _p90, ... columns that hold its values; no column of the
    bare field's name stays empty beside them; the README names the columns that exist."""
    doc = make_doc()
    for r in doc["records"]:
        if r["mode"] == "full" and r["latency_ms"]:
            r.update(host_us=timing(20.0), host_copy_us=timing(7.0), host_steady_us=timing(18.0))
    write_results(tmp_path, Document.from_dict(doc))
    table = pd.read_csv(tmp_path / "results.csv")
    assert not {"latency_ms", "host_us", "host_copy_us", "host_steady_us"} & set(table.columns)
    for f, want in (("latency_ms", None), ("host_us", 20.0), ("host_copy_us", 7.0), ("host_steady_us", 18.0)):
        values = [r[f]["median"] for r in doc["records"] if r.get(f)]
        assert sorted(table[f"{f}_median"].dropna()) == sorted(values) and values, f
        assert want is None or set(values) == {want}
    readme = README.read_text()
    for col in (
        "host_us_median",
        "host_copy_us_median",
        "host_steady_us_median",
        "latency_ms_median",
        "latency_ms_p90",
    ):
        assert f"`{col}`" in readme and col in table.columns, col
