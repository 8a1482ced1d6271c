"""The folded one-row GEMM (gmtool.kernels.folded) on the CPU: QKV and gate/up computing the residual add +
RMSNorm before them, against the add+RMSNorm kernel then the small-M GEMM, under the Triton interpreter (fp32 and
fp16, as tests/test_small_m.py: the interpreter's bf16 dot is not trusted); and a fused tiny-qwen3 decode step of
one sequence with the folds against the same step without them."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tests.interpreted import HAS_TRITON, INTERPRETED, interp_only, needs_triton, run_interpreted


F32, F16 = torch.float32, torch.float16
TOL = {F32: 1e-5, F16: 2e-3}


def _randn(*shape, seed, dtype=F32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


@pytest.mark.skipif(INTERPRETED, reason="the child runs the tests itself")
def test_folded_under_interpreter():
    """Every interp_only test of this module, in a child pytest under the Triton interpreter."""
    assert HAS_TRITON, "triton is not installed: pip install -e '.[test]'"
    run_interpreted(sys.modules[__name__], interp_only)


@interp_only
@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("source", ["partials", "partials+bias", "rows", "embedded"])
@pytest.mark.parametrize("blocks", [(16, 1), (16, 3), (32, 2)])
@pytest.mark.parametrize("bias", [False, True])
def test_interp_qkv_normalizes_its_row(source, blocks, bias, dtype, monkeypatch):
    """The GEMM over a NormedRow gives, bit for bit, add_rms_norm then the small-M GEMM with the same blocks, and
    add_rms_norm's residual sum (hidden 48: the row padded to 64 in the first pass; the block output as split-K
    partials, with or without their bias, or a row, or an embedding table's row 7 read by its id on the device,
    with a zero residual, as the first layer folds it; BLOCK_K 16 whole, 32 masked past K; split into 3 or 2 K
    slices, handed on as Partials or reduced; the GEMM's own bias)."""
    from gmtool.kernels import folded, small_m
    from gmtool.kernels.common import NormedRow, Partials
    from gmtool.kernels.layers import add_rms_norm

    hidden = 48
    x_in, w_prev = _randn(1, 40, seed=1, dtype=dtype), _randn(hidden, 40, seed=2, dtype=dtype) / 6
    x_bias = _randn(hidden, seed=3, dtype=dtype) if source.endswith("bias") else None
    table = _randn(11, hidden, seed=8, dtype=dtype)  # "embedded": row 7 of an embedding table, no residual yet
    if source == "rows":
        x = small_m.linear(x_in, w_prev, x_bias)
    elif source == "embedded":
        x = table[7:8]
    else:
        x = small_m.linear(x_in, w_prev, x_bias, config=small_m.Config(16, 16, 16, 3), partial=True)
    residual = _randn(1, hidden, seed=4, dtype=dtype) if source != "embedded" else torch.zeros(1, hidden, dtype=dtype)
    norm_w, w = _randn(hidden, seed=5, dtype=dtype), _randn(72, hidden, seed=6, dtype=dtype) / 7
    b = _randn(72, seed=7, dtype=dtype) if bias else None
    y, total = add_rms_norm(x, residual, norm_w, 1e-6)
    cfg = small_m.Config(16, 32, *blocks)
    for partial in (True, False):
        expect = small_m.linear(y, w, b, config=cfg, partial=partial)
        if source == "embedded":
            row = NormedRow.embedded(table, torch.tensor([7]), residual, norm_w, 1e-6)
        else:
            row = NormedRow.of(x, residual, norm_w, 1e-6)
        row.total.fill_(float("nan"))
        monkeypatch.setattr(small_m, "pick", lambda *a, **k: cfg)
        got = folded.linear(row, w, b, partial=partial)
        monkeypatch.undo()
        assert torch.equal(row.total, total)
        if partial and blocks[1] > 1:  # summed by the next kernel
            assert isinstance(got, Partials) and isinstance(expect, Partials)
            assert got.parts.shape == (blocks[1], 1, 72) and torch.equal(got.parts, expect.parts)
            assert (got.bias is None) == (b is None) and got.dtype == dtype
        else:
            assert got.dtype == dtype and torch.equal(got, expect), (got - expect).abs().max()


@interp_only
@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("source", ["partials", "partials+bias", "rows"])
@pytest.mark.parametrize("blocks", [(16, 1), (16, 3), (32, 2)])
@pytest.mark.parametrize("bias", [False, True])
def test_interp_down_computes_silu_of_its_row(source, blocks, bias, dtype, monkeypatch):
    """The down projection over a gate/up row gives, bit for bit, SiLU-and-mul then the small-M GEMM with the same
    blocks (intermediate 48: BLOCK_K 16 whole, 32 masked past K; the gate/up product as split-K partials, with or
    without their bias, or a row; split into 3 or 2 K slices, handed on as Partials or reduced; its own bias)."""
    from gmtool.kernels import folded, small_m
    from gmtool.kernels.common import Partials
    from gmtool.kernels.layers import silu_mul

    inter = 48
    x_in, w_gu = _randn(1, 40, seed=1, dtype=dtype), _randn(2 * inter, 40, seed=2, dtype=dtype) / 6
    gu_bias = _randn(2 * inter, seed=3, dtype=dtype) if source.endswith("bias") else None
    if source == "rows":
        gate_up = small_m.linear(x_in, w_gu, gu_bias)
    else:
        gate_up = small_m.linear(x_in, w_gu, gu_bias, config=small_m.Config(16, 16, 16, 3), partial=True)
    w = _randn(72, inter, seed=6, dtype=dtype) / 7
    b = _randn(72, seed=7, dtype=dtype) if bias else None
    cfg = small_m.Config(16, 32, *blocks)
    for partial in (True, False):
        expect = small_m.linear(silu_mul(gate_up), w, b, config=cfg, partial=partial)
        monkeypatch.setattr(small_m, "pick", lambda *a, **k: cfg)
        got = folded.silu_linear(gate_up, w, b, partial=partial)
        monkeypatch.undo()
        if partial and blocks[1] > 1:
            assert isinstance(got, Partials) and isinstance(expect, Partials)
            assert got.parts.shape == (blocks[1], 1, 72) and torch.equal(got.parts, expect.parts)
        else:
            assert got.dtype == dtype and torch.equal(got, expect), (got - expect).abs().max()


@interp_only
def test_interp_fused_decode_of_one_sequence_folds(monkeypatch):
    """A fused tiny-qwen3 decode step of one sequence on the small-M GEMM: QKV and gate/up normalize their own rows
    (one add+RMSNorm kernel left: the final norm's), down_proj computes SiLU-and-mul; the same logits without each
    of those folds, and as without any fold to within rounding. Four
    sequences fold nothing. Eager only: the CPU backend's graphs replay ATen ops, the interpreter's kernels are
    not ATen ops."""
    from gmtool.kernels import folded, layers
    from gmtool.kernels.common import NormedRow
    from gmtool.model import fused as fused_mod

    from .helpers import Rig, rel

    monkeypatch.setattr(fused_mod, "_triton_runs", lambda x: True)
    seen, launched = [], []
    real = folded.linear
    monkeypatch.setattr(folded, "linear", lambda x, *a, **k: seen.append(type(x)) or real(x, *a, **k))

    class Counted:
        def __init__(self, name, launch):
            self.name, self.launch = name, launch

        def __getitem__(self, grid):
            launched.append(self.name)
            return self.launch[grid]

    monkeypatch.setattr(layers, "_ADD_RMS_NORM", Counted("add_rms_norm", layers._ADD_RMS_NORM))
    monkeypatch.setattr(layers, "_SILU_MUL", Counted("silu_mul", layers._SILU_MUL))
    monkeypatch.setattr(folded, "_SILU_GEMM", Counted("silu_gemm", folded._SILU_GEMM))
    import gmtool.kernels

    monkeypatch.setattr(gmtool.kernels, "available", lambda: True)  # Triton attention, interpreted
    rig = Rig(buckets=(1, 4), mode="full")
    rig.bench.cfg.attention_backend = "triton"
    fused = fused_mod.fuse_layers(rig.lm.model, "triton", rig.lm.layout, small_m=4)
    n = rig.lm.num_layers
    one = rig.batch("1*1@100", seed=1)
    on = rig.eager(one)
    assert seen == [NormedRow] * (2 * n), seen  # the first layer's QKV too, its row read from the embedding table
    assert sorted(launched) == ["add_rms_norm"] + ["silu_gemm"] * n, launched  # SiLU inside every down projection
    fused.ops.fold_first = False
    seen.clear()
    assert rel(rig.eager(one), on) == 0  # the same bits with the embedding's and the first RMSNorm's kernels
    assert seen == [NormedRow] * (2 * n - 1), seen
    fused.ops.fold_first = True
    assert "add+RMSNorms before QKV and gate/up run inside those GEMMs" in fused.summary
    fused.ops.fold_silu = False
    launched.clear()
    assert rel(rig.eager(one), on) == 0  # the same bits with SiLU-and-mul launched
    assert sorted(launched) == ["add_rms_norm"] + ["silu_mul"] * n, launched
    fused.ops.fold_silu = True
    fused.ops.fold = False
    assert "inside those GEMMs" not in fused.summary
    seen.clear(), launched.clear()
    off = rig.eager(one)
    assert seen == [] and sorted(launched) == ["add_rms_norm"] * 2 * n + ["silu_mul"] * n, launched
    assert rel(on, off) < 1e-4
    fused.ops.fold = True
    seen.clear()
    rig.eager(rig.batch("1*4@100", seed=2))
    assert seen == []


@needs_triton
def test_folded_linear_rejects_what_it_cannot_fold():
    from gmtool.kernels import folded
    from gmtool.kernels.common import NormedRow

    w = torch.zeros(8, 16)
    with pytest.raises(ValueError, match="one row"):
        NormedRow.of(torch.zeros(2, 16), torch.zeros(2, 16), torch.zeros(16), 1e-6)
    row = NormedRow.of(torch.zeros(1, 16), torch.zeros(1, 16), torch.zeros(16), 1e-6)
    with pytest.raises(ValueError, match="does not fit weight"):
        folded.linear(row, torch.zeros(8, 12))
    with pytest.raises(ValueError, match="does not fit weight"):
        folded.linear(row, w.half())
    with pytest.raises(ValueError, match="bias"):
        folded.linear(row, w, torch.zeros(7))
    big = NormedRow.of(torch.zeros(1, 8192), torch.zeros(1, 8192), torch.zeros(8192), 1e-6)
    with pytest.raises(ValueError, match="at most 4096"):
        folded.linear(big, torch.zeros(4, 8192))
    assert folded.norm_folds(4096) and not folded.norm_folds(4097)


@pytest.mark.skipif(INTERPRETED or not HAS_TRITON, reason="needs triton, not interpreted")
@pytest.mark.parametrize("hidden,gather", [(1024, False), (1024, True), (2880, False), (4096, False)])
def test_folded_kernel_compiles_for_hopper(hidden, gather):
    """The folded GEMM compiles for sm_90 with PDL (what the interpreter does not run), within an H200's shared
    memory at the widest row it takes, and the weight still streams through pipelined 16-byte copies."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    from gmtool.kernels import folded
    from gmtool.kernels.common import pow2
    from gmtool.kernels.testing import compile_for_hopper

    consts = dict(X_SPLIT=4, X_BIAS=False, K_PAD=pow2(hidden), HAS_BIAS=False, PARTIAL=True, EVEN_K=hidden % 256 == 0)
    consts |= dict(BLOCK_M=16, BLOCK_N=64, BLOCK_K=256, PRECISION="tf32", PDL=2, PF_LINES=4, PF_STRIDE=64)
    consts |= dict(GATHER=gather, X_SPLIT=0) if gather else {}

    def arg(name):
        if name == "eps":
            return "fp32"
        if name.endswith("_ptr"):
            return "*fp32" if name in ("x_ptr", "xb_ptr", "out_ptr") else "*i64" if name == "ids_ptr" else "*bf16"
        return "i32"

    kernel = compile_for_hopper(folded._norm_gemm_kernel, consts, arg, num_stages=4)
    ptx = kernel.asm["ptx"]
    assert "griddepcontrol.wait" in ptx
    if consts["EVEN_K"]:  # as small_m's kernel: a K of no whole steps loads with masks
        assert "cp.async.cg.shared.global" in ptx
    assert kernel.metadata.shared <= 227 * 1024


@pytest.mark.skipif(INTERPRETED or not HAS_TRITON, reason="needs triton, not interpreted")
def test_silu_down_kernel_compiles_for_hopper():
    """The down projection computing SiLU-and-mul compiles for sm_90 with PDL, and its weight still streams
    through pipelined 16-byte copies (qwen3-0.6b's down: K 3,072 in BLOCK_K 256 steps)."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    from gmtool.kernels import folded
    from gmtool.kernels.testing import compile_for_hopper

    consts = dict(X_SPLIT=0, X_BIAS=False, HAS_BIAS=False, PARTIAL=True, EVEN_K=True, BLOCK_M=16, BLOCK_N=64)
    consts |= dict(BLOCK_K=256, PRECISION="tf32", PDL=2, PF_LINES=4, PF_STRIDE=64)

    def arg(name):
        if name.endswith("_ptr"):
            return "*fp32" if name in ("xb_ptr", "out_ptr") else "*bf16"
        return "i32"

    kernel = compile_for_hopper(folded._silu_gemm_kernel, consts, arg, num_stages=4)
    ptx = kernel.asm["ptx"]
    assert "griddepcontrol.wait" in ptx and "cp.async.cg.shared.global" in ptx
    assert kernel.metadata.shared <= 227 * 1024


@interp_only
def test_interp_one_row_folds_step_aside_for_a_row_parallel_down_and_a_scaled_embedding(monkeypatch):
    """A down projection that is a Linear subclass (--tp's RowParallelLinear adds an all-reduce) keeps its own
    forward after the SiLU-and-mul kernel, and an embedding that is an nn.Embedding subclass (Gemma scales its
    rows) is looked up by its own forward: neither fold applies, the other norms still fold, the logits are the
    unfolded step's within rounding."""
    from gmtool.kernels import folded, layers
    from gmtool.kernels.common import NormedRow
    from gmtool.model import families
    from gmtool.model import fused as fused_mod

    from .helpers import Rig, rel

    class RowParallelDown(torch.nn.Linear):
        calls = 0

        def forward(self, x):
            RowParallelDown.calls += 1
            return super().forward(x)

    class ScaledEmbedding(torch.nn.Embedding):
        calls = 0

        def forward(self, ids):
            ScaledEmbedding.calls += 1
            return super().forward(ids)

    monkeypatch.setattr(fused_mod, "_triton_runs", lambda x: True)
    seen, launched = [], []
    real = folded.linear
    monkeypatch.setattr(folded, "linear", lambda x, *a, **k: seen.append(type(x)) or real(x, *a, **k))
    real_silu = layers.silu_mul
    monkeypatch.setattr(layers, "silu_mul", lambda *a, **k: launched.append("silu_mul") or real_silu(*a, **k))
    import gmtool.kernels

    monkeypatch.setattr(gmtool.kernels, "available", lambda: True)
    rig = Rig(buckets=(1, 4), mode="full")
    rig.bench.cfg.attention_backend = "triton"
    base = families.base_model(rig.lm.model)
    for layer in base.layers:
        layer.mlp.down_proj.__class__ = RowParallelDown
    base.embed_tokens.__class__ = ScaledEmbedding
    fused = fused_mod.fuse_layers(rig.lm.model, "triton", rig.lm.layout, small_m=4)
    n = rig.lm.num_layers
    one = rig.batch("1*1@100", seed=1)
    on = rig.eager(one)
    assert seen == [NormedRow] * (2 * n - 1), seen  # the first layer's QKV reads the embedding's output
    assert launched == ["silu_mul"] * n and RowParallelDown.calls == n and ScaledEmbedding.calls == 1
    fused.ops.fold = False
    off = rig.eager(one)
    fused.ops.fold = True
    assert rel(on, off) < 1e-4
