"""GPU checks of gmtool compare: the one-process sweep end to end on tiny-qwen3, and the hf-compiled peer."""

import csv
import json
import re

import pytest
import torch

from tests.helpers import md_table_rows
from tests.test_compare import run_cli

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
FAST = ["--model", "tiny-qwen3", "--device", "cuda", "--num-iters", "10", "--num-iters-warmup", "3"]


def test_compare_eager_full_piecewise(tmp_path):
    out = tmp_path / "run"
    code, stdout, stderr = run_cli(
        "compare", "eager,full,piecewise", *FAST, "--buckets", "1,2,4,8", "--trace", "--format", "json", "--out", out
    )
    assert code == 0, stderr
    doc = json.loads(stdout)
    assert doc["machine"]["backend"] == "cuda" and doc["machine"]["gpu"]
    assert {r["mode"] for r in doc["records"]} == {"eager", "full", "piecewise"}
    for r in doc["records"]:
        assert r["status"] == "ok", r
        assert r["max_rel_err"] <= r["tolerance"]
        assert r["latency_ms"]["median"] > 0 and r["speedup"] > 0
    fresh = [r for r in doc["records"] if r["mode"] != "eager" and r["capture_s"] is not None]
    assert len(fresh) == 8 and all(r["graph_mem_bytes"] is not None for r in fresh)  # one capture per bucket
    with (out / "results.csv").open() as f:
        table = list(csv.DictReader(f))
    assert [(t["mode"], int(t["bucket"]), t["status"]) for t in table] == [
        (r["mode"], r["bucket"], r["status"]) for r in doc["records"]
    ]
    summary = md_table_rows((out / "report.md").read_text(), "Summary (mode x bucket)")
    assert sorted((r[0], r[1], r[3]) for r in summary) == sorted(
        (str(b), m, "ok") for b in (1, 2, 4, 8) for m in ("eager", "full", "piecewise")
    )
    for mode in ("eager", "full", "piecewise"):  # each mode's trace: its largest bucket's replays
        events = json.loads((out / f"trace-{mode}.json").read_text())["traceEvents"]
        assert any(e.get("name") == f"{mode} bucket 8 replay 0" for e in events), mode
    html = (out / "report.html").read_text()
    # latency, graph memory (measured on CUDA), distance to the floor, speedup
    assert len(re.findall(r'src="data:image/png;base64,', html)) == 4


def test_compare_hf_compiled_peer(tmp_path):
    """Slow (torch.compile per bucket): the peer's rows are measured and agree with gmtool eager."""
    out = tmp_path / "peer"
    code, stdout, stderr = run_cli(
        "compare", "eager,full,hf-compiled", *FAST, "--buckets", "1,4", "--trace", "--format", "json", "--out", out
    )
    assert code == 0, stderr
    peer = [r for r in json.loads(stdout)["records"] if r["mode"] == "hf-compiled"]
    assert [r["bucket"] for r in peer] == [1, 4]
    for r in peer:
        assert r["status"] == "ok", r
        assert r["max_rel_err"] <= r["tolerance"]
        assert r["compile_s"] > 0 and r["latency_ms"]["median"] > 0 and r["speedup"] > 0
        assert "StaticCache" in r["notes"]
    events = json.loads((out / "trace-hf-compiled.json").read_text())["traceEvents"]
    assert any(re.fullmatch(r"hf-compiled bucket [14] replay 0", e.get("name", "")) for e in events)
