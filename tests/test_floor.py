"""The hardware floor: its arithmetic, the device figures, kernels per replay, kernel classes, and the compare
rows and plot that carry it (CPU tape backend)."""

from __future__ import annotations

import json
import types

import pytest
import torch

from gmtool.config import SweepConfig
from gmtool.core.compositions import parse_composition
from gmtool.measure import floor
from gmtool.measure.workbench import Workbench
from gmtool.modes import GraphMode
from tests.test_compare import FAST, run_cli


@pytest.fixture(scope="module")
def bench():
    cfg = SweepConfig(
        model="tiny-qwen3",
        device="cpu",
        dtype="fp32",
        buckets="4,8",
        modes=(GraphMode.EAGER, GraphMode.FULL),
        max_kv_len=96,
    )
    return Workbench.build(cfg, num_blocks=100)


def test_floor_arithmetic():
    dev = floor.DeviceFloor(copy_bytes_per_s=2e12, node_us=1.5)
    f = floor.floor_of(10**9, 400, dev)
    assert f.bandwidth_ms == pytest.approx(0.5)  # 1 GB at 2 TB/s
    assert f.launch_ms == pytest.approx(0.6)  # 400 nodes x 1.5 us
    assert f.ms == pytest.approx(0.6)  # the larger one
    assert floor.floor_of(10**9, 100, dev).ms == pytest.approx(0.5)
    no_count = floor.floor_of(10**9, None, dev)
    assert no_count.launch_ms is None and no_count.ms == pytest.approx(0.5)


def test_step_bytes_are_weights_kv_and_activations(bench):
    lm = bench.lm
    item = 4  # fp32
    weights = sum(p.numel() for p in lm.model.parameters()) * item  # tiny-qwen3 ties its embedding
    per_token_kv = 2 * lm.num_layers * lm.num_kv_heads * lm.head_dim * item
    hidden = lm.model.config.hidden_size
    b = bench.batch(parse_composition("1*3@20", seed=0))  # three decode requests, 21 tokens of context each
    want = weights + per_token_kv * 3 * 21 + 3 * hidden * item * lm.num_layers + 3 * lm.vocab_size * item
    assert floor.step_bytes(lm, b) == want
    longer = bench.batch(parse_composition("1*3@40", seed=0))
    assert floor.step_bytes(lm, longer) - floor.step_bytes(lm, b) == per_token_kv * 3 * 20


def test_untied_embedding_counts_only_the_rows_read():
    emb = torch.nn.Embedding(1000, 8)
    head = torch.nn.Linear(8, 1000, bias=False)
    vision = torch.nn.Parameter(torch.zeros(5000))  # a multimodal model's vision tower: no text step reads it
    model = types.SimpleNamespace(
        get_input_embeddings=lambda: emb,
        get_output_embeddings=lambda: head,
        parameters=lambda: iter([emb.weight, head.weight, vision]),
        base_model_prefix="model",  # the decoder stack (here the embedding alone); the head beside it
        model=types.SimpleNamespace(parameters=lambda: iter([emb.weight])),
        config=types.SimpleNamespace(hidden_size=8),
    )
    lm = types.SimpleNamespace(model=model, num_layers=1, num_kv_heads=1, rank_kv_heads=1, head_dim=8, vocab_size=1000)
    batch = types.SimpleNamespace(num_tokens=2, num_seqs=2, kv_lens=[0, 0])
    assert floor.step_bytes(lm, batch) == head.weight.nbytes + 2 * 8 * 4 + 2 * 8 * 4 + 2 * 1000 * 4


def test_kv_bytes_follow_the_layout_v_head_dim_and_windows():
    """DeepSeek-style K 12 / V 8, and one of two layers with a window of 5: a sequence of 20 costs 20 + 5 tokens."""
    from gmtool.model.attention import LayerOpts
    from gmtool.model.probe import KVLayout

    w = torch.nn.Parameter(torch.zeros(10, 4))
    model = types.SimpleNamespace(
        get_input_embeddings=lambda: types.SimpleNamespace(weight=w),
        get_output_embeddings=lambda: None,
        parameters=lambda: iter([w]),
        base_model_prefix="model",
        model=types.SimpleNamespace(parameters=lambda: iter([w])),
        config=types.SimpleNamespace(hidden_size=4),
    )
    layout = KVLayout(2, 1, 12, 8, (LayerOpts(), LayerOpts(window=5)))
    lm = types.SimpleNamespace(model=model, num_layers=2, rank_kv_heads=1, head_dim=12, vocab_size=10, layout=layout)
    short, long = (types.SimpleNamespace(num_tokens=1, num_seqs=1, kv_lens=[n]) for n in (3, 20))
    assert floor.step_bytes(lm, long) - floor.step_bytes(lm, short) == (20 + 5 - 3 - 3) * (12 + 8) * 4


def test_device_figures_are_measured_and_plausible():
    dev = floor.measure_device(torch.device("cpu"), rounds=2)
    assert 1e8 < dev.copy_bytes_per_s < 1e12  # a memcpy: 0.1 GB/s to 1 TB/s
    assert 0.01 < dev.node_us < 1000


def test_kernels_per_replay_counts_ops():
    x = torch.ones(4)
    assert floor.kernels_per_replay(lambda: (x * 2).add_(1).sum(), torch.device("cpu")) == 3


@pytest.mark.parametrize(
    "name, cls",
    [
        ("ampere_sgemm_128x64_tn", "GEMM"),
        ("aten::addmm", "GEMM"),
        ("aten::mm", "GEMM"),
        ("_decode_split_kernel", "attention"),
        ("_varlen_kernel", "attention"),
        ("aten::scaled_dot_product_attention", "attention"),
        ("_rms_norm_kernel", "norm"),
        ("_add_rms_norm_kernel", "norm"),
        ("aten::rsqrt", "norm"),
        ("void at::native::vectorized_elementwise_kernel<4, ...>", "elementwise"),
        ("aten::mul", "elementwise"),
        ("_silu_mul_kernel", "elementwise"),
        ("aten::argmax", "other"),
    ],
)
def test_kernel_classes(name, cls):
    assert floor.kernel_class(name) == cls


def test_time_by_class_counts_outermost_cpu_ops(tmp_path):
    ev = lambda name, ts, dur: {"cat": "cpu_op", "name": name, "ts": ts, "dur": dur, "pid": 1, "tid": 1}  # noqa: E731
    trace = {
        "traceEvents": [
            ev("aten::linear", 0, 100),
            ev("aten::addmm", 10, 80),  # addmm inside linear
            ev("aten::mul", 100, 50),
            ev("aten::rsqrt", 200, 30),
            {"cat": "user_annotation", "name": "full replay 0", "ts": 0, "dur": 300},
        ]
    }
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace))
    split = floor.time_by_class(path, replays=2)
    assert split == {"attention": 0.0, "GEMM": 0.05, "norm": 0.015, "elementwise": 0.025, "other": 0.0}


def test_compare_rows_carry_their_floor_and_the_report_plots_it(tmp_path):
    out = tmp_path / "floor"
    code, _, err = run_cli(
        "compare", "eager,full,piecewise", *FAST, "--buckets", "4", "--compositions", "1*4,2+2", "--trace", "--out", out
    )
    assert code == 0, err
    doc = json.loads((out / "results.json").read_text())
    assert doc["machine"]["copy_bytes_per_s"] > 0 and doc["machine"]["graph_node_us"] > 0
    for r in doc["records"]:
        assert r["floor_ms"] == pytest.approx(max(r["floor_bandwidth_ms"], r["floor_launch_ms"]))
        assert r["floor_bandwidth_ms"] == pytest.approx(r["floor_bytes"] / doc["machine"]["copy_bytes_per_s"] * 1e3)
        assert r["floor_launch_ms"] == pytest.approx(r["kernels"] * doc["machine"]["graph_node_us"] / 1e3)
        assert r["replay_over_floor"] == pytest.approx(r["latency_ms"]["median"] / r["floor_ms"])
    # each mode's traced step is its largest bucket's first mix (what the graph was captured with): that row only
    traced = [r for r in doc["records"] if r.get("time_by_class_ms")]
    assert {(r["mode"], r["composition"]) for r in traced} == {(m, "1*4") for m in ("eager", "full", "piecewise")}
    for r in traced:
        assert set(r["time_by_class_ms"]) == {"GEMM", "attention", "norm", "elementwise", "other"}
        assert sum(r["time_by_class_ms"].values()) > 0
    rows = {(r["mode"], r["composition"]): r for r in doc["records"]}
    assert all(r["kernels"] > 10 * doc["model"]["layers"] for r in doc["records"])  # every layer's ops, at least
    assert rows[("eager", "1*4")]["floor_bytes"] == rows[("full", "1*4")]["floor_bytes"]
    html = (out / "report.html").read_text()
    assert "Distance to the floor</figcaption>" in html


def test_the_cpu_launch_floor_is_the_cheaper_of_a_tape_op_and_an_eager_op(monkeypatch):
    """A floor is the least a step could take: on the CPU a tape op cost more than the same op run eagerly, and
    eager rows came out below their 'floor' (replay / floor 0.94)."""
    times = iter([1.0, 5.0, 2.0])  # ms: the copy, NODES tape ops, NODES eager ops
    monkeypatch.setattr(floor, "_median_ms", lambda fn, device, iters: next(times))
    dev = floor.measure_device(torch.device("cpu"))
    assert dev.node_us == pytest.approx(2.0 * 1e3 / floor.NODES)
