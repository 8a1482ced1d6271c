"""What a new user meets first: the version, python -m gmtool, output directories that never collide, never
stay behind empty after a failure, and never keep an older run's files."""
import subprocess
import sys

import pytest

from gmtool.report.results import default_out_dir, output_dir, prepare_out_dir


def test_version_and_python_dash_m():
    p = subprocess.run([sys.executable, "-m", "gmtool", "--version"], capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and p.stdout.startswith("gmtool ") and p.stdout.split()[1][0].isdigit()
    p = subprocess.run([sys.executable, "-m", "gmtool", "capture", "--buckets", "x"], capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 2 and "malformed bucket" in p.stderr and "Traceback" not in p.stderr


def test_default_output_directories_are_unique(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    a = prepare_out_dir(default_out_dir("capture"), force=False)
    b = default_out_dir("capture")  # the same process, the same second: another name
    assert a != b and not b.exists()
    p = subprocess.run([sys.executable, "-c", "from gmtool.report.results import default_out_dir; "
                        "print(default_out_dir('capture'))"], capture_output=True, text=True, timeout=120)
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
    """A model refused once it is built (a sliding window shorter than --max-kv-len): nothing was measured."""
    import json
    from pathlib import Path

    cfg = json.loads((Path(__file__).parents[1] / "profiles/models/tiny-llama.json").read_text())["config"]
    cfg.update(model_type="mistral", architectures=["MistralForCausalLM"], sliding_window=64)
    cfg.pop("rope_scaling")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "o"
    p = subprocess.run([sys.executable, "-m", "gmtool", "capture", "--device", "cpu", "--model",
                        str(tmp_path / "config.json"), "--max-kv-len", "160", "--buckets", "4", "--out", str(out)],
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 2 and "sliding-window" in p.stderr and "Traceback" not in p.stderr
    assert not out.exists()
