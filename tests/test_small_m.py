"""The small-M GEMM (gmtool.kernels.small_m) on the CPU: its block-size choice, its refusals, the kernel under
the Triton interpreter against torch.matmul, and a fused decoder step with the path on against the path off.

The interpreter must be switched on before triton is imported, so the kernel tests run in a child pytest with
TRITON_INTERPRET=1 (the pattern of tests/test_layer_kernels.py), in fp32 and fp16: the interpreter's tl.dot on
bf16 tiles returns garbage (triton 3.9, seen on a 16x16 dot), so bf16 is checked on the GPU
(tests/gpu/test_small_m_gpu.py). x is given as a strided view padded with NaN,
so a kernel that reads past a row of x (or past K in W) gives NaN rather than a small error.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from tests.interpreted import HAS_TRITON, INTERPRETED, interp_only, needs_triton, run_interpreted


F32, F16 = torch.float32, torch.float16
TOL = {F32: 1e-5, F16: 2e-3}
H200_SMS = 132
# (M, N, K): non-multiples of every block size, K shorter than one BLOCK_K, N below one BLOCK_N
SHAPES = [(1, 40, 72), (3, 100, 300), (16, 64, 512), (17, 33, 64), (32, 200, 520), (2, 8, 24)]


def _randn(*shape, seed, dtype=F32):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(*shape, generator=g, dtype=torch.float64).to(dtype)


def _strided_x(m, k, dtype, seed):
    big = torch.full((m, k + 24), float("nan"), dtype=dtype)
    big[:, :k] = _randn(m, k, seed=seed, dtype=dtype)
    return big[:, :k]


def _weight(n, k, dtype, seed):
    """[n, k] as the first k columns of a NaN-padded [n, k + 8]: W rows with a stride, NaN past K."""
    big = torch.full((n, k + 8), float("nan"), dtype=dtype)
    big[:, :k] = _randn(n, k, seed=seed, dtype=dtype) / k**0.5
    return big[:, :k]


# ---------------------------------------------------------------- block sizes (no kernel runs)


@needs_triton
@pytest.mark.parametrize(
    "m, n, k, want",
    [
        # up to 16 rows (tuned on the H200): BLOCK_N 64; qwen3-0.6b's qkv and gate/up as 64 and 96 programs
        (1, 4096, 1024, dict(block_m=16, block_n=64, block_k=256, split=1)),
        (1, 6144, 1024, dict(block_m=16, block_n=64, block_k=256, split=1)),
        # o_proj and down (N 1024: 16 blocks, under a third of 132 SMs): split-K to 64 programs, BLOCK_K 128
        (1, 1024, 2048, dict(block_m=16, block_n=64, block_k=128, split=4)),
        # down's slice of 768: 6 steps of 128 against 4 stages, so 3 of 256, the whole slice in flight
        (8, 1024, 3072, dict(block_m=16, block_n=64, block_k=256, split=4)),
        # qwen2.5-1.5b's down (K 8,960 in 4 slices): longer than the pipeline either way, so 128
        (1, 1536, 8960, dict(block_m=16, block_n=64, block_k=128, split=4)),
        # llama-3.1-8b: down's K of 14,336 split to at most 32 steps a program; gate/up's 448 blocks: BLOCK_K 128
        (8, 4096, 14336, dict(block_m=16, block_n=64, block_k=256, split=2)),
        (1, 28672, 4096, dict(block_m=16, block_n=64, block_k=128, split=1)),
        (1, 4096, 4096, dict(block_m=16, block_n=64, block_k=256, split=1)),
        # few rows of W: the split stops at two BLOCK_K steps a slice; a narrow N narrows the block
        (1, 256, 4096, dict(block_m=16, block_n=64, block_k=128, split=16)),
        (1, 64, 256, dict(block_m=16, block_n=64, block_k=128, split=1)),
        (1, 16, 64, dict(block_m=16, block_n=16, block_k=64, split=1)),
        # more rows (B up to 32): the rule before, untuned
        (32, 1024, 3072, dict(block_m=32, block_n=16, block_k=512, split=1)),
        (32, 28672, 4096, dict(block_m=32, block_n=64, block_k=128, split=1)),
    ],
)
def test_pick_by_shape(m, n, k, want):
    from gmtool.kernels.small_m import pick

    cfg = pick(m, n, k, H200_SMS)
    assert {f: getattr(cfg, f) for f in want} == want
    steps = -(-k // cfg.block_k)
    assert cfg.split == 1 or -(-steps // cfg.split) >= 2
    assert 2 <= cfg.num_stages <= 4


@needs_triton
def test_pick_takes_fewer_stages_for_fp32():
    from gmtool.kernels.small_m import pick

    # BLOCK_N 64 x BLOCK_K 256: 40 KB a stage in bf16 (4 stages), 80 KB in fp32
    assert pick(1, 8192, 4096, H200_SMS, 4).num_stages < pick(1, 8192, 4096, H200_SMS, 2).num_stages


@needs_triton
def test_linear_rejects_bad_shapes():
    from gmtool.kernels.small_m import MAX_M, Config, linear

    w = torch.zeros(8, 16)
    with pytest.raises(ValueError, match="M <= 32"):
        linear(torch.zeros(MAX_M + 1, 16), w)
    with pytest.raises(ValueError, match="need x"):
        linear(torch.zeros(2, 15), w)
    with pytest.raises(ValueError, match="one dtype"):
        linear(torch.zeros(2, 16, dtype=F16), w)
    with pytest.raises(ValueError, match="bias"):
        linear(torch.zeros(2, 16), w, torch.zeros(7))
    with pytest.raises(ValueError, match="contiguous"):
        linear(torch.zeros(2, 16), torch.zeros(16, 8).t())
    with pytest.raises(ValueError, match="block_m 16"):
        linear(torch.zeros(20, 16), w, config=Config(16, 16, 16, 1))


@pytest.mark.skipif(INTERPRETED or not HAS_TRITON, reason="needs triton, not interpreted")
def test_small_m_kernels_compile_for_hopper():
    """triton's compiler and ptxas for sm_90 (what the interpreter does not run), for the configs pick gives;
    the weight loads must be vectorized and pipelined, or the kernel is no faster than cuBLAS."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    from gmtool.kernels import small_m
    from gmtool.kernels.testing import compile_for_hopper

    for ptr in ("*bf16", "*fp32"):
        for bm, bn, bk, even, partial in ((16, 16, 256, True, False), (32, 64, 128, False, True)):
            consts = dict(HAS_BIAS=not partial, PARTIAL=partial, EVEN_K=even, BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk) | {
                "PRECISION": "ieee" if ptr == "*fp32" else "tf32"
            }
            out = "*fp32" if partial else ptr
            kernel = compile_for_hopper(
                small_m._small_m_kernel,
                consts,
                lambda name, out=out, ptr=ptr: (out if name == "out_ptr" else ptr) if name.endswith("_ptr") else "i32",
            )
            assert kernel.asm["cubin"]
            if even and ptr == "*bf16":  # the weight streams through pipelined 16-byte copies, not 2-byte loads
                assert "cp.async.cg.shared.global" in kernel.asm["ptx"]
    consts = {"SPLIT": 4, "HAS_BIAS": True, "BLOCK": small_m.REDUCE_BLOCK}
    reduce = compile_for_hopper(
        small_m._split_reduce_kernel,
        consts,
        lambda n: ("*fp32" if n == "p_ptr" else "*bf16") if n[-4:] == "_ptr" else "i32",
    )
    assert reduce.asm["cubin"]


# ---------------------------------------------------------------- Triton kernels


@pytest.mark.skipif(INTERPRETED, reason="the child runs the tests itself")
def test_small_m_under_interpreter():
    """Every interp_only test of this module, run by the Triton interpreter in a child pytest: all of them
    must pass (triton is a test dependency: a child that skipped them fails here)."""
    assert HAS_TRITON, "triton is not installed: pip install -e '.[test]' (the kernel interpreter tests need it)"
    run_interpreted(sys.modules[__name__], interp_only)


@interp_only
@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", SHAPES)
def test_interp_linear_matches_matmul(shape, bias, dtype):
    """pick's blocks; and a forced split-K of 3 (an uneven last slice) and no split, the same result."""
    from gmtool.kernels.small_m import Config, linear

    m, n, k = shape
    x, w = _strided_x(m, k, dtype, seed=m), _weight(n, k, dtype, seed=n)
    b = _randn(n, seed=k, dtype=dtype) if bias else None
    expect = torch.matmul(x.double(), w.double().t()) + (b.double() if bias else 0)
    for cfg in (None, Config(32, 16, 16, 3), Config(32, 32, 64, 1)):
        y = linear(x, w, b, cfg)
        assert y.dtype == dtype and y.shape == (m, n) and y.is_contiguous()
        assert not y.isnan().any(), f"{cfg}: NaN (read past a row or past K)"
        torch.testing.assert_close(y.double(), expect, atol=TOL[dtype], rtol=TOL[dtype], msg=str(cfg))


@interp_only
def test_interp_split_k_is_deterministic():
    from gmtool.kernels.small_m import Config, linear

    x, w = _strided_x(5, 300, F32, seed=1), _weight(40, 300, F32, seed=2)
    runs = [linear(x, w, config=Config(16, 16, 32, 5)) for _ in range(3)]
    assert all(torch.equal(r, runs[0]) for r in runs)


@interp_only
def test_interp_fused_step_with_small_m_equals_without(monkeypatch):
    """A fused tiny-qwen3 step, its projections on the small-M GEMM, against the same step on F.linear: the
    fused layers' Triton kernels run too (under the interpreter, as on CUDA), only the GEMMs differ. Batches
    above the threshold keep F.linear: the choice is the token count's, so each bucket's graph holds one."""
    from gmtool.kernels import small_m
    from gmtool.model import fused as fused_mod

    from .helpers import Rig, rel

    monkeypatch.setattr(fused_mod, "_triton_runs", lambda x: True)
    calls = []
    real = small_m.linear
    monkeypatch.setattr(small_m, "linear", lambda *a, **kw: calls.append(a[0].shape[0]) or real(*a, **kw))
    rig = Rig()
    fused = fused_mod.fuse_layers(rig.lm.model, "triton", rig.lm.layout, small_m=4)
    assert "up to 4 tokens on gmtool's small-M GEMM" in fused.summary
    decode, prefill = rig.batch("1*4", seed=1), rig.batch("5+3@20", seed=2)
    on = rig.eager(decode)
    assert calls == [4] * 4 * rig.lm.num_layers  # qkv, o_proj, gate/up, down in every layer; not the LM head
    fused.ops.small_m = 0
    off = rig.eager(decode)  # right after: a batch's eager pass writes K/V that another batch may read
    assert len(calls) == 4 * rig.lm.num_layers and "small-M" not in fused.summary
    assert rel(on, off) < 1e-4
    fused.ops.small_m = 4
    rig.eager(prefill)
    assert len(calls) == 4 * rig.lm.num_layers  # 8 tokens: above the threshold


@interp_only
def test_interp_fused_step_hands_split_k_partials_to_the_next_kernel(monkeypatch):
    """With K split, every projection leaves its partial sums to the kernel after it (no reduce kernel): QKV to
    QK-norm+RoPE (which writes K/V to the cache here), gate/up to SiLU-and-mul, o_proj and down_proj to the
    add+RMSNorm; the step's logits equal, bit for bit, the same step with every product reduced."""
    from gmtool.kernels import small_m
    from gmtool.kernels.common import Partials
    from gmtool.model import fused as fused_mod

    from .helpers import Rig

    monkeypatch.setattr(fused_mod, "_triton_runs", lambda x: True)
    monkeypatch.setattr(
        small_m, "pick", lambda m, n, k, sms, elem_bytes=2, partial=False: small_m.Config(16, 16, 16, 2)
    )
    handed, reduced = [], []
    real = small_m.linear

    def counted(*a, **kw):
        y = real(*a, **kw)
        handed.append(isinstance(y, Partials))
        return y

    monkeypatch.setattr(small_m, "linear", counted)
    rig = Rig()
    fused_mod.fuse_layers(rig.lm.model, "triton", rig.lm.layout, small_m=4)
    decode = rig.batch("1*4", seed=1)
    on = rig.eager(decode)
    assert handed == [True] * 4 * rig.lm.num_layers
    monkeypatch.setattr(small_m, "linear", lambda *a, partial=False, **kw: reduced.append(a) or real(*a, **kw))
    off = rig.eager(decode)
    assert len(reduced) == 4 * rig.lm.num_layers
    assert torch.equal(on, off)


def test_projection_shapes_of_the_profiles():
    from gmtool.kernels.gemm_bench import projection_shapes
    from gmtool.profiles import load_model_profile

    def shapes(name):
        return projection_shapes(load_model_profile(name)["config"])

    assert shapes("qwen3-0.6b") == {
        "qkv": (4096, 1024, False),
        "o_proj": (1024, 2048, False),
        "gate_up": (6144, 1024, False),
        "down": (1024, 3072, False),
    }
    assert shapes("qwen2.5-7b")["qkv"] == ((28 + 2 * 4) * 128, 3584, True)  # head_dim from hidden / heads; q/k/v bias
    assert shapes("gpt-oss-20b")["o_proj"] == (2880, 64 * 64, True)


def test_small_m_gemm_needs_fuse():
    from gmtool.config import SweepConfig
    from gmtool.errors import GmtoolError

    from gmtool.model.fused import LayerOps

    with pytest.raises(ValueError, match="0 to 32 tokens"):
        LayerOps("triton", 33)
    with pytest.raises(GmtoolError, match="needs fuse"):
        SweepConfig(device="cpu", small_m_gemm=True)
    assert SweepConfig(device="cpu", fuse=True, small_m_gemm=True).small_m_gemm
