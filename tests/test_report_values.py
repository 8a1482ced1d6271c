"""Reading a finished run's files that were edited by hand or damaged: values no run writes are refused naming
the record, the reports never show them as fine, a baseline's changes are over the rows both runs measured,
and `gmtool report` ends as the run did."""

from __future__ import annotations

import copy
import json

import pytest

from gmtool.errors import GmtoolError
from gmtool.records import Document
from gmtool.report.baseline import attach_baseline
from gmtool.report.results import JOURNAL, load_results, write_results
from gmtool.report.summary import bucket_summary
from gmtool.report.tables import baseline_counts
from tests.test_compare import FAST, run_cli
from tests.test_report import make_doc, rec


def _refused(doc: dict, match: str) -> None:
    with pytest.raises(GmtoolError, match=match):
        Document.from_dict(doc)


@pytest.mark.parametrize(
    "edit,match",
    [
        (lambda d: d["records"][2].update(max_rel_err=float("nan")), r"record 3 .*status ok but max_rel_err nan"),
        (lambda d: d["records"][2].update(max_rel_err=0.5), r"status ok but max_rel_err 0.5 is not within"),
        (lambda d: d["records"][2]["latency_ms"].update(median=-1.0), r"record 3 .*latency_ms median is -1.0"),
        (lambda d: d["records"][2]["latency_ms"].update(p90=float("inf")), r"latency_ms p90 is inf"),
        (lambda d: d["records"][2].update(capture_s=-3.0), r"capture_s is -3.0"),
        (lambda d: d["records"][2].update(graph_mem_bytes=-(2**31)), r"graph_mem_bytes is -2147483648"),
        (lambda d: d["records"][2].update(bucket=0), r"bucket is 0: a size from 1 to 2,147,483,647"),
        # sizes and times no step has: the plots' log2 and the plan's int64 failed with a traceback on them
        (lambda d: d["records"][2].update(bucket=10**30), r"bucket is 1000000000000000000000000000000: a size"),
        (
            lambda d: d["records"][2]["latency_ms"].update(median=1e308),
            r"latency_ms median is 1e\+308: .* below 1e\+12",
        ),
        (lambda d: d["records"][6].update(max_rel_err=-1.0), r"a relative error is at least 0"),
        (lambda d: d.update(wall_s=-1.0), r"wall_s is -1.0"),
        (lambda d: d["config"].update(tp="2"), r"config: tp is \"2\""),
        (lambda d: d["config"].update(modes="eager,full"), r"config: modes is .*not a list"),
        (lambda d: d["config"].update(bucket_sizes=4), r"config: bucket_sizes is 4"),
        (lambda d: d["model"].update(params="90k"), r"model: params is \"90k\""),
        (lambda d: d.update(baseline={"path": "x"}), r"baseline lacks"),
        (lambda d: d.update(baseline={"path": "x", "matched": 1, "unmatched": 0, "buckets": [1]}), r"baseline lacks"),
    ],
)
def test_values_no_run_writes_are_refused_naming_the_record(edit, match):
    doc = make_doc()
    edit(doc)
    _refused(doc, match)


def test_nan_on_a_failed_row_is_kept_and_is_the_buckets_worst_error():
    """An UNSAFE replay that wrote NaN is a real result; max() kept or dropped the NaN by its place in the
    bucket."""
    doc = make_doc()
    unsafe = next(r for r in doc["records"] if r["status"] == "UNSAFE" and r["bucket"] == 16)
    unsafe["max_rel_err"] = float("nan")
    Document.from_dict(doc)  # read as it is
    for order in (doc["records"], list(reversed(doc["records"]))):
        row = next(s for s in bucket_summary(order) if (s["mode"], s["bucket"]) == ("full", 16))
        assert row["max_rel_err"] != row["max_rel_err"], row


def test_wall_s_null_renders(tmp_path):
    doc = make_doc()
    doc["wall_s"] = None
    write_results(tmp_path, Document.from_dict(doc))
    code, _, err = run_cli("report", tmp_path)
    assert "Traceback" not in err and (tmp_path / "report.md").exists()


def test_report_says_the_runs_errors_and_exits_as_the_run_did(tmp_path):
    """The run's errors were printed nowhere (the verdict said 'printed above'), in neither report file, and
    report exited 0 where the run had exited 1."""
    doc = make_doc()
    doc["errors"] = ["fused check failed: layer 3 differs by 0.4"]
    write_results(tmp_path, Document.from_dict(doc))
    code, out, err = run_cli("report", tmp_path)
    assert code == 1
    assert "fused check failed: layer 3 differs by 0.4" in " ".join((out + err).split())
    for name in ("report.md", "report.html"):
        assert "fused check failed: layer 3 differs by 0.4" in (tmp_path / name).read_text(), name
    ok = make_doc()
    ok["records"] = [r for r in ok["records"] if r["status"] == "ok" or r["mode"] == "full-narrow"]
    (tmp_path / "ok").mkdir()
    write_results(tmp_path / "ok", Document.from_dict(ok))
    assert run_cli("report", tmp_path / "ok")[0] == 0  # full-narrow's UNSAFE rows are expected
    unsafe = copy.deepcopy(ok)
    unsafe["records"].append(rec("full", 16, "4*4", "UNSAFE", err=0.8, key="t16xs4", error="differs"))
    (tmp_path / "u").mkdir()
    write_results(tmp_path / "u", Document.from_dict(unsafe))
    assert run_cli("report", tmp_path / "u")[0] == 3


def test_baseline_bucket_changes_are_over_the_rows_both_runs_measured(tmp_path):
    """A baseline holding one of a bucket's two mixes: the bucket's change compared the median of two mixes with
    the median of one, a change on identical data."""
    new = Document.from_dict(make_doc())
    old_doc = make_doc()
    old_doc["records"] = [
        r
        for r in old_doc["records"]
        if not (r["mode"] == "full" and r["latency_ms"] and r["latency_ms"]["median"] == 1.1)
    ]
    old_doc["partial"] = {"reason": "interrupted", "measured": len(old_doc["records"]), "planned": 20}
    old_doc["config"]["dtype"] = "float32"
    attach_baseline(new, Document.from_dict(old_doc), tmp_path / "old")
    full8 = next(b for b in new.baseline["buckets"] if (b["mode"], b["bucket"], b["rank"]) == ("full", 8, None))
    assert full8["replay_delta_pct"] == 0.0 and full8["mixes_compared"] == 1 and full8["mixes"] == 2, full8
    text = baseline_counts(new.baseline)
    assert "1 bucket change over the matched rows only" in text, text
    assert "the baseline is a partial run" in text and "the runs differ: dtype float32 then, bfloat16 now" in text


def test_compare_keeps_its_results_when_the_baseline_is_another_models(tmp_path):
    """A baseline of the same name but another parameter count is known only once the model is built: it was
    refused after the sweep, and the measurement was lost."""
    first = tmp_path / "a"
    assert run_cli("compare", "eager,full", *FAST, "--buckets", "1", "--out", first)[0] == 0
    doc = json.loads((first / "results.json").read_text())
    doc["model"]["params"] = 12345
    (first / "results.json").write_text(json.dumps(doc))
    code, out, err = run_cli(
        "compare", "eager,full", *FAST, "--buckets", "1", "--out", tmp_path / "b", "--baseline", first
    )
    assert code == 0 and (tmp_path / "b" / "results.json").exists() and (tmp_path / "b" / "report.md").exists()
    saved = json.loads((tmp_path / "b" / "results.json").read_text())
    assert any("12,345 parameters" in n and "written without it" in n for n in saved["notes"]), saved["notes"]
    assert "written without it" in " ".join(out.split()) and "baseline" not in saved


def test_a_cut_short_results_file_falls_back_to_its_journal(tmp_path):
    first = tmp_path / "a"
    assert run_cli("compare", "eager,full", *FAST, "--buckets", "1", "--out", first)[0] == 0
    whole = load_results(first)
    text = (first / "results.json").read_text()
    (first / "results.json").write_text(text[: len(text) // 2])
    doc = load_results(first)
    assert len(doc.records) == len(whole.records)
    assert any("cannot be read" in n and JOURNAL in n for n in doc.notes), doc.notes
    journal = (first / JOURNAL).read_text().splitlines()
    (first / JOURNAL).write_text("\n".join(journal + journal[1:]) + "\n")  # every row written twice
    with pytest.raises(GmtoolError, match="more than the .* the run planned"):
        load_results(first)
    assert not list(first.glob(".*.tmp"))  # results.json is written whole, through a temporary file


def test_plan_says_what_it_estimated_and_what_failed(tmp_path):
    from gmtool.plan.costs import from_results

    doc = make_doc()
    doc["records"] = [r for r in doc["records"] if r["mode"] in ("eager", "full", "piecewise")]
    for r in doc["records"]:
        if r["mode"] == "full" and r["bucket"] == 16:
            r.update(status="ok", max_rel_err=0.0, latency_ms=None, error=None)
    costs = from_results(doc, "full")
    assert any("full buckets 16 have no latency" in n for n in costs.notes), costs.notes
    for r in doc["records"]:
        if r["mode"] == "full":
            r.update(status="UNSAFE", max_rel_err=1.0, error="x")
        if r["mode"] == "piecewise":
            r.update(status="ok", error=None, max_rel_err=0.0)
    with pytest.raises(GmtoolError, match="plan --mode piecewise costs the piecewise rows"):
        from_results(doc, "full")
    for r in doc["records"]:
        if r["mode"] == "eager":
            r.update(status="error", error="boom")
    with pytest.raises(GmtoolError, match="no eager row of the results is ok"):
        from_results(doc, "piecewise")


def test_a_journal_record_is_named_by_its_line(tmp_path):
    """The journal's first line is its header: 'record 2' was line 3 of the file, and the user looked at line 2."""
    run = tmp_path / "a"
    assert run_cli("capture", *FAST, "--buckets", "1", "--out", run)[0] == 0
    lines = (run / JOURNAL).read_text().splitlines()
    row = json.loads(lines[2])
    row["bucket"] = "x"
    lines[2] = json.dumps(row)
    (tmp_path / "j").mkdir()
    (tmp_path / "j" / JOURNAL).write_text("\n".join(lines) + "\n")
    with pytest.raises(GmtoolError, match=r"record 2 \(line 3\): bucket is \"x\""):
        load_results(tmp_path / "j")
    # blank lines (a journal edited by hand) still count: the line named is the file's
    (tmp_path / "j" / JOURNAL).write_text("\n".join(lines[:2] + ["", "  "] + lines[2:]) + "\n")
    with pytest.raises(GmtoolError, match=r"record 2 \(line 5\): bucket is \"x\""):
        load_results(tmp_path / "j")
    (tmp_path / "j" / JOURNAL).write_text("\n".join(lines[:1] + [""] + ["{nope"] + lines[1:]) + "\n")
    with pytest.raises(GmtoolError, match=r"line 3 is not JSON"):
        load_results(tmp_path / "j")
