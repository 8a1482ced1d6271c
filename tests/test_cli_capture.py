import csv
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from gmtool.cli.main import app
from gmtool.config import SweepConfig
from gmtool.errors import GmtoolError
from gmtool.measure.sweep import Sweep

runner = CliRunner()


def gm(*args):
    """Run the real entry point in a subprocess: exit code, stdout, stderr as a user sees them."""
    p = subprocess.run([sys.executable, "-m", "gmtool.cli.main", *args], capture_output=True, text=True, timeout=300)
    return p.returncode, p.stdout, p.stderr


def test_capture_prints_what_it_did_not_apply_once(tmp_path):
    """An option the run could not apply is said on the terminal, not only in results.json's notes (--pdl on the
    CPU: the fused layers run torch ops there), beside the fused layers' check against the model's own; a note
    the command printed before the run is not printed again."""
    code, stdout, stderr = gm(
        *("capture", "--device", "cpu", "--buckets", "1", "--num-iters", "1", "--num-iters-warmup", "0"),
        *("--fuse", "--small-m-gemm", "--pdl", "--out", str(tmp_path / "run")),
    )
    assert code == 0, stderr
    notes = [line for line in stdout.splitlines() if line.startswith("note: ")]
    doc = json.loads((tmp_path / "run" / "results.json").read_text())
    assert any(n.startswith("--pdl: off") for n in doc["notes"])
    assert any(n.startswith("note: --pdl: off") for n in notes), notes
    assert any(n.startswith("note: --small-m-gemm: off, the fused layers run torch ops here") for n in notes), notes
    assert any(n.startswith("note: --fuse against the model's own layers") for n in notes), notes
    assert sum("no CUDA here" in n for n in notes) == 1, notes


def test_capture_on_cpu_writes_results(tmp_path):
    out = tmp_path / "run"
    code, stdout, stderr = gm(
        "capture",
        "--device",
        "cpu",
        "--buckets",
        "1,2,4",
        "--num-iters",
        "2",
        "--num-iters-warmup",
        "1",
        "--out",
        str(out),
    )
    assert code == 0, stderr
    assert "CPU tape backend" in stdout and "max rel err" in stdout
    assert "note: capture cost, full: 3 graphs captured in " in stdout  # also in the terminal
    doc = json.loads((out / "results.json").read_text())
    graph_rows = [r for r in doc["records"] if r["mode"] == "full"]
    assert {r["bucket"] for r in graph_rows} == {1, 2, 4}
    assert len(graph_rows) >= 9 and all(r["status"] == "ok" for r in graph_rows)
    assert all(r["max_rel_err"] < 1e-4 for r in graph_rows)
    # host time: from an idle device, copy-in alone, and issued behind the previous step
    assert all(
        r[f]["n"] >= 5 and r[f]["median"] > 0 for r in graph_rows for f in ("host_us", "host_copy_us", "host_steady_us")
    )
    assert doc["machine"]["backend"] == "cpu-tape"
    # results.csv: one row per record of results.json, in the same order, with the same values
    with (out / "results.csv").open() as f:
        table = list(csv.DictReader(f))
    assert {
        "mode",
        "bucket",
        "composition",
        "status",
        "max_rel_err",
        "latency_ms_median",
        "host_steady_us_median",
    } <= set(table[0])
    assert [(t["mode"], int(t["bucket"]), t["composition"], t["status"]) for t in table] == [
        (r["mode"], r["bucket"], r["composition"], r["status"]) for r in doc["records"]
    ]
    for t, r in zip(table, doc["records"]):
        assert float(t["max_rel_err"]) == pytest.approx(r["max_rel_err"], rel=1e-6, abs=1e-12)
        assert float(t["latency_ms_median"]) == pytest.approx(r["latency_ms"]["median"], rel=1e-6)


def test_capture_piecewise_prefill_reports_pieces(tmp_path):
    out = tmp_path / "pw"
    code, stdout, stderr = gm(
        "capture",
        "--device",
        "cpu",
        "--scenario",
        "prefill",
        "--mode",
        "piecewise",
        "--buckets",
        "32",
        "--compositions",
        "16+16,8*4,20+12@40",
        "--num-iters",
        "2",
        "--out",
        str(out),
    )
    assert code == 0, stderr
    rows = [r for r in json.loads((out / "results.json").read_text())["records"] if r["mode"] == "piecewise"]
    assert [r["composition"] for r in rows] == ["16+16", "8*4", "20+12@40"]
    assert all(r["pieces"] == 3 and r["runners"] == 2 and r["status"] == "ok" for r in rows)


def test_narrow_full_graph_for_prefill_is_reported_unsafe(tmp_path):
    out = tmp_path / "narrow"
    """Captured with 16+16, replayed with 8*4: the graph froze the capture's plan. The row is UNSAFE because
    the stale plan was detected, and the replay's numbers are wrong too; exit 0, since full-narrow's UNSAFE
    rows are the finding it exists to show (run_sweep.finish)."""
    code, stdout, stderr = gm(
        "capture",
        "--device",
        "cpu",
        "--scenario",
        "prefill",
        "--mode",
        "full-narrow",
        "--buckets",
        "32",
        "--compositions",
        "16+16,8*4",
        "--num-iters",
        "2",
        "--out",
        str(out),
    )
    assert code == 0, stderr
    rows = [r for r in json.loads((out / "results.json").read_text())["records"] if r["mode"] == "full-narrow"]
    assert [(r["composition"], r["status"]) for r in rows] == [("16+16", "ok"), ("8*4", "UNSAFE")]
    ok, bad = rows
    assert ok["stale_metadata"] is False and ok["max_rel_err"] < 1e-4 and ok["captured_with"] == "16+16"
    # the reason: stale metadata detected, not only a numeric difference
    assert bad["stale_metadata"] is True and bad["captured_with"] == "16+16"
    assert bad["error"].startswith("stale host metadata frozen at capture"), bad["error"]
    # and the numbers confirm it: far outside both tolerances
    assert bad["max_rel_err"] > 1e-2 and bad["max_rel_err_same_shape"] > 1e-2
    assert bad["latency_ms"] is None and bad["speedup"] is None
    assert "UNSAFE" in stdout
    # the bucket's eager figure is over both mixes, the unsafe one's included, as the eager rows' own is
    doc = json.loads((out / "results.json").read_text())
    eager = {r["composition"]: r["latency_ms"]["median"] for r in doc["records"] if r["mode"] == "eager"}
    assert [r["eager_latency_ms"] for r in rows] == [eager["16+16"], eager["8*4"]]


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--model", "no-such-model"], "unknown model 'no-such-model'"),
        (["--buckets", "1,,2"], "malformed bucket"),
        (["--buckets", ""], "empty bucket list"),
        (["--buckets", "8,a"], "malformed bucket item"),
        (["--buckets", "8,512", "--max-tokens", "256"], "--max-tokens 256 is below bucket 512"),
        (["--compositions", "8=4+8"], "more than its bucket"),
        (["--compositions", "0*3"], "must be > 0"),
        (["--buckets", "8", "--compositions", "4@200", "--max-kv-len", "128"], "exceeds --max-kv-len"),
        (["--scenario", "sideways"], "is not one of"),
        (["--mode", "fastest"], "unknown mode"),
        (["--dtype", "int3"], "unknown dtype"),
    ],
)
def test_bad_input_is_one_line_error(args, msg, tmp_path):
    code, stdout, stderr = gm("capture", "--device", "cpu", "--out", str(tmp_path / "x"), *args)
    assert code != 0
    assert msg in stderr, stderr
    assert "Traceback" not in stderr + stdout


def test_sliding_window_shorter_than_the_context_runs(tmp_path):
    """gmtool's attention follows the model's window: --max-kv-len past it is allowed, and the run's notes say
    what the model's attention does (tests/test_architectures.py holds the window against transformers' own)."""
    cfg = json.loads((Path(__file__).parents[1] / "profiles/models/tiny-llama.json").read_text())["config"]
    cfg.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=64)
    cfg.pop("rope_scaling")
    path = tmp_path / "config.json"
    path.write_text(json.dumps(cfg))
    code, stdout, stderr = gm(
        "capture",
        "--device",
        "cpu",
        "--model",
        str(path),
        "--max-kv-len",
        "160",
        "--buckets",
        "4",
        "--compositions",
        "1*4@120",
        "--num-iters",
        "1",
        "--num-iters-warmup",
        "0",
        "--out",
        str(tmp_path / "x"),
    )
    assert code == 0, stderr
    doc = json.loads((tmp_path / "x" / "results.json").read_text())
    assert "attention: sliding window 64 on every layer" in doc["notes"]
    assert all(r["status"] == "ok" for r in doc["records"])


def test_unknown_model_lists_profiles(tmp_path):
    code, _, stderr = gm("capture", "--model", "nope", "--device", "cpu", "--out", str(tmp_path / "y"))
    assert code == 2 and "qwen3-0.6b" in stderr and "tiny-* for tests" in stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the no-CUDA message")
def test_cuda_requested_without_cuda(tmp_path):
    code, _, stderr = gm("capture", "--device", "cuda", "--out", str(tmp_path / "z"))
    assert code == 2 and "no CUDA device" in stderr and "Traceback" not in stderr


def test_existing_out_dir_is_not_overwritten(tmp_path):
    (tmp_path / "keep.txt").write_text("x")
    code, _, stderr = gm("capture", "--device", "cpu", "--out", str(tmp_path))
    assert code == 2 and "--force" in stderr
    assert [p.name for p in tmp_path.iterdir()] == ["keep.txt"] and (tmp_path / "keep.txt").read_text() == "x"


def test_help_is_useful():
    r = runner.invoke(app, ["--help"])
    assert r.exit_code == 0 and "capture" in r.output
    r = runner.invoke(app, ["capture", "--help"])
    assert r.exit_code == 0 and "--buckets" in r.output and "--compositions" in r.output


def test_the_command_list_shows_each_summary_as_flowing_text():
    """Rich kept a docstring's line breaks in `gmtool --help`: bench's summary broke after "capture time and"."""
    import inspect

    r = runner.invoke(app, ["--help"], env={"COLUMNS": "400"}, terminal_width=400)
    lines = [" ".join(line.strip("│ ").split()) for line in r.output.splitlines()]
    for cmd in app.registered_commands:  # wide enough for each on one line
        summary = " ".join(inspect.getdoc(cmd.callback).split("\n\n")[0].split())
        assert f"{cmd.name} {summary}" in lines, cmd.name


def test_out_of_memory_during_capture_keeps_done_buckets(monkeypatch):
    """OOM at one bucket: earlier buckets' results kept, the failing one named, later ones skipped."""
    from gmtool.core.backends.cpu import CpuTapeBackend

    real_end = CpuTapeBackend.end
    calls = {"n": 0}

    def end(self):
        calls["n"] += 1
        if calls["n"] == 2:  # the second capture (bucket 2; buckets go largest first)
            raise torch.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_end(self)

    monkeypatch.setattr(CpuTapeBackend, "end", end)
    cfg = SweepConfig(device="cpu", buckets="1,2,4", modes=("eager", "full"), num_iters=2, num_iters_warmup=0)
    res = Sweep(cfg).run()
    full = [r.to_dict() for r in res.records if r.mode == "full"]
    assert all(r["status"] == "ok" for r in full if r["bucket"] == 4)
    assert any(r["status"] == "oom" and r["bucket"] == 2 for r in full)
    assert all(r["status"] == "skipped" for r in full if r["bucket"] == 1)
    assert any("bucket d2" in e for e in res.errors)


def test_max_tokens_trims_the_default_buckets_and_says_so():
    """--max-tokens below the largest default bucket: the defaults are the tool's choice, not the user's, so those
    above it are left out (with a note) rather than the run refused; buckets given are still checked."""
    cfg = SweepConfig(device="cpu", max_tokens=4)
    assert cfg.bucket_sizes == [1, 2, 4]
    assert "default buckets above --max-tokens 4 left out: 8" in cfg.notes
    assert SweepConfig(device="cpu", max_tokens=8).bucket_sizes == [1, 2, 4, 8]
    with pytest.raises(GmtoolError, match="--max-tokens 4 is below bucket 8"):
        SweepConfig(device="cpu", buckets="1,8", max_tokens=4)
    with pytest.raises(GmtoolError, match="--max-tokens 8 is below every default prefill bucket \\(the smallest is 16"):
        SweepConfig(device="cpu", scenario="prefill", max_tokens=8)
