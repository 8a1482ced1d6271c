"""GPU checks of the folded one-row GEMM (gmtool.kernels.folded) in bf16: QKV and gate/up over a NormedRow of
down_proj's split-K partials, against the add+RMSNorm kernel then the small-M GEMM, at every built-in profile's
shapes, launched with PDL as --pdl does; and qwen3-0.6b's fused B=1 decode graph with the folds against the same
graph without them (the sweep's own check, gmtool.measure.fused_check, compares either with HF's layers)."""

import pytest
import torch

from gmtool.kernels.gemm_bench import projection_shapes
from gmtool.profiles import load_model_profile, model_profiles

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEV = torch.device("cuda")
BF16 = torch.bfloat16


def _randn(*shape, seed, scale=1.0, dtype=BF16):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, generator=g, device=DEV) * scale).to(dtype)


def _pdl() -> int:
    from gmtool.kernels import pdl

    return 0 if pdl.problem(DEV) else int(pdl.Pdl.EARLY)


@pytest.mark.parametrize("model", model_profiles())
def test_folds_match_the_chain_at_every_profile_shape(model):
    from gmtool.kernels import folded, small_m
    from gmtool.kernels.common import NormedRow, Partials
    from gmtool.kernels.layers import add_rms_norm

    shapes = projection_shapes(load_model_profile(model)["config"])
    n_d, k_d, _ = shapes["down"]
    if not folded.norm_folds(n_d):
        pytest.skip(f"{model}: hidden {n_d} is not folded")
    x = small_m.linear(_randn(1, k_d, seed=6), _randn(n_d, k_d, seed=7, scale=k_d**-0.5), partial=True)
    residual, norm_w = _randn(1, n_d, seed=8), _randn(n_d, seed=9, scale=0.1) + 1
    y, total = add_rms_norm(x, residual, norm_w, 1e-6)
    for name in ("qkv", "gate_up"):
        n, hidden, bias = shapes[name]
        w, b = _randn(n, hidden, seed=10, scale=hidden**-0.5), _randn(n, seed=11) if bias else None
        expect = small_m.linear(y, w, b).float()
        row = NormedRow.of(x, residual, norm_w, 1e-6)
        got = folded.linear(row, w, b, pdl=_pdl(), partial=True)
        if isinstance(got, Partials):
            got = got.parts.sum(0) + (b.float() if b is not None else 0)
        torch.testing.assert_close(got.float(), expect, atol=2e-2, rtol=2e-2, msg=f"{model} {name}")
        assert torch.equal(row.total, total), f"{model} {name}: the residual sum differs"


def test_fused_decode_graph_with_folds_equals_without():
    """qwen3-0.6b --fuse --small-m-gemm --pdl, B=1 kv 1,023: the decode graph with the folds against the graph
    without them, replayed over the same batch."""
    from gmtool.core.compositions import parse_composition
    from gmtool.kernels import folded
    from gmtool.measure.timing import rel_err_per_seq, tolerances_for
    from gmtool.modes import GraphMode

    from tests.gpu.rigs import small_m_pdl_bench

    bench = small_m_pdl_bench("1,32")  # shared with test_pdl_gpu.py
    batch = bench.batch(parse_composition("1*1@1023", seed=1))
    logits, folds = {}, []
    real = folded.linear
    folded.linear = lambda *a, **k: folds.append(1) or real(*a, **k)
    try:
        for fold in (True, False):
            bench.lm.fused.ops.fold = fold
            ex = bench.executor(GraphMode.FULL)
            logits[fold] = ex.step(batch).float().clone()
            assert bool(folds) == fold
            folds.clear()
            del ex
    finally:
        folded.linear, bench.lm.fused.ops.fold = real, True
    err = rel_err_per_seq(logits[True], logits[False])
    assert err < tolerances_for(BF16)[0], err  # H200, 2026-12-01: 0 (the same bits)


@pytest.mark.parametrize("model", model_profiles())
def test_down_with_silu_matches_the_chain_at_every_profile_shape(model):
    """The down projection computing SiLU-and-mul of the gate/up row, launched with PDL, against SiLU-and-mul
    then the small-M GEMM: the same bits, split-K partials or a row."""
    from gmtool.kernels import folded, small_m
    from gmtool.kernels.common import Partials
    from gmtool.kernels.layers import silu_mul

    shapes = projection_shapes(load_model_profile(model)["config"])
    n_gu, hidden, gu_bias = shapes["gate_up"]
    n, k, bias = shapes["down"]
    w_gu = _randn(n_gu, hidden, seed=1, scale=hidden**-0.5)
    b_gu = _randn(n_gu, seed=2) if gu_bias else None
    w, b = _randn(n, k, seed=3, scale=k**-0.5), _randn(n, seed=4) if bias else None
    for partial_gu in (True, False):
        gate_up = small_m.linear(_randn(1, hidden, seed=5), w_gu, b_gu, partial=partial_gu)
        for partial in (True, False):
            expect = small_m.linear(silu_mul(gate_up), w, b, partial=partial)
            got = folded.silu_linear(gate_up, w, b, pdl=_pdl(), partial=partial)
            if isinstance(expect, Partials):
                assert isinstance(got, Partials) and torch.equal(got.parts, expect.parts), f"{model} partials"
            else:
                assert torch.equal(got, expect), f"{model}: {(got.float() - expect.float()).abs().max()}"


@pytest.mark.parametrize("fold", ["fold_silu", "fold_first", "rope_rows"])
def test_fused_decode_graph_with_a_fold_equals_without(fold):
    """qwen3-0.6b --fuse --small-m-gemm --pdl, B=1 kv 1,023: SiLU-and-mul inside down_proj, the embedding
    lookup and the first RMSNorm inside the first QKV GEMM, or the QK kernel reading its RoPE rows (ahead of its
    PDL wait), against their kernels: the same logits bit for bit (hidden 1,024: the norm kernel and the GEMM
    reduce the sum of squares over the same 4 warps)."""
    from gmtool.core.compositions import parse_composition
    from gmtool.modes import GraphMode

    from tests.gpu.rigs import small_m_pdl_bench

    bench = small_m_pdl_bench("1,32")
    batch = bench.batch(parse_composition("1*1@1023", seed=1))
    logits = {}
    try:
        for on in (True, False):
            setattr(bench.lm.fused.ops, fold, on)
            ex = bench.executor(GraphMode.FULL)
            logits[on] = ex.step(batch).float().clone()
            del ex
    finally:
        setattr(bench.lm.fused.ops, fold, True)
    assert torch.equal(logits[True], logits[False])
