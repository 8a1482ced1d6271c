"""--tp 2 on two GPUs: NCCL all-reduces captured inside full and piecewise graphs, replays judged against TP=2
eager (same shape, bf16 rounding at most) and TP=1 eager (the bf16 tolerance), graph memory per rank, a failed
rank stopped. The TP=1 vs TP=2 table for the 8B models is tools/tp_table.py (minutes, not a test)."""

import json

import pytest
import torch

from gmtool.config import SweepConfig
from gmtool.core.compositions import parse_composition
from gmtool.measure.timing import rel_err_per_seq, tolerances_for
from gmtool.measure.workbench import Workbench
from gmtool.parallel import launch
from gmtool.parallel.profile import all_reduce_ms
from tests.test_parallel import MIXES, gm, tp_logits

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 CUDA devices")]


def _config(tp: int, model: str = "qwen3-0.6b") -> SweepConfig:
    return SweepConfig(
        model=model,
        device="cuda",
        dtype="bf16",
        buckets="1,4",
        modes=("eager", "full"),
        compositions=",".join(MIXES),
        max_kv_len=256,
        tp=tp,
    )


@pytest.fixture(scope="module")
def tp2():
    return launch.run(tp_logits, _config(2), ("full", "piecewise"), timeout=120)


def test_tp2_graphs_hold_the_all_reduce_and_replay_as_eager(tp2):
    tol_same, _ = tolerances_for(torch.bfloat16)
    assert tp2["kv_heads"] == 4 and tp2["q_rows"] == 8 * 128  # qwen3-0.6b: 16 query and 8 KV heads, halved
    for text in MIXES:
        for mode in ("full", "piecewise"):
            err = tp2[("same shape", mode, text)]
            print(f"TP=2 {mode} {text}: same-shape error {err:.2e}")
            assert err <= tol_same, (mode, text, err)


def test_tp2_matches_tp1_eager_within_bf16_tolerance(tp2):
    bench = Workbench.build(_config(1))
    _, tol = tolerances_for(torch.bfloat16)
    for text in MIXES:
        fn, logits = bench.eager_fn(bench.batch(parse_composition(text)))
        fn()
        for mode in ("eager", "full", "piecewise"):
            err = rel_err_per_seq(tp2[(mode, text)].to(logits.device), logits)
            print(f"TP=2 {mode} {text} against TP=1 eager: {err:.2e}")
            assert err <= tol, (mode, text, err)


def test_tp2_compare_rows_and_graph_memory_per_rank(tmp_path):
    out = tmp_path / "run"
    code, stdout, stderr, took = gm(
        "compare",
        "eager,full,piecewise",
        "--model",
        "qwen3-0.6b",
        "--tp",
        2,
        "--buckets",
        "1,8,32",
        "--num-iters",
        10,
        "--out",
        out,
        timeout=400,
    )
    assert code == 0, stderr
    doc = json.loads((out / "results.json").read_text())
    assert doc["config"]["tp"] == 2 and doc["machine"]["backend"] == "cuda"
    share = next(n for n in doc["notes"] if "all-reduces of a step, timed alone (in one CUDA graph)" in n)
    print(share)
    assert "the 56 all-reduces" in share and "% of full's replay" in share
    for r in doc["records"]:
        assert r["status"] == "ok", r
        assert r["max_rel_err_same_shape"] <= r["tolerance_same_shape"] and r["max_rel_err"] <= r["tolerance"]
    captured = [r for r in doc["records"] if r["capture_s"] is not None]
    assert {(r["rank"], r["mode"], r["bucket"]) for r in captured} == {
        (k, m, b) for k in (0, 1) for m in ("full", "piecewise") for b in (1, 8, 32)
    }
    for r in captured:
        assert r["graph_mem_bytes"] is not None and r["latency_ms"]["median"] > 0, r
        print(
            f"rank {r['rank']} {r['mode']} bucket {r['bucket']}: graph {r['graph_mem_bytes'] / 2**20:.1f} MiB, "
            f"replay {r['latency_ms']['median']:.3f} ms, capture {r['capture_s']:.2f} s"
        )
    print(stdout)


def test_all_reduce_alone_in_a_graph():
    ms = launch.run(all_reduce_ms, SweepConfig(model="qwen3-0.6b", device="cuda", buckets="1,256", tp=2), 1024, 56)
    print(f"56 all-reduces of [1, 1024] / [256, 1024] bf16 in one graph: {ms[1]:.3f} / {ms[256]:.3f} ms")
    assert 0 < ms[1] <= ms[256] * 1.5


def test_a_failed_rank_stops_the_nccl_group(tmp_path):
    code, _, stderr, took = gm(
        "capture",
        "--model",
        "tiny-qwen3",
        "--tp",
        2,
        "--buckets",
        1,
        "--tp-timeout",
        20,
        "--out",
        tmp_path / "x",
        env={launch.FAIL_ENV: "1"},
        timeout=300,
    )
    lines = stderr.strip().splitlines()
    assert code == 1 and len(lines) == 1 and lines[0].startswith("error: rank 1 of 2 failed"), stderr
    assert took < 150, took


def test_memreport_under_tp2(tmp_path):
    """Each rank captures under each strategy with its own pools; rank 0's figures are written."""
    out = tmp_path / "mem"
    code, stdout, stderr, _ = gm(
        "memreport",
        "--model",
        "qwen3-0.6b",
        "--tp",
        2,
        "--strategies",
        "independent,shared,vmm",
        "--buckets",
        "8,32",
        "--num-iters",
        3,
        "--out",
        out,
        timeout=400,
    )
    assert code == 0, stderr
    doc = json.loads((out / "memreport.json").read_text())
    print(stdout)
    for row in doc["strategies"]:
        assert row["status"] == "ok", f"{row['strategy']}: {row['reason']}"
        assert row["shuffled_replays"] == row["shuffled_ok"] > 0
