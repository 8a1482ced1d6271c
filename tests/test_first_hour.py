"""What a new user meets first: the version, python -m gmtool, output directories that never collide, never
stay behind empty after a failure, and never keep an older run's files."""

import subprocess
import sys

import pytest

from gmtool.report.results import default_out_dir, output_dir, prepare_out_dir


def test_version_and_python_dash_m():
    p = subprocess.run([sys.executable, "-m", "gmtool", "--version"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.startswith("gmtool ") and p.stdout.split()[1][0].isdigit()
    p = subprocess.run(
        [sys.executable, "-m", "gmtool", "capture", "--buckets", "x"], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 2 and "malformed bucket" in p.stderr and "Traceback" not in p.stderr


def test_default_output_directories_are_unique(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a = prepare_out_dir(default_out_dir("capture"), force=False)
    b = default_out_dir("capture")  # the same process, the same second: another name
    assert a != b and not b.exists()
    p = subprocess.run(
        [sys.executable, "-c", "from gmtool.report.results import default_out_dir; print(default_out_dir('capture'))"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert p.returncode == 0 and p.stdout.strip() != str(a)  # another process: its own pid in the name


def test_a_failed_run_leaves_no_empty_output_directory(tmp_path):
    out = tmp_path / "new"
    with pytest.raises(RuntimeError):
        with output_dir(out, force=False):
            raise RuntimeError("the run failed before writing anything")
    assert not out.exists()
    kept = tmp_path / "kept"
    with pytest.raises(RuntimeError):
        with output_dir(kept, force=False) as d:
            (d / "results.json").write_text("{}")
            raise RuntimeError("failed after writing")
    assert (kept / "results.json").read_text() == "{}"  # what was written stays


def test_force_removes_an_older_runs_files_and_nothing_else(tmp_path):
    old = tmp_path / "old"
    old.mkdir()
    for name in ("report.md", "report.html", "results.json", "trace-full.json", "notes.txt"):
        (old / name).write_text("old")
    prepare_out_dir(old, force=True)
    assert sorted(p.name for p in old.iterdir()) == ["notes.txt"]


def test_capture_that_fails_before_writing_leaves_no_directory(tmp_path):
    """A model refused once it is built (DiffLlama calls its attention twice a layer, which the probe of its
    attention calls finds): nothing was measured."""
    from tests.arch_configs import write_config

    path = write_config("diffllama", tmp_path)
    out = tmp_path / "o"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "gmtool",
            "capture",
            "--device",
            "cpu",
            "--model",
            str(path),
            "--buckets",
            "4",
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 2 and "calls its attention 2 times" in p.stderr and "Traceback" not in p.stderr
    assert not out.exists()


@pytest.mark.parametrize(
    "args, message",
    [
        (["--model", "{tmp}/invalid.json"], "cannot read config file"),
        (["--model", "{tmp}/t5.json"], "is not a causal language model"),
        (["--model", "{tmp}/unknown.json"], "does not know model_type 'no-such-type'"),
        (["--num-iters-warmup", "-3"], "--num-iters-warmup must be 0 or more"),
        (["--kv-cache-gb", "-1"], "--kv-cache-gb must be positive"),
        (["--compositions", ""], "empty composition list"),
        (["--buckets", "4", "--compositions", "1*4", "--max-num-seqs", "2"], "above --max-num-seqs 2"),
    ],
)
def test_bad_input_is_refused_before_anything_runs(tmp_path, args, message):
    (tmp_path / "invalid.json").write_text("{bad")
    (tmp_path / "t5.json").write_text(
        '{"model_type": "t5", "d_model": 64, "num_layers": 2, "num_heads": 2, '
        '"d_kv": 16, "d_ff": 64, "vocab_size": 100}'
    )
    (tmp_path / "unknown.json").write_text('{"model_type": "no-such-type"}')
    out = tmp_path / "o"
    argv = [a.replace("{tmp}", str(tmp_path)) for a in args]
    if "--buckets" not in argv:  # a small run, were the input taken: given twice, --buckets is refused itself
        argv += ["--buckets", "1"]
    p = subprocess.run(
        [sys.executable, "-m", "gmtool", "capture", "--device", "cpu", *argv, "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1 and message in lines[0] and len(lines[0]) < 300, p.stderr
    assert not out.exists()


def _results_doc(scenario="decode", **over):
    doc = {
        "tool": "gmtool",
        "schema_version": 1,
        "command": "compare",
        "model": {"name": "tiny-qwen3"},
        "config": {"scenario": scenario, "modes": ["eager"]},
        "machine": {"device": "cpu"},
        "errors": [],
        "notes": [],
        "records": [],
    }
    doc.update(over)
    return doc


def test_a_baseline_of_another_scenario_is_refused(tmp_path):
    import json

    (tmp_path / "base.json").write_text(json.dumps(_results_doc("prefill")))
    out = tmp_path / "o"
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "gmtool",
            "compare",
            "eager",
            "--device",
            "cpu",
            "--buckets",
            "1",
            "--baseline",
            str(tmp_path / "base.json"),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 2 and "is a prefill run, this run is decode" in p.stderr and "Traceback" not in p.stderr
    assert not out.exists()


def test_report_on_an_incomplete_results_file_is_one_line(tmp_path):
    import json

    d = tmp_path / "run"
    d.mkdir()
    (d / "results.json").write_text(json.dumps(_results_doc(records=[{"mode": "full", "bucket": 1}])))
    p = subprocess.run([sys.executable, "-m", "gmtool", "report", str(d)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "record 1 lacks composition, status" in p.stderr and "Traceback" not in p.stderr
    (d / "results.json").write_text(json.dumps({"tool": "gmtool", "records": []}))
    p = subprocess.run([sys.executable, "-m", "gmtool", "report", str(d)], capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "no 'model' section" in p.stderr and "Traceback" not in p.stderr


def test_out_under_a_file_is_one_line(tmp_path):
    (tmp_path / "afile").write_text("x")
    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "gmtool",
            "capture",
            "--device",
            "cpu",
            "--buckets",
            "1",
            "--out",
            str(tmp_path / "afile" / "run"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 2 and "cannot create output directory" in p.stderr and "Traceback" not in p.stderr
