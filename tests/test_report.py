"""The report files from a results document: Markdown, HTML with embedded plots, terminal table, baselines,
and `gmtool report`. Documents are built by hand here (no sweep), so every status a renderer meets is covered."""

from __future__ import annotations

import base64
import copy
import statistics
import io
import json
import re

import pytest
from rich.console import Console

from gmtool.report.baseline import attach_baseline
from gmtool.report.html import render_html
from gmtool.report.markdown import render_markdown
from gmtool.report.results import write_reports, write_results
from gmtool.report.tables import baseline_counts, compare_table, noise_warning
from gmtool.records import RECORD_FIELDS, Document
from tests.helpers import html_table_rows
from tests.helpers import md_table_rows as table_rows
from tests.test_compare import one_error, run_cli

PEER_NOTE = "hf-compiled: HF StaticCache + torch.compile, every sequence at context 512"


def timing(median: float, noisy: bool = False) -> dict:
    return {
        "median": median,
        "p90": median * 1.1,
        "p99": median * 1.2,
        "min": median * 0.9,
        "iqr": 0.01,
        "n": 5,
        "noisy": noisy,
    }


def rec(mode, bucket, comp, status="ok", ms=None, eager=None, err=0.0, **kw) -> dict:
    r = dict.fromkeys(RECORD_FIELDS)
    r.update(
        mode=mode,
        bucket=bucket,
        rank=0,
        composition=comp,
        num_tokens=bucket,
        num_seqs=bucket,
        status=status,
        max_rel_err=err,
        tolerance=1e-3,
    )
    if status == "ok" and ms is not None:
        r.update(
            latency_ms=timing(ms, kw.pop("noisy", False)), eager_latency_ms=eager, speedup=eager / ms if eager else None
        )
    r.update(kw)
    return r


def make_doc(model: str = "tiny-qwen3") -> dict:
    records = [
        rec("eager", 8, "1*8", ms=4.0, eager=4.0),
        rec("eager", 8, "1*8", ms=4.2, eager=4.2),
        rec("full", 8, "1*8", ms=1.0, eager=4.0, key="d8", capture_s=0.5, graph_mem_bytes=3 * 2**20),
        rec("full", 8, "1*8", ms=1.1, eager=4.2, key="d8"),
        rec("piecewise", 8, "1*8", ms=2.0, eager=4.0, key="d8", noisy=True, graph_mem_bytes=2**20),
        rec("piecewise", 8, "1*8", ms=2.2, eager=4.2, key="d8"),
        rec("full-narrow", 8, "1*8", "UNSAFE", err=1.5, key="t8", error="stale host metadata frozen at capture"),
        rec("full-narrow", 8, "1*8", ms=1.0, eager=4.2, key="t8"),
        rec("eager", 16, "8*2", ms=9.0, eager=9.0),
        rec("full", 16, "8*2", ms=3.0, eager=9.0, key="t16xs2", graph_mem_bytes=5 * 2**20),
        rec("full", 16, "4*4", "UNSAFE", err=0.8, key="t16xs4", error="replay differs from eager <lambda> | x"),
        rec("piecewise", 16, "8*2", "error", err=None, key="t16", error="capture of bucket t16 failed: boom"),
        rec("hf-compiled", 8, "1*8@512", ms=1.5, eager=4.0, compile_s=12.5, notes=PEER_NOTE),
    ]
    return {
        "schema_version": 1,
        "tool": "gmtool",
        "command": "compare",
        "created": "2026-01-01T00:00:00+00:00",
        "wall_s": 12.0,
        "machine": {
            "device": "cuda",
            "torch": "2.13",
            "transformers": "5.17",
            "python": "3.11",
            "host": "h",
            "backend": "cuda",
            "gpu": "NVIDIA H200",
            "driver": "570",
            "cuda": "12.8",
        },
        "model": {"name": model, "source": "profile", "params": 90496, "layers": 2},
        "config": {
            "model": model,
            "scenario": "mixed",
            "dtype": "bfloat16",
            "bucket_sizes": [8, 16],
            "modes": ["eager", "full", "full-narrow", "piecewise", "hf-compiled"],
            "num_iters": 5,
            "num_iters_warmup": 1,
            "max_kv_len": 1024,
        },
        "notes": ["a run note"],
        "errors": [],
        "records": records,
    }


# make_doc's summary, as every report must show it: (bucket, mode, mixes, status, replay ms) per mode x bucket,
# buckets ascending, modes in the order asked; UNSAFE and error buckets show no latency
SUMMARY = [
    ("8", "eager", "2", "ok", "4.100"),
    ("8", "full", "2", "ok", "1.050"),
    ("8", "full-narrow", "2", "UNSAFE", "-"),
    ("8", "piecewise", "2", "ok", "2.100"),
    ("8", "hf-compiled", "1", "ok", "1.500"),
    ("16", "eager", "1", "ok", "9.000"),
    ("16", "full", "2", "UNSAFE", "-"),
    ("16", "piecewise", "1", "error", "-"),
]


def test_markdown_sections():
    md = render_markdown(make_doc())
    assert md.startswith("# gmtool compare: tiny-qwen3\n")
    assert "NVIDIA H200" in md and "modes eager, full, full-narrow, piecewise, hf-compiled" in md
    summary = {(r[0], r[1]): r for r in table_rows(md, "Summary (mode x bucket)")}
    assert summary[("8", "full")][3:7] == ["ok", "1.050", "4.100", "3.90x"]
    assert summary[("8", "piecewise")][-1] == "yes"  # noisy
    assert summary[("8", "hf-compiled")][9] == "12.5"  # compile s
    unsafe = table_rows(md, "UNSAFE replays")
    assert [(r[0], r[1]) for r in unsafe] == [("full-narrow", "8"), ("full", "16")]
    assert "stale host metadata frozen at capture" in unsafe[0][-1]
    # a pipe in an error must not split the table row, nor its <...> open an HTML tag in a Markdown viewer
    assert "\\<lambda\\> \\| x" in unsafe[1][-1]
    problems = table_rows(md, "Errors and skipped rows")
    assert problems == [["piecewise", "16", "`8*2`", "error", "capture of bucket t16 failed: boom"]]
    safety = table_rows(md, "Safety per composition")
    assert safety[0] == ["8", "`1*8 #1`", "ok", "ok", "**UNSAFE**", "ok", "-"]
    assert safety[1] == ["8", "`1*8 #2`", "ok", "ok", "ok", "ok", "-"]
    assert ["16", "`4*4`", "-", "**UNSAFE**", "-", "-", "-"] in safety
    assert ["8", "`1*8@512`", "-", "-", "-", "-", "ok"] in safety
    assert f"- {PEER_NOTE}" in md and "- a run note" in md


def test_unsafe_buckets_show_no_latency_or_speedup_anywhere():
    """Bucket 16 of full is UNSAFE for 4*4 though 8*2 was fine: no renderer may show its 3.0 ms."""
    doc = make_doc()
    md = render_markdown(doc)
    row = {(r[0], r[1]): r for r in table_rows(md, "Summary (mode x bucket)")}[("16", "full")]
    assert row[3] == "**UNSAFE**" and row[4] == "-" and row[6] == "-"
    console = Console(file=io.StringIO(), width=250)
    console.print(compare_table(doc))
    line = next(ln for ln in console.file.getvalue().splitlines() if "UNSAFE" in ln and " 16 " in ln)
    assert "3.000" not in line and "x" not in line.split("│")[6]
    html = render_html(doc)
    tr = next(t for t in html.split("<tr>") if "<td>16</td>" in t and ">full<" in t and "UNSAFE" in t)
    assert "3.000" not in tr


def test_html_is_self_contained_with_png_plots():
    html = render_html(make_doc())
    uris = re.findall(r'<img src="data:image/png;base64,([A-Za-z0-9+/=]+)"', html)
    assert len(uris) == 3  # latency, speedup, graph memory
    for u in uris:
        assert base64.b64decode(u)[:8] == b"\x89PNG\r\n\x1a\n"
    assert not re.search(r'(src|href)="(?!data:)', html)  # nothing fetched from elsewhere
    assert "&lt;lambda&gt;" in html and "<lambda>" not in html
    assert 'class="text s-UNSAFE"' in html


def test_html_without_graph_memory_says_so():
    doc = make_doc()
    for r in doc["records"]:
        r["graph_mem_bytes"] = None
    html = render_html(doc)
    assert html.count("data:image/png;base64,") == 2
    assert "Graph memory per mode: no figures for it in this run." in html


def test_noise_warning_in_terminal_table():
    doc = make_doc()
    assert "1 of 10 timings are noisy" in noise_warning(doc)
    console = Console(file=io.StringIO(), width=250)
    console.print(compare_table(doc))
    assert "2.100!" in console.file.getvalue()
    for r in doc["records"]:
        if r["latency_ms"]:
            r["latency_ms"]["noisy"] = False
    assert noise_warning(doc) is None


def test_baseline_matches_rows_by_occurrence():
    """The two '1*8' mixes of bucket 8 are told apart by their order, not conflated."""
    new, old = make_doc(), make_doc()
    for r in old["records"]:
        if r["latency_ms"]:
            r["latency_ms"]["median"] *= 2
        if r["max_rel_err"] is not None:
            r["max_rel_err"] += 0.25
            r["tolerance"] = 2.0  # an ok row's error is within its tolerance (a file saying otherwise is refused)
    old["records"] = old["records"][:-1]  # the peer is new in this run
    old["records"][0]["status"] = "error"  # ... and one row that failed then is ok now
    doc = Document.from_dict(new)
    attach_baseline(doc, Document.from_dict(old), "old/results.json")
    new = doc.to_dict()
    b = new["baseline"]
    assert (b["matched"], b["unmatched"], b["path"]) == (len(new["records"]) - 1, 1, "old/results.json")
    assert b["status_changed"] == 1 and "; 1 matched row changed status" in render_markdown(new)
    full = [r for r in new["records"] if r["mode"] == "full" and r["bucket"] == 8]
    assert [r["baseline"]["latency_ms"] for r in full] == [2.0, 2.2]
    assert all(r["baseline"]["latency_delta_pct"] == pytest.approx(-50.0) for r in full)
    assert all(r["baseline"]["err_delta"] == pytest.approx(-0.25) for r in full)
    assert new["records"][-1]["baseline"] is None
    unsafe = next(r for r in new["records"] if r["status"] == "UNSAFE")
    assert unsafe["baseline"]["latency_delta_pct"] is None
    buckets = {(d["mode"], d["bucket"]): d for d in b["buckets"]}
    assert buckets[("full", 8)]["replay_delta_pct"] == pytest.approx(-50.0)
    assert buckets[("full", 16)]["replay_delta_pct"] is None  # UNSAFE: no latency to compare


def test_a_label_run_another_number_of_times_in_the_baseline_is_not_paired_by_order():
    """The baseline lost the first of bucket 8's two '1*8' mixes: its second would pair with this run's first
    by order, another mix. Those rows stay unpaired; the rest pair as before."""
    new, old = make_doc(), make_doc()
    first = next(i for i, r in enumerate(old["records"]) if r["mode"] == "full" and r["composition"] == "1*8")
    del old["records"][first]
    doc = Document.from_dict(new)
    attach_baseline(doc, Document.from_dict(old), "old/results.json")
    rows = doc.to_dict()["records"]
    twice = [r for r in rows if r["mode"] == "full" and r["composition"] == "1*8"]
    assert len(twice) == 2 and all(r["baseline"] is None for r in twice)
    assert doc.baseline["matched"] == len(rows) - 2, doc.baseline


def test_a_baseline_of_other_kernels_or_kv_layout_says_so():
    new, old = make_doc(), make_doc()
    new["config"].update(fuse=False, block_size=16, piecewise_impl="breakable")
    old["config"].update(fuse=True, block_size=32, piecewise_impl="fx")
    doc = Document.from_dict(new)
    attach_baseline(doc, Document.from_dict(old), "old/results.json")
    said = " ".join(doc.baseline["differs"])
    assert "fuse True then" in said and "block_size 32 then" in said and "piecewise_impl fx then" in said, said


def test_baseline_joins_each_tp_rank_and_counts_rows_only_in_the_baseline():
    """A TP=2 run against a TP=1 baseline: every rank's '1*8' mixes join the baseline's own (not rank 1's as a
    third and fourth '1*8'); the baseline's rows this run did not measure are counted and said."""
    new, old = make_doc(), make_doc()
    for r in old["records"]:
        if r["latency_ms"]:
            r["latency_ms"]["median"] *= 2
    new["records"] = [r for r in new["records"] if r["bucket"] != 16]  # this run measured fewer rows
    new["records"] += [dict(copy.deepcopy(r), rank=1) for r in new["records"]]
    doc = Document.from_dict(new)
    attach_baseline(doc, Document.from_dict(old), "old/results.json")
    got = doc.to_dict()
    b = got["baseline"]
    assert (b["matched"], b["unmatched"]) == (len(got["records"]), 0)
    assert b["only_in_baseline"] == sum(1 for r in old["records"] if r["bucket"] == 16)
    full8 = [r for r in got["records"] if r["mode"] == "full" and r["bucket"] == 8]
    assert [(r["rank"], r["baseline"]["latency_ms"]) for r in full8] == [(0, 2.0), (0, 2.2), (1, 2.0), (1, 2.2)]
    md = render_markdown(got)
    assert f"{b['only_in_baseline']} only in the baseline" in md
    rows = table_rows(md, "Change vs baseline")
    assert ["full (rank 1)", "8", "`1*8 #2`", "ok", "1.100", "2.200", "-50.0%"] in [r[:7] for r in rows]


@pytest.fixture
def results_dir(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    write_results(d, Document.from_dict(make_doc()))
    return d


def test_report_renders_in_place(results_dir):
    """The files `gmtool report` writes from results.json hold make_doc's rows: the summary, the UNSAFE and
    failed rows, one safety row per composition."""
    code, out, err = run_cli("report", results_dir)
    assert code == 1, err  # as the run ended: a row failed (piecewise bucket 16)
    assert "capture of bucket t16 failed: boom" in " ".join((out + err).split())
    md = (results_dir / "report.md").read_text()
    html = (results_dir / "report.html").read_text()
    assert md.startswith("# gmtool compare: tiny-qwen3\n") and "<title>gmtool compare: tiny-qwen3</title>" in html
    for rows in (table_rows(md, "Summary (mode x bucket)"), html_table_rows(html, "Summary (mode x bucket)")):
        assert [(r[0], r[1], r[2], r[3].strip("*"), r[4]) for r in rows] == SUMMARY
        assert {(r[0], r[1]): r[6] for r in rows}[("8", "full")] == "3.90x"  # 4.1 / 1.05
    for rows in (table_rows(md, "UNSAFE replays"), html_table_rows(html, "UNSAFE replays")):
        assert [(r[0], r[1], r[4]) for r in rows] == [("full-narrow", "8", "1.50e+00"), ("full", "16", "8.00e-01")]
    for rows in (table_rows(md, "Errors and skipped rows"), html_table_rows(html, "Errors and skipped rows")):
        assert [(r[0], r[1], r[3]) for r in rows] == [("piecewise", "16", "error")]
    assert len(table_rows(md, "Safety per composition")) == len(html_table_rows(html, "Safety per composition")) == 5
    assert "gmtool compare: tiny-qwen3 on NVIDIA H200" in out


def test_report_with_baseline(results_dir, tmp_path):
    old = make_doc()
    for r in old["records"]:
        if r["latency_ms"]:
            r["latency_ms"]["median"] *= 4
    (tmp_path / "old.json").write_text(json.dumps(old))
    code, out, err = run_cli(
        "report", results_dir / "results.json", "--baseline", tmp_path / "old.json", "--out", tmp_path / "with-baseline"
    )
    assert code == 1, err  # make_doc's failed row
    md = (tmp_path / "with-baseline" / "report.md").read_text()
    rows = table_rows(md, "Change vs baseline")
    # bucket 8 runs two '1*8' mixes: each row says which, as the safety section does
    assert ["full", "8", "`1*8 #1`", "ok", "1.000", "4.000", "-75.0%", "0.00e+00", "+0.00e+00"] in rows
    assert ["full", "8", "`1*8 #2`", "ok", "1.100", "4.400", "-75.0%", "0.00e+00", "+0.00e+00"] in rows
    assert "vs baseline" in out and "-75.0%" in out
    assert f"baseline {tmp_path / 'old.json'}: {len(old['records'])} rows matched, 0 new" in " ".join(out.split())
    assert not (results_dir / "report.md").exists()  # --out elsewhere leaves the run's directory alone


def test_report_refuses_baseline_of_another_model(results_dir, tmp_path):
    write_results(tmp_path, Document.from_dict(make_doc(model="llama-3.1-8b")))
    code, _, err = run_cli("report", results_dir, "--baseline", tmp_path)
    assert code == 2
    assert "--baseline is a run of model 'llama-3.1-8b'" in one_error(err)
    # two checkpoint folders of one name and parameter count, of other shapes: a name is only a folder's name
    other = make_doc()
    other["model"]["layers"] = 3
    (tmp_path / "o").mkdir()
    write_results(tmp_path / "o", Document.from_dict(other))
    code, _, err = run_cli("report", results_dir, "--baseline", tmp_path / "o")
    assert code == 2 and "another model named 'tiny-qwen3' (layers 3 then, 2 now)" in one_error(err), err


def test_report_refuses_unreadable_files(results_dir, tmp_path):
    (tmp_path / "bad.json").write_bytes(b"\xff\xfe not json")
    code, _, err = run_cli("report", results_dir, "--baseline", tmp_path / "bad.json")
    assert code == 2 and "--baseline: cannot read results file" in one_error(err)
    code, _, err = run_cli("report", tmp_path / "nowhere")
    assert code == 2 and "no results file at" in one_error(err)


def test_report_out_dir_needs_force(results_dir, tmp_path):
    other = tmp_path / "other"
    other.mkdir()
    (other / "x").write_text("x")
    code, _, err = run_cli("report", results_dir, "--out", other)
    assert code == 2 and "pass --force" in one_error(err)
    assert run_cli("report", results_dir, "--out", other, "--force")[0] == 1  # make_doc's failed row
    assert len(table_rows((other / "report.md").read_text(), "Summary (mode x bucket)")) == len(SUMMARY)


def test_report_never_clears_another_run_s_results(results_dir, tmp_path):
    """--force clears what an older gmtool run wrote; report writes two report files only, and another run's
    results there would be deleted for them (or left beside a report of another run): refused, files kept."""
    other = tmp_path / "run-b"
    other.mkdir()
    for name in ("results.json", "results.csv", "report.md"):
        (other / name).write_text("run b")
    code, _, err = run_cli("report", results_dir, "--out", other, "--force")
    assert code == 2 and "holds another run's files (results.csv, results.json)" in one_error(err), err
    assert sorted(p.name for p in other.iterdir()) == ["report.md", "results.csv", "results.json"]
    assert (other / "results.json").read_text() == "run b"


def test_write_reports_from_a_copy_is_deterministic(tmp_path):
    doc = Document.from_dict(make_doc())
    a, b = tmp_path / "a", tmp_path / "b"
    a.mkdir(), b.mkdir()
    write_reports(a, doc)
    write_reports(b, copy.deepcopy(doc))
    assert (a / "report.html").read_bytes() == (b / "report.html").read_bytes()


def test_ledger_in_markdown_html_and_the_terminal():
    """The ledger of each captured bucket (the rows carrying capture_s), '-' where a part was not measured."""
    from gmtool.report.ledger import ledger_table

    doc = make_doc()
    full8 = next(r for r in doc["records"] if r["mode"] == "full" and r.get("capture_s"))
    full8.update(
        pool_growth_bytes=4 * 2**20,
        outside_pool_bytes=2**20,
        inputs_bytes=2048,
        workspace_bytes=32 * 2**20,
        ledger_total_bytes=37 * 2**20 + 2048,
        kv_tokens_given_up=338,
    )
    doc["records"].append(
        rec("piecewise", 16, "8*2", ms=2.0, eager=9.0, key="t16", capture_s=0.1, inputs_bytes=4096)
    )  # a CPU-like capture: no pool, no driver figures
    want = [
        ["full", "8", full8["key"], "4.0 MiB", "1.0 MiB", "2.0 KiB", "32.0 MiB", "37.0 MiB", "338"],
        ["piecewise", "16", "t16", "-", "-", "4.0 KiB", "-", "-", "-"],
    ]
    assert table_rows(render_markdown(doc), "Graph memory ledger") == want
    assert html_table_rows(render_html(doc), "Graph memory ledger") == want
    con = Console(width=100, record=True, file=io.StringIO())
    con.print(ledger_table(doc))
    text = con.export_text()
    assert "graph memory ledger" in text and "37.0 MiB" in text and "KV tokens" in text
    narrow = Console(width=60, record=True, file=io.StringIO())
    narrow.print(ledger_table(doc))
    text = narrow.export_text()
    assert max(map(len, text.splitlines())) <= 60 and "37.0 MiB" in text and "338" in text
    assert "not shown at 60 columns: " in " ".join(text.split())  # the parts go first, the total stays
    doc["records"] = [r for r in doc["records"] if not r.get("capture_s")]
    assert ledger_table(doc) is None
    assert "no graph was captured" in render_markdown(doc)


def test_ledger_names_each_graph_of_a_bucket_in_the_modes_asked_order():
    """Prefill full graphs are keyed by tokens x sequences: one bucket holds several graphs, each its own ledger
    row. Without the key those rows read as one row repeated; and the modes come as the summary shows them."""
    doc = make_doc()
    doc["config"]["modes"] = ["eager", "piecewise", "full"]
    doc["records"] = [
        rec("full", 16, "8*2", ms=3.0, eager=9.0, key="t16xs2", capture_s=0.1, inputs_bytes=3000),
        rec("full", 16, "4*4", ms=3.0, eager=9.0, key="t16xs4", capture_s=0.1, inputs_bytes=5000),
        rec("piecewise", 16, "8*2", ms=2.0, eager=9.0, key="t16", capture_s=0.1, inputs_bytes=4096),
    ]
    rows = table_rows(render_markdown(doc), "Graph memory ledger")
    assert [r[:3] for r in rows] == [["piecewise", "16", "t16"], ["full", "16", "t16xs2"], ["full", "16", "t16xs4"]]
    assert html_table_rows(render_html(doc), "Graph memory ledger") == rows


def test_the_terminal_compare_table_says_what_served_auto():
    """auto's rows are served by full graphs, piecewise ones or eager per batch: the terminal says which, as
    report.md does; a run without auto keeps the column out."""
    doc = make_doc()
    doc["config"]["modes"] = ["eager", "full", "auto"]
    doc["records"] = [
        rec("eager", 16, "1*16", ms=4.0, eager=4.0, served_by="eager"),
        rec("full", 16, "1*16", ms=1.0, eager=4.0, served_by="full"),
        rec("auto", 16, "1*16", ms=1.0, eager=4.0, served_by="full"),
        rec("auto", 16, "8*2", ms=2.0, eager=4.0, served_by="piecewise"),
    ]
    con = Console(width=160, record=True, file=io.StringIO())
    con.print(compare_table(doc))
    text = con.export_text()
    auto = next(line for line in text.splitlines() if " auto " in line)
    assert "served by" in text and "full/piecewise" in auto
    doc["config"]["modes"] = ["eager", "full"]
    doc["records"] = doc["records"][:2]
    con = Console(width=160, record=True, file=io.StringIO())
    con.print(compare_table(doc))
    assert "served by" not in con.export_text()


def test_the_ledger_has_a_rank_column_under_tp():
    """--tp: every rank captures its own graphs, so the ledger has a row per rank and says which; without a
    rank column the two ranks' rows read as the same bucket twice."""
    from gmtool.report.ledger import ledger_table, records_ledger_cells

    def rec(rank, pool):
        return {
            "mode": "full",
            "bucket": 4,
            "key": "d4",
            "rank": rank,
            "capture_s": 0.1,
            "pool_growth_bytes": pool,
            "outside_pool_bytes": 0,
            "inputs_bytes": 0,
            "workspace_bytes": 0,
            "ledger_total_bytes": pool,
            "kv_tokens_given_up": 1,
        }

    doc = {"config": {"tp": 2, "modes": ["full"]}, "records": [rec(1, 2048), rec(0, 1024)]}
    headers, cells = records_ledger_cells(doc)
    assert headers[:3] == ["mode", "bucket", "rank"]
    assert [(c[2], c[4]) for c in cells] == [("0", "1.0 KiB"), ("1", "2.0 KiB")]
    assert [c.header for c in ledger_table(doc).columns][:3] == ["mode", "bucket", "rank"]
    one = {"config": {"tp": 1, "modes": ["full"]}, "records": [rec(0, 1024)]}
    assert "rank" not in records_ledger_cells(one)[0]


def test_a_tp_run_s_rank_rows_each_get_their_own_change_and_capture_seconds_are_not_summed_over_ranks():
    """Under --tp the terminal summary has a row per rank; its 'vs baseline' was the ranks pooled, the same on
    both rows. Each rank now meets the baseline's same rank; report.md's pooled row keeps the pooled change, and
    its capture seconds are the slowest rank's (the ranks capture side by side), not their sum."""
    from gmtool.report.summary import bucket_summary
    from gmtool.report.tables import compare_table

    def two_ranks(doc, slow0, slow1):
        base = [r for r in doc["records"] if r["mode"] in ("eager", "full") and r["bucket"] == 8]
        doc["records"], doc["config"]["tp"] = [], 2
        for rank, slow in ((0, slow0), (1, slow1)):
            for r in copy.deepcopy(base):
                if r["latency_ms"]:
                    r["latency_ms"]["median"] *= slow
                doc["records"].append(dict(r, rank=rank))
        return doc

    new, old = two_ranks(make_doc(), 2.0, 2.0), two_ranks(make_doc(), 1.0, 2.0)
    doc = Document.from_dict(new)
    attach_baseline(doc, Document.from_dict(old), "old/results.json")
    got = doc.to_dict()
    delta = {(d["mode"], d["rank"]): d["replay_delta_pct"] for d in got["baseline"]["buckets"]}
    assert delta[("full", 0)] == pytest.approx(100.0) and delta[("full", 1)] == pytest.approx(0.0)
    assert delta[("full", None)] == pytest.approx(100 * (2.1 / statistics.median([1.0, 1.1, 2.0, 2.2]) - 1))
    t = compare_table(got)
    col = [c.header for c in t.columns].index("vs baseline")
    full = [row for row in t.rows if row and row[0] == "full" or row and "full" in row[:2]]
    assert sorted(row[col] for row in full) == ["+0.0%", "+100.0%"], full
    pooled = next(s for s in bucket_summary(got["records"]) if s["mode"] == "full")
    assert pooled["capture_s"] == 0.5  # each rank's 0.5 s, side by side
    # report.md as the terminal: a row per rank with its own median and change, not a pooled median no rank had
    summary = table_rows(render_markdown(got), "Summary (mode x bucket)")
    full_rows = {r[2]: r for r in summary if r[1] == "full"}
    assert sorted(full_rows) == ["0", "1"] and full_rows["0"][-1] == "+100.0%" and full_rows["1"][-1] == "+0.0%"
    assert full_rows["0"][5] == full_rows["1"][5] == "2.100"  # each rank's median of its two mixes, x2


def test_a_rank_row_without_its_own_change_shows_the_pooled_one():
    """A --tp document whose baseline entries carry no rank (attached to one rank's partial rows, or written by an
    older gmtool) left the per-rank 'vs baseline' column empty."""
    from gmtool.report.tables import compare_table

    doc = make_doc()
    doc["config"]["tp"] = 2
    doc["records"] = [dict(r, rank=0) for r in doc["records"] if r["mode"] == "full" and r["bucket"] == 8]
    doc["baseline"] = {"buckets": [{"mode": "full", "bucket": 8, "replay_delta_pct": 12.5}]}
    t = compare_table(doc)
    col = [c.header for c in t.columns].index("vs baseline")
    assert [row[col] for row in t.rows if row] == ["+12.5%"]


def test_a_row_another_path_served_than_in_the_baseline_is_counted():
    """auto's row 40 was a piecewise replay in the baseline (40 a bucket there) and an eager step now: the change
    in latency compared the two without a word."""
    new, old = make_doc(), make_doc()
    for doc, path in ((old, "piecewise"), (new, "eager")):
        doc["records"].append(rec("auto", 40, "40", ms=3.0, eager=3.0, key="t40"))
        doc["records"][-1]["served_by"] = path
    doc = Document.from_dict(new)
    attach_baseline(doc, Document.from_dict(old), "old/results.json")
    got = doc.to_dict()
    assert got["baseline"]["served_by_changed"] == 1
    assert got["records"][-1]["baseline"]["served_by"] == "piecewise"
    assert "1 served by another path than in the baseline (served_by)" in baseline_counts(got["baseline"])


def test_a_model_name_with_markdown_marks_is_shown_as_written():
    """A checkpoint folder named with Markdown's marks left an unclosed backtick and emphasis in the title."""
    doc = make_doc(model="mod`el *q|u*_x")
    assert render_markdown(doc).startswith("# gmtool compare: mod\\`el \\*q\\|u\\*\\_x\n")
    overview = next(ln for ln in render_markdown(doc).splitlines() if ln.startswith("- **model**"))
    assert "mod\\`el \\*q\\|u\\*\\_x" in overview  # the overview line too, not only the title


def test_a_partial_run_says_so_before_its_tables():
    """A run stopped early said so only in its Notes, below tables that read as the whole sweep."""
    doc = make_doc()
    doc["partial"] = {"reason": "interrupted", "measured": 3, "planned": 12, "unit": "rows"}
    md = render_markdown(doc)
    first = md.split("\n## ")[0]
    assert "- **PARTIAL RUN**: interrupted after 3 of 12 rows" in first, first
    assert "<li><b>PARTIAL RUN</b>: interrupted after 3 of 12 rows" in render_html(doc)
    assert "PARTIAL" not in render_markdown(make_doc())


def test_a_tp_runs_plots_show_the_slowest_rank_not_a_pooled_median():
    from gmtool.report.plots import _series

    doc = make_doc()
    doc["config"]["tp"] = 2
    doc["records"] = [dict(r, rank=rank) for rank in (0, 1) for r in copy.deepcopy(doc["records"])]
    for r in doc["records"]:
        if r["rank"] == 1 and r.get("latency_ms"):
            r["latency_ms"]["median"] *= 3
    mine = dict(zip(*_series(doc, "replay_ms")["full"]))
    one = {s["bucket"]: s["replay_ms"] for s in bucket_summary_of(doc, rank=1) if s["mode"] == "full"}
    assert mine == {b: v for b, v in one.items() if v is not None}


def bucket_summary_of(doc, rank):
    from gmtool.report.summary import bucket_summary

    return bucket_summary([r for r in doc["records"] if r["rank"] == rank])


def test_a_partial_tp_baseline_without_a_rank_pairs_none_of_that_ranks_rows():
    """A --tp baseline that stopped before rank 1's rows were gathered holds rank 0's alone: rank 1's rows were
    paired with rank 0's, a change between two ranks. A TP=1 baseline still stands for every rank."""

    def ranked(ranks, tp):
        doc = make_doc()
        doc["config"]["tp"] = tp
        doc["records"] = [dict(r, rank=k) for k in ranks for r in copy.deepcopy(doc["records"])]
        return doc

    new = Document.from_dict(ranked((0, 1), 2))
    attach_baseline(new, Document.from_dict(ranked((0,), 2)), "old/results.json")
    paired = {(r.rank, r.baseline is not None) for r in new.records}
    assert paired == {(0, True), (1, False)}
    one = make_doc()
    new = Document.from_dict(ranked((0, 1), 2))
    attach_baseline(new, Document.from_dict(one), "old/results.json")
    assert all(r.baseline is not None for r in new.records)
