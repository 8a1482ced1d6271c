"""gmtool compare on the CPU tape backend: files, JSON schema, exit codes, bad input, the hf-compiled peer."""

from __future__ import annotations

import contextlib
import io
import csv
import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import torch

from gmtool.cli.compare import parse_modes
from gmtool.errors import GmtoolError
from gmtool.records import RECORD_FIELDS, Document, Record
from tests.helpers import html_table_rows, md_table_rows

ROOT = Path(__file__).resolve().parent.parent
FAST = ["--device", "cpu", "--num-iters", "2", "--num-iters-warmup", "1"]
STATUSES = {"ok", "UNSAFE", "error", "oom", "skipped"}
# (bucket, label) of the shared run's compositions in the order run, largest bucket first; 1@40 is another
# decode context than 1*1's
RUN_ROWS = [(2, "1*2"), (2, "1*1"), (1, "1*1"), (1, "1@40")]
BY_BUCKET = sorted(RUN_ROWS, key=lambda bc: bc[0])  # the reports' order: buckets ascending, the run's within
COMPOSITIONS = ["1*1", "1@40", "1*2", "2=1*1"]
TIMING_KEYS = {"median": float, "p90": float, "p99": float, "min": float, "iqr": float, "n": int, "noisy": bool}


def run_cli(*args) -> tuple[int, str, str]:
    """The real entry point in-process (its error handling included): exit code, stdout, stderr."""
    from gmtool.cli.main import main

    out, err, argv = io.StringIO(), io.StringIO(), sys.argv
    sys.argv = ["gmtool", *map(str, args)]
    try:
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            main()
        code = 0
    except SystemExit as e:
        code = e.code or 0
    finally:
        sys.argv = argv
    return code, out.getvalue(), err.getvalue()


def one_error(err: str) -> str:
    """The error message, unwrapped; it must be the only thing said, with no traceback."""
    lines = [ln for ln in err.splitlines() if ln.strip() and not ln.startswith("USDT:")]
    assert "Traceback" not in err
    assert lines and lines[0].startswith("error:"), err
    assert sum(ln.startswith("error:") for ln in lines) == 1, err
    return " ".join(" ".join(lines).split())


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """One compare sweep shared by the tests: two buckets of two compositions each (so every graph is also
    replayed with a batch other than the one it was captured with), a padded mix in bucket 2, traces, JSON on
    stdout."""
    out = tmp_path_factory.mktemp("compare") / "run"
    code, stdout, stderr = run_cli(
        "compare",
        "eager,full,piecewise",
        *FAST,
        "--buckets",
        "1,2",
        "--compositions",
        ",".join(COMPOSITIONS),
        "--trace",
        "--format",
        "json",
        "--out",
        out,
    )
    return {
        "code": code,
        "stdout": stdout,
        "stderr": stderr,
        "out": out,
        "doc": json.loads((out / "results.json").read_text()),
    }


def test_compare_writes_every_file(run):
    """Each file holds the run: 4 compositions x 3 modes in results, 2 buckets x 3 modes in the summary."""
    assert run["code"] == 0, run["stderr"]
    out, modes = run["out"], ("eager", "full", "piecewise")
    records = json.loads((out / "results.json").read_text())["records"]
    assert [(r["mode"], r["bucket"], r["composition"]) for r in records] == [
        (m, b, c) for b, c in RUN_ROWS for m in modes
    ]
    table = pd.read_csv(out / "results.csv")
    assert list(zip(table["mode"], table["bucket"], table["composition"], table["status"])) == [
        (r["mode"], r["bucket"], r["composition"], "ok") for r in records
    ]
    summary = [(b, m, "2", "ok") for b in ("1", "2") for m in modes]  # bucket, mode, mixes, status
    md = (out / "report.md").read_text()
    assert md.startswith("# gmtool compare: tiny-qwen3\n")
    assert [tuple(r[:4]) for r in md_table_rows(md, "Summary (mode x bucket)")] == summary
    assert [r[:2] for r in md_table_rows(md, "Safety per composition")] == [[str(b), f"`{c}`"] for b, c in BY_BUCKET]
    html = (out / "report.html").read_text()
    assert [tuple(r[:4]) for r in html_table_rows(html, "Summary (mode x bucket)")] == summary
    # latency, speedup and distance to the floor (no graph memory on CPU)
    assert html.count('<img src="data:image/png;base64,') == 3
    for mode in modes:
        events = json.loads((out / f"trace-{mode}.json").read_text())["traceEvents"]
        names = {e.get("name", "") for e in events}
        # the largest bucket's steps, and the ops they ran
        assert f"{mode} bucket 2 replay 0" in names and any(n.startswith("aten::") for n in names), mode


def test_json_format_prints_only_the_document(run):
    assert json.loads(run["stdout"]) == run["doc"]


def test_results_json_schema(run):
    doc = run["doc"]
    for key, typ in {
        "schema_version": int,
        "tool": str,
        "command": str,
        "created": str,
        "wall_s": float,
        "machine": dict,
        "model": dict,
        "config": dict,
        "notes": list,
        "errors": list,
        "records": list,
    }.items():
        assert isinstance(doc[key], typ), key
    assert doc["command"] == "compare" and doc["config"]["modes"] == ["eager", "full", "piecewise"]
    assert doc["errors"] == [] and all(r["status"] == "ok" for r in doc["records"])
    assert {"name", "params", "layers"} <= doc["model"].keys()
    assert {"device", "torch", "transformers", "backend"} <= doc["machine"].keys()
    # every mode over every composition: 4 mixes x 3 modes
    assert sorted((r["mode"], r["bucket"], r["composition"]) for r in doc["records"]) == sorted(
        (m, b, c) for m in ("eager", "full", "piecewise") for b, c in RUN_ROWS
    )
    # every graph was captured from a sibling of its bucket's first mix (gmtool.core.batch.sibling_of) and
    # replayed with each mix: no row is checked on the batch its graph was captured from
    for mode in ("full", "piecewise"):
        for bucket in (1, 2):
            rows = [r for r in doc["records"] if r["mode"] == mode and r["bucket"] == bucket]
            first = next(c for b, c in RUN_ROWS if b == bucket)
            assert [r["captured_with"].split(" (")[-1] for r in rows] == [f"sibling of {first})"] * 2, (mode, bucket)
            assert [r["capture_s"] is not None for r in rows] == [True, False], (mode, bucket)
    for r in doc["records"]:
        assert set(RECORD_FIELDS) <= r.keys()
        assert isinstance(r["mode"], str) and isinstance(r["bucket"], int) and isinstance(r["composition"], str)
        assert r["status"] in STATUSES
        if r["status"] == "ok":
            assert isinstance(r["max_rel_err"], float) and r["max_rel_err"] <= r["tolerance"]
            assert isinstance(r["speedup"], float) and isinstance(r["eager_latency_ms"], float)
            for k, typ in TIMING_KEYS.items():
                assert isinstance(r["latency_ms"][k], typ), k
        if r["status"] == "UNSAFE":
            assert r["latency_ms"] is None and r["speedup"] is None
        if r["mode"] != "eager":
            assert isinstance(r["key"], str) and r["key"].startswith("d")


def test_the_ledger_on_the_cpu(run):
    """Each capture row carries the bucket's slice of the persistent inputs; the CPU tape has no pool, no driver
    figures and no cuBLAS workspace: those parts, and so the total, are unknown ('-' in the reports)."""
    doc, md = run["doc"], (run["out"] / "report.md").read_text()
    captured = [r for r in doc["records"] if r["capture_s"] is not None]
    assert len(captured) == 4  # two buckets x full, piecewise
    sizes = {}
    for r in captured:
        assert r["inputs_bytes"] > 0 and r["outside_pool_bytes"] is None and r["workspace_bytes"] is None
        assert r["ledger_total_bytes"] is None and r["kv_tokens_given_up"] is None
        sizes[(r["mode"], r["bucket"])] = r["inputs_bytes"]
    assert sizes[("full", 2)] > sizes[("full", 1)] and sizes[("piecewise", 2)] > sizes[("full", 2)]  # + attn out
    assert (
        doc["model"]["kv_bytes_per_token"]
        == 2 * doc["model"]["layers"] * doc["model"]["kv_heads"] * doc["model"]["head_dim"] * 4
    )  # float32 on the CPU
    rows = md_table_rows(md, "Graph memory ledger")
    assert [(r[0], r[1], r[3], r[7]) for r in rows] == [
        (m, b, "-", "-") for m in ("full", "piecewise") for b in ("1", "2")
    ]
    assert [r[2] for r in rows] == ["d1", "d2"] * 2  # each row names its graph


def test_results_csv(run):
    df = pd.read_csv(run["out"] / "results.csv")
    assert len(df) == len(run["doc"]["records"])
    assert {
        "mode",
        "bucket",
        "composition",
        "status",
        "latency_ms_median",
        "latency_ms_noisy",
        "speedup",
        "max_rel_err",
        "capture_s",
    } <= set(df.columns)
    assert set(df["mode"]) == {"eager", "full", "piecewise"}
    assert (df["latency_ms_median"] > 0).all()
    # counts stay integers where other rows leave them empty (eager rows have no pieces or runners)
    raw = list(csv.DictReader((run["out"] / "results.csv").open()))
    full = next(r for r in raw if r["mode"] == "full")
    assert (full["pieces"], full["runners"], full["latency_ms_n"]) == ("1", "0", str(run["doc"]["config"]["num_iters"]))
    assert next(r for r in raw if r["mode"] == "eager")["pieces"] == ""


def test_traces_are_chrome_traces_of_named_replays(run):
    for mode in ("eager", "full", "piecewise"):
        events = json.loads((run["out"] / f"trace-{mode}.json").read_text())["traceEvents"]
        names = {e.get("name", "") for e in events}
        assert f"{mode} bucket 2 replay 0" in names, mode


def test_report_round_trip(run, tmp_path):
    """gmtool report from results.json alone: the reports show the run's rows, statuses and latencies."""
    code, stdout, stderr = run_cli("report", run["out"], "--out", tmp_path / "again")
    assert code == 0, stderr
    md = (tmp_path / "again" / "report.md").read_text()
    html = (tmp_path / "again" / "report.html").read_text()
    records = run["doc"]["records"]
    for rows in (md_table_rows(md, "Summary (mode x bucket)"), html_table_rows(html, "Summary (mode x bucket)")):
        assert len(rows) == 6  # 2 buckets x 3 modes
        for bucket, mode, mixes, status, replay_ms, *_ in rows:
            mine = [r for r in records if r["mode"] == mode and r["bucket"] == int(bucket)]
            assert (mixes, status) == ("2", "ok")
            # the median of two compositions is their mean
            assert float(replay_ms) == pytest.approx(sum(r["latency_ms"]["median"] for r in mine) / 2, abs=1e-3)
    safety = md_table_rows(md, "Safety per composition")
    assert safety == [[str(b), f"`{c}`", "ok", "ok", "ok"] for b, c in BY_BUCKET]
    assert "## UNSAFE replays\n\nReplays" in md and md.split("## UNSAFE replays", 1)[1].split("## ")[
        0
    ].rstrip().endswith("none")
    # rendered from the JSON, the reports are those the compare run wrote from its records in memory
    for name in ("report.md", "report.html"):
        assert (tmp_path / "again" / name).read_text() == (run["out"] / name).read_text()
    assert "gmtool compare: tiny-qwen3" in stdout and "piecewise" in stdout


def one_ms(fn, iters, warmup, device):
    """time_ms with a stub clock: runs fn as often, says every run took exactly 1 ms."""
    for _ in range(warmup + iters):
        fn()
    return [1.0] * iters


def test_compare_with_baseline(run, tmp_path, monkeypatch):
    """New run timed by a stub clock (1 ms every step); the baseline is the shared run with every latency
    at 2 ms and every error at 0.25: each matched row is 50% faster and 0.25 more accurate."""
    import gmtool.measure.sweep

    monkeypatch.setattr(gmtool.measure.sweep, "time_ms", one_ms)
    old = json.loads(json.dumps(run["doc"]))
    for r in old["records"]:
        if r["latency_ms"]:
            r["latency_ms"]["median"] = 2.0
        r["max_rel_err"], r["tolerance"] = 0.25, 0.5  # ok rows stay within their tolerance
    (tmp_path / "old.json").write_text(json.dumps(old))
    code, stdout, stderr = run_cli(
        "compare",
        "eager,full",
        *FAST,
        "--buckets",
        "1",
        "--compositions",
        "1*1",
        "--format",
        "json",
        "--out",
        tmp_path / "new",
        "--baseline",
        tmp_path / "old.json",
    )
    assert code == 0, stderr
    doc = json.loads(stdout)
    assert doc["baseline"]["matched"] == 2 and doc["baseline"]["unmatched"] == 0
    assert [(r["mode"], r["latency_ms"]["median"]) for r in doc["records"]] == [("eager", 1.0), ("full", 1.0)]
    for r in doc["records"]:
        b = r["baseline"]
        assert (b["status"], b["latency_ms"], b["latency_delta_pct"], b["max_rel_err"]) == ("ok", 2.0, -50.0, 0.25)
        assert b["err_delta"] == pytest.approx(-0.25, abs=1e-4)  # this run's error is ~0 (eager: exactly 0)
    assert [
        (d["mode"], d["bucket"], d["old_replay_ms"], d["replay_delta_pct"]) for d in doc["baseline"]["buckets"]
    ] == [("eager", 1, 2.0, -50.0), ("full", 1, 2.0, -50.0)]
    md = (tmp_path / "new" / "report.md").read_text()
    change = md_table_rows(md, "Change vs baseline")
    assert [r[:7] for r in change] == [[m, "1", "`1*1`", "ok", "1.000", "2.000", "-50.0%"] for m in ("eager", "full")]
    assert change[0][8] == "-2.50e-01"  # eager's error: 0 - 0.25
    assert [r[-1] for r in md_table_rows(md, "Summary (mode x bucket)")] == ["-50.0%", "-50.0%"]
    table = pd.read_csv(tmp_path / "new" / "results.csv")
    assert list(table["baseline_latency_delta_pct"]) == [-50.0, -50.0]
    assert list(table["baseline_latency_ms"]) == [2.0, 2.0]


def test_hf_compiled_on_cpu_is_refused_before_the_sweep(tmp_path):
    out = tmp_path / "peer"
    code, stdout, stderr = run_cli(
        "compare",
        "eager,hf-compiled",
        *FAST,
        "--buckets",
        "1",
        "--compositions",
        "1*1",
        "--format",
        "quiet",
        "--out",
        out,
    )
    assert code == 2 and stdout == ""
    assert "needs CUDA" in one_error(stderr)
    assert not out.exists()


def test_peer_buckets_limit_the_peer():
    """Only the buckets asked for get a peer row (on the CPU each says why it cannot run)."""
    from gmtool.config import SweepConfig
    from gmtool.measure.hf_compiled import HfCompiled
    from gmtool.measure.workbench import Workbench

    cfg = SweepConfig(
        device="cpu", buckets="1,2", compositions="1*1,1*2", modes=("eager",), num_iters=1, num_iters_warmup=0
    )
    rows = [r.to_dict() for r in HfCompiled(Workbench.build(cfg), buckets=[2]).run()]
    assert [r["bucket"] for r in rows] == [2]
    assert rows[0]["status"] == "error" and "needs CUDA" in rows[0]["error"] and rows[0]["latency_ms"] is None


@pytest.mark.parametrize(
    "args, message",
    [
        (["compare", "eager,hf-compiled", "--buckets", "1,2", "--peer-buckets", "4"], "--peer-buckets 4 is not among"),
        (
            ["compare", "eager,hf-compiled", "--buckets", "1", "--peer-compile", "sometimes"],
            "'sometimes' is not one of 'shared', 'per-bucket'",
        ),
        (
            ["compare", "eager,fast"],
            "unknown mode 'fast': choose from eager, full, full-narrow, piecewise, hf-compiled",
        ),
        (["compare", "eager", "--format", "yaml"], "'yaml' is not one of 'human', 'json', 'quiet'"),
    ],
)
def test_bad_arguments(args, message):
    code, _, err = run_cli(*args, *FAST)
    assert code == 2
    assert message in one_error(err)


def test_existing_out_dir_needs_force(tmp_path):
    (tmp_path / "keep.txt").write_text("mine")
    code, _, err = run_cli("compare", "eager", *FAST, "--out", tmp_path)
    assert code == 2
    assert "exists and is not empty: pass --force" in one_error(err)
    assert (tmp_path / "keep.txt").read_text() == "mine"


def test_baseline_of_another_model_is_refused_before_sweeping(tmp_path, run):
    other = json.loads(json.dumps(run["doc"]))
    other["model"]["name"] = "qwen3-8b"
    (tmp_path / "other.json").write_text(json.dumps(other))
    code, _, err = run_cli("compare", "eager", *FAST, "--out", tmp_path / "out", "--baseline", tmp_path / "other.json")
    assert code == 2
    assert "is a run of model 'qwen3-8b'" in one_error(err)
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize(
    "content, message",
    [
        (None, "no results file"),
        ("{not json", "cannot read results file"),
        ('{"tool": "other"}', "is not a gmtool results file"),
    ],
)
def test_unreadable_baseline(tmp_path, content, message):
    path = tmp_path / "old.json"
    if content is not None:
        path.write_text(content)
    code, _, err = run_cli("compare", "eager", *FAST, "--out", tmp_path / "out", "--baseline", path)
    assert code == 2
    said = one_error(err)
    assert said.startswith("error: --baseline:") and message in said


def test_error_as_a_process():
    """No traceback from the installed entry point either, and nothing on stdout."""
    p = subprocess.run(
        [sys.executable, "-m", "gmtool.cli.main", "compare", "eager,warp"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert p.returncode == 2 and p.stdout == ""
    assert "unknown mode 'warp'" in one_error(p.stderr)


def test_parse_modes():
    assert parse_modes("eager, full-narrow,eager,hf-compiled") == ["eager", "full-narrow", "hf-compiled"]
    with pytest.raises(GmtoolError, match="no mode given"):
        parse_modes(" ")
    with pytest.raises(GmtoolError, match="has an empty item"):
        parse_modes(" , ")


@pytest.mark.parametrize(
    "records, code",
    [
        ([("full", "ok", None), ("full-narrow", "UNSAFE", "stale")], 0),
        ([("full", "ok", None), ("piecewise", "UNSAFE", "differs")], 3),
        ([("full", "error", "capture failed"), ("piecewise", "UNSAFE", "differs")], 1),
    ],
)
def test_exit_codes(records, code):
    import typer
    from rich.console import Console

    from gmtool.cli.run_sweep import finish

    doc = Document(
        machine={},
        model={},
        config={},
        records=[Record(mode=m, bucket=8, composition="8*1", status=s, error=e) for m, s, e in records],
    )
    console = Console(file=io.StringIO(), width=200)
    if code == 0:
        finish(doc, console)
    else:
        with pytest.raises(typer.Exit) as exc:
            finish(doc, console)
        assert exc.value.exit_code == code
    said = console.file.getvalue()
    assert ("capture failed" in said) == (code == 1)


def test_errors_alike_but_for_their_numbers_print_once_with_their_count():
    """A too-small KV cache fails every batch with its own block count: one line and how many more alike, while
    another error stays its own line (each is in results.json)."""
    import typer
    from rich.console import Console

    from gmtool.cli.run_sweep import finish

    need = "the batch needs {} KV blocks, the cache has 1: raise --kv-cache-gb or lower --max-kv-len"
    doc = Document(
        machine={},
        model={},
        config={},
        records=[Record(mode="full", bucket=8, composition="8*1", status="error", error="capture failed")],
        errors=[need.format(44), need.format(33), need.format(6)],
    )
    console = Console(file=io.StringIO(), width=400)
    with pytest.raises(typer.Exit):
        finish(doc, console)
    lines = [ln for ln in console.file.getvalue().splitlines() if ln.startswith("error:")]
    assert lines == [
        f"error: {need.format(44)} (and 2 more alike but for their numbers: each is in results.json)",
        "error: full bucket 8 (8*1): capture failed",
    ]


def test_peer_static_cache_matches_gmtool_eager():
    """The hf-compiled peer's inputs: an HF StaticCache holding gmtool's K/V gives gmtool eager's logits
    (uncompiled here; the compiled step is only run on CUDA)."""
    from gmtool.core.compositions import parse_composition
    from gmtool.config import SweepConfig
    from gmtool.measure.hf_compiled import HFDecode, sdpa_copy
    from gmtool.measure.timing import rel_err_per_seq
    from gmtool.measure.workbench import Workbench

    cfg = SweepConfig(device="cpu", buckets="3", compositions="1*3", modes=("eager",), num_iters=1, num_iters_warmup=0)
    bench = Workbench.build(cfg)
    lm, paged, ctx = bench.lm, bench.cache, cfg.max_kv_len // 2
    batch = bench.batch(parse_composition(f"1*3@{ctx}"))
    model = sdpa_copy(lm.model)
    assert lm.model.config._attn_implementation == "gmtool"  # the copy changed, not the workbench's model
    hf = HFDecode(model, paged, batch, ctx, cfg.max_kv_len)
    eager, logits = bench.eager_fn(batch)
    eager()
    with torch.no_grad():
        for _ in range(2):  # rewinding makes every step the same step
            hf.rewind()
            assert rel_err_per_seq(hf.forward(hf.ids, hf.pos), logits) < 1e-5


def test_peer_shared_compile_traces_at_most_twice():
    """--peer-compile shared relies on dynamo compiling the HF step twice (static, then batch-symbolic) and
    reusing the second graph for every later batch size; aot_eager here stands in for Inductor."""
    import torch._dynamo.utils as dyn

    from gmtool.core.compositions import parse_composition
    from gmtool.config import SweepConfig
    from gmtool.measure.hf_compiled import HFDecode, hf_step, sdpa_copy
    from gmtool.measure.timing import rel_err_per_seq
    from gmtool.measure.workbench import Workbench

    cfg = SweepConfig(device="cpu", buckets="1,2,4,8", modes=("eager",), num_iters=1, num_iters_warmup=0)
    bench = Workbench.build(cfg)
    model, ctx = sdpa_copy(bench.lm.model), cfg.max_kv_len // 2
    torch._dynamo.reset()
    dyn.counters.clear()
    compiled = torch.compile(hf_step, backend="aot_eager")
    try:
        with torch.no_grad():
            for b in (1, 2, 4, 8):
                batch = bench.batch(parse_composition(f"1*{b}@{ctx}"))
                hf = HFDecode(model, bench.cache, batch, ctx, cfg.max_kv_len)
                hf.rewind()
                out = compiled(model, hf.ids, hf.pos, hf.kwargs)
                hf.rewind()
                assert rel_err_per_seq(out, hf.forward(hf.ids, hf.pos)) < 1e-5
        assert dyn.counters["stats"]["unique_graphs"] == 2
    finally:
        torch._dynamo.reset()


def test_a_run_without_eager_says_so_in_its_files_too(tmp_path):
    """The note was printed by compare alone: results.json and report.md did not hold it, and capture with a
    profile's modes said nothing."""
    note = "eager is not among the modes: the graph modes get no speedup"
    args = ["--device", "cpu", "--buckets", "1", "--compositions", "1*1", "--num-iters", "1", "--num-iters-warmup", "0"]
    code, stdout, _ = run_cli("compare", "full", *args, "--out", tmp_path / "c")
    assert code == 0 and note in " ".join(stdout.split())
    assert note in json.loads((tmp_path / "c" / "results.json").read_text())["notes"]
    assert note in (tmp_path / "c" / "report.md").read_text()
    profile = tmp_path / "p.json"
    profile.write_text(json.dumps({"modes": ["full"]}))
    code, stdout, _ = run_cli("capture", "--profile", profile, *args, "--out", tmp_path / "k")
    assert code == 0 and note in " ".join(stdout.split())
    code, stdout, _ = run_cli("compare", "eager,full", *args, "--out", tmp_path / "e")
    assert code == 0 and "eager is not among" not in stdout
