"""Fused decoder-layer ops on CPU: the torch references against a float64 oracle and Hugging Face's own
modules, and (when triton is installed) the Triton kernels under the Triton interpreter against the references.

The interpreter must be switched on before triton is imported, so the kernel tests run in a child pytest with
TRITON_INTERPRET=1 (the pattern of tests/test_kernels.py); they use fp32 and fp16 only, bf16 is covered by
tests/gpu/test_layer_kernels_gpu.py. Strided inputs are padded with NaN, so a kernel that reads outside its
row (a wrong mask or stride) gives NaN rather than a small error.
"""

from __future__ import annotations

import os
import sys

import pytest
import torch

from gmtool.model.layers_ref import (
    add_rms_norm_ref,
    qk_norm_rope_ref,
    rms_norm_ref,
    silu_mul_ref,
)
from tests.interpreted import INTERPRETED, HAS_TRITON, interp_only, run_interpreted


F32, F16 = torch.float32, torch.float16
TOL = {F32: 1e-5, F16: 2e-3}
EPS = 1e-6
HEADS = [(4, 2), (2, 2)]  # (q heads, kv heads)


def _randn(*shape, seed=0, dtype=F32, scale=1.0, shift=0.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(*shape, generator=g, dtype=torch.float64) * scale + shift).to(dtype)


def _strided(rows, cols, dtype, seed=0, scale=1.0):
    """A [rows, cols] view at column 8 of a NaN-filled [rows, cols + 24]: row stride larger than the row."""
    big = torch.full((rows, cols + 24), float("nan"), dtype=dtype)
    big[:, 8 : 8 + cols] = _randn(rows, cols, seed=seed, dtype=dtype, scale=scale)
    return big[:, 8 : 8 + cols]


def _angles(tokens, head_dim, base=10000.0):
    """float64 RoPE angles [T, D/2] at scattered positions, so tokens differ and angles pass 2*pi."""
    pos = torch.arange(tokens, dtype=torch.float64) * 37 + 5
    return pos[:, None] * base ** (-torch.arange(0, head_dim, 2, dtype=torch.float64) / head_dim)


def _cos_sin(ang, dtype):
    """HF's layout (cat(freqs, freqs)), as views of one [T, 2D] tensor, so each has row stride 2D."""
    emb = torch.cat((ang, ang), -1)
    both = torch.cat((emb.cos(), emb.sin()), -1).to(dtype)
    return both[:, : emb.shape[1]], both[:, emb.shape[1] :]


def _qk_case(tokens, hq, hkv, dim, dtype, norm, seed=0):
    qkv = _strided(tokens, (hq + 2 * hkv) * dim, dtype, seed=seed, scale=2.0)
    qkv[:, (hq + hkv) * dim :] = float("nan")  # v: never read
    weights = (
        (
            _randn(dim, seed=seed + 1, dtype=dtype, scale=0.3, shift=1.0),
            _randn(dim, seed=seed + 2, dtype=dtype, scale=0.3, shift=1.0),
        )
        if norm
        else (None, None)
    )
    return qkv, weights


# ---------------------------------------------------------------- references (fp32, CPU)


def test_rms_norm_ref_matches_oracle_and_hf():
    from transformers.models.qwen3 import modeling_qwen3 as hf

    x = _strided(5, 96, F32, scale=3.0)
    w = _randn(96, seed=1, scale=0.3, shift=1.0)
    out = rms_norm_ref(x, w, EPS)
    xd = x.double()
    expect = xd / (xd.pow(2).mean(-1, keepdim=True) + EPS).sqrt() * w.double()
    torch.testing.assert_close(out.double(), expect, atol=1e-5, rtol=1e-5)
    norm = hf.Qwen3RMSNorm(96, eps=EPS)
    with torch.no_grad():
        norm.weight.copy_(w)
        assert torch.equal(out, norm(x))


def test_add_rms_norm_ref_is_hf_decoder_residual():
    """The sum is HF's `residual + hidden_states`; the norm of it is HF's next RMSNorm, bit for bit (bf16)."""
    from transformers.models.qwen3 import modeling_qwen3 as hf

    x, r = _strided(5, 96, torch.bfloat16, scale=3.0), _strided(5, 96, torch.bfloat16, seed=3, scale=9.0)
    w = _randn(96, seed=1, scale=0.3, shift=1.0, dtype=torch.bfloat16)
    out, total = add_rms_norm_ref(x, r, w, EPS)
    norm = hf.Qwen3RMSNorm(96, eps=EPS).to(torch.bfloat16)
    with torch.no_grad():
        norm.weight.copy_(w)
        assert torch.equal(total, r + x) and torch.equal(out, norm(r + x))


def _oracle_qk(qkv, hq, hkv, dim, ang, weights):
    """float64, RoPE as a complex rotation of (x1 + i x2): no rotate_half, no cos/sin tensors."""
    x = qkv.double()[:, : (hq + hkv) * dim].reshape(-1, hq + hkv, dim)
    if weights[0] is not None:
        w = torch.cat((weights[0].double().expand(hq, dim), weights[1].double().expand(hkv, dim)))
        x = x / (x.pow(2).mean(-1, keepdim=True) + EPS).sqrt() * w
    half = dim // 2
    z = torch.complex(x[..., :half], x[..., half:]) * torch.polar(torch.ones_like(ang), ang)[:, None, :]
    out = torch.cat((z.real, z.imag), -1)
    return out[:, :hq], out[:, hq:]


@pytest.mark.parametrize("norm", [False, True])
def test_qk_norm_rope_ref_matches_oracle(norm):
    hq, hkv, dim = 4, 2, 64
    qkv, weights = _qk_case(6, hq, hkv, dim, F32, norm)
    ang = _angles(6, dim)
    q, k = qk_norm_rope_ref(qkv, hq, hkv, dim, *_cos_sin(ang, F32), *weights, eps=EPS)
    assert q.shape == (6, hq, dim) and k.shape == (6, hkv, dim) and q.is_contiguous() and k.is_contiguous()
    eq, ek = _oracle_qk(qkv, hq, hkv, dim, ang, weights)
    torch.testing.assert_close(q.double(), eq, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(k.double(), ek, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [F32, torch.bfloat16])
def test_qk_norm_rope_ref_is_hf_qwen3(dtype):
    """Bit for bit Qwen3Attention's q_norm/k_norm + apply_rotary_pos_emb, bf16 roundings included."""
    from transformers.models.qwen3 import modeling_qwen3 as hf

    tokens, hq, hkv, dim = 5, 4, 2, 128
    qkv, (qw, kw) = _qk_case(tokens, hq, hkv, dim, dtype, norm=True)
    cos, sin = _cos_sin(_angles(tokens, dim), dtype)
    q, k = qk_norm_rope_ref(qkv, hq, hkv, dim, cos, sin, qw, kw, eps=EPS)
    q_norm, k_norm = hf.Qwen3RMSNorm(dim, eps=EPS).to(dtype), hf.Qwen3RMSNorm(dim, eps=EPS).to(dtype)
    with torch.no_grad():
        q_norm.weight.copy_(qw)
        k_norm.weight.copy_(kw)
        # HF's layout: [B, T, H, D] from the projections, normed, then transposed to [B, H, T, D].
        hq_states = q_norm(qkv[:, : hq * dim].reshape(1, tokens, hq, dim)).transpose(1, 2)
        hk_states = k_norm(qkv[:, hq * dim : (hq + hkv) * dim].reshape(1, tokens, hkv, dim)).transpose(1, 2)
        eq, ek = hf.apply_rotary_pos_emb(hq_states, hk_states, cos[None], sin[None])
    assert torch.equal(q, eq[0].transpose(0, 1)) and torch.equal(k, ek[0].transpose(0, 1))


def test_silu_mul_ref_matches_oracle():
    x = _strided(4, 2 * 96, F32, scale=3.0)
    out = silu_mul_ref(x)
    xd = x.double()
    gate, up = xd[:, :96], xd[:, 96:]
    assert out.shape == (4, 96) and out.is_contiguous()
    torch.testing.assert_close(out.double(), gate / (1 + torch.exp(-gate)) * up, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- Triton kernels


@pytest.mark.skipif(INTERPRETED, reason="the child runs the tests itself")
def test_layer_kernels_under_interpreter():
    """Every interp_only test of this module, run by the Triton interpreter in a child pytest: all of them
    must pass (triton is a test dependency: a child that skipped them fails here)."""
    assert HAS_TRITON, "triton is not installed: pip install -e '.[test]' (the kernel interpreter tests need it)"
    run_interpreted(sys.modules[__name__], interp_only)


def _compile_for_hopper(jit_fn, consts, ptr="*bf16"):
    from gmtool.kernels.testing import compile_for_hopper

    return compile_for_hopper(
        jit_fn, consts, lambda name: ptr if name.endswith("_ptr") else "fp32" if name == "eps" else "i32"
    )


@pytest.mark.skipif(INTERPRETED or not HAS_TRITON, reason="needs triton, not interpreted")
def test_layer_kernels_compile_for_hopper():
    """The interpreter runs the kernels as Python; this runs triton's compiler and ptxas for sm_90, which
    catches what only compiled code rejects (pointer types across the q/k branch, constexpr use)."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    from gmtool.kernels import layers

    for ptr in ("*bf16", "*fp32"):
        assert _compile_for_hopper(layers._rms_norm_kernel, {"H": 4096, "BLOCK": 4096}, ptr).asm["cubin"]
        assert _compile_for_hopper(layers._add_rms_norm_kernel, {"H": 1024, "BLOCK": 1024}, ptr).asm["cubin"]
        for norm, half, write in ((True, 64, False), (False, 64, False), (True, 48, False), (True, 64, True)):
            consts = {"HQ": 16, "HKV": 8, "HALF": half, "HALF_PAD": 64, "NORM": norm, "PAGE": 16, "WRITE_KV": write}
            assert _compile_for_hopper(layers._qk_norm_rope_kernel, consts, ptr).asm["cubin"]
        assert _compile_for_hopper(layers._silu_mul_kernel, {"I": 3072, "BLOCK": 1024}, ptr).asm["cubin"]
    from gmtool.kernels.testing import compile_for_hopper

    def partials(name):  # x: a GEMM's split-K partials (fp32), the rest as a bf16 step's
        return "*fp32" if name == "x_ptr" else "*bf16" if name.endswith("_ptr") else "fp32" if name == "eps" else "i32"

    split = {"SPLIT": 4, "HAS_BIAS": True}
    assert compile_for_hopper(layers._add_rms_norm_kernel, {"H": 1024, "BLOCK": 1024} | split, partials).asm["cubin"]
    assert compile_for_hopper(layers._silu_mul_kernel, {"I": 3072, "BLOCK": 1024} | split, partials).asm["cubin"]

    def qkv_partials(name):
        return "*fp32" if name == "qkv_ptr" else "*i64" if name == "slot_ptr" else partials(name)

    qk = {"HQ": 16, "HKV": 8, "HALF": 64, "HALF_PAD": 64, "NORM": True, "PAGE": 16, "WRITE_KV": True}
    assert compile_for_hopper(layers._qk_norm_rope_kernel, qk | split, qkv_partials).asm["cubin"]


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_launchers_reject_bad_shapes():
    from gmtool.kernels.layers import add_rms_norm, qk_norm_rope, rms_norm, silu_mul

    cos = sin = torch.zeros(3, 64)
    with pytest.raises(ValueError, match="weight"):
        rms_norm(torch.zeros(3, 96), torch.ones(64), EPS)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(torch.zeros(3, 96), torch.zeros(2, 96), torch.ones(96), EPS)
    with pytest.raises(ValueError, match="residual"):
        add_rms_norm(torch.zeros(3, 96), torch.zeros(3, 96, dtype=F16), torch.ones(96), EPS)
    with pytest.raises(ValueError, match="heads"):
        qk_norm_rope(torch.zeros(3, 7 * 64), 4, 2, 64, cos, sin)
    with pytest.raises(ValueError, match="cos/sin"):
        qk_norm_rope(torch.zeros(3, 8 * 64), 4, 2, 64, cos[:2], sin[:2])
    with pytest.raises(ValueError, match="both"):
        qk_norm_rope(torch.zeros(3, 8 * 64), 4, 2, 64, cos, sin, q_weight=torch.ones(64))
    with pytest.raises(ValueError, match="even"):
        silu_mul(torch.zeros(3, 7))


def _check(out, expect, dtype):
    assert out.dtype == dtype and out.shape == expect.shape and out.is_contiguous()
    torch.testing.assert_close(out, expect, atol=TOL[dtype], rtol=TOL[dtype])


@interp_only
@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("tokens", [1, 3, 7])
@pytest.mark.parametrize("hidden", [96, 1024])
def test_interp_rms_norm(dtype, tokens, hidden):
    from gmtool.kernels.layers import rms_norm

    x = _strided(tokens, hidden, dtype, seed=tokens, scale=3.0)
    w = _randn(hidden, seed=hidden, dtype=dtype, scale=0.3, shift=1.0)
    _check(rms_norm(x, w, EPS), rms_norm_ref(x, w, EPS), dtype)


@interp_only
@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("hidden", [96, 1024])
def test_interp_add_rms_norm(dtype, tokens, hidden):
    from gmtool.kernels.layers import add_rms_norm

    x = _strided(tokens, hidden, dtype, seed=tokens, scale=3.0)
    r = _strided(tokens, hidden, dtype, seed=tokens + 5, scale=6.0)
    w = _randn(hidden, seed=hidden, dtype=dtype, scale=0.3, shift=1.0)
    out, total = add_rms_norm(x, r, w, EPS)
    e_out, e_total = add_rms_norm_ref(x, r, w, EPS)
    _check(total, e_total, dtype)
    _check(out, e_out, dtype)


@interp_only
@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("tokens", [1, 3])
def test_interp_add_rms_norm_sums_a_gemm_s_partials_bit_for_bit(dtype, bias, tokens):
    """A block's last projection handed over as split-K partials (small_m.linear(partial=True)): add_rms_norm
    sums them as the GEMM's reduce kernel would, so both outputs equal the reduced path's bit for bit."""
    from gmtool.kernels.common import Partials
    from gmtool.kernels.layers import add_rms_norm
    from gmtool.kernels.small_m import Config, linear

    hidden, k = 96, 96
    x = _strided(tokens, k, dtype, seed=tokens, scale=0.5)
    wt = _randn(hidden, k, seed=7, dtype=dtype, scale=0.2)
    b = _randn(hidden, seed=8, dtype=dtype) if bias else None
    r = _strided(tokens, hidden, dtype, seed=tokens + 5, scale=6.0)
    w = _randn(hidden, seed=hidden, dtype=dtype, scale=0.3, shift=1.0)
    split = Config(16, 32, 32, 3)  # three K slices of 32
    parts = linear(x, wt, b, split, partial=True)
    assert isinstance(parts, Partials) and parts.parts.shape == (3, tokens, hidden) and parts.shape == (tokens, hidden)
    out, total = add_rms_norm(parts, r, w, EPS)
    e_out, e_total = add_rms_norm(linear(x, wt, b, split), r, w, EPS)
    assert torch.equal(total, e_total) and torch.equal(out, e_out)
    _check(out, add_rms_norm_ref(torch.matmul(x, wt.t()) + (b if bias else 0), r, w, EPS)[0], dtype)
    assert isinstance(linear(x, wt, b, Config(16, 32, 32, 1), partial=True), torch.Tensor)  # nothing to sum


@interp_only
@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("tokens", [1, 3, 7])
@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("dim", [64, 128, 96])
def test_interp_qk_norm_rope(dtype, norm, tokens, hq, hkv, dim):
    from gmtool.kernels.layers import qk_norm_rope

    qkv, weights = _qk_case(tokens, hq, hkv, dim, dtype, norm, seed=tokens + dim)
    cos, sin = _cos_sin(_angles(tokens, dim), dtype)
    q, k = qk_norm_rope(qkv, hq, hkv, dim, cos, sin, *weights, eps=EPS)
    eq, ek = qk_norm_rope_ref(qkv, hq, hkv, dim, cos, sin, *weights, eps=EPS)
    _check(q, eq, dtype)
    _check(k, ek, dtype)


@interp_only
@pytest.mark.parametrize("dtype,cache_dtype", [(F32, F32), (F16, F16), (F16, F32)])
@pytest.mark.parametrize("norm", [False, True])
@pytest.mark.parametrize("tokens", [1, 3])
@pytest.mark.parametrize("hq,hkv", HEADS)
@pytest.mark.parametrize("dim", [64, 96])
def test_interp_qk_norm_rope_write_kv(dtype, cache_dtype, norm, tokens, hq, hkv, dim):
    """q as qk_norm_rope gives it, and the caches as write_kv leaves them after qk_norm_rope: k normalized and
    rotated, v as the qkv row holds it, at each token's slot; a negative slot writes nothing, and no other slot
    of the cache changes (it is filled with a sentinel first)."""
    from gmtool.kernels.layers import qk_norm_rope, qk_norm_rope_write_kv
    from gmtool.model.attention import write_kv

    qkv, weights = _qk_case(tokens, hq, hkv, dim, dtype, norm, seed=3 * tokens + dim)
    qkv[:, (hq + hkv) * dim :] = _randn(tokens, hkv * dim, seed=dim, dtype=dtype)  # v: read here
    cos, sin = _cos_sin(_angles(tokens, dim), dtype)
    blocks, page = 5, 4
    slots = torch.tensor([9, -1, 17][:tokens], dtype=torch.int64)  # block 2 offset 1; padding; block 4 offset 1
    kc, vc = (torch.full((blocks, page, hkv, dim), 7.0, dtype=cache_dtype) for _ in range(2))
    q = qk_norm_rope_write_kv(qkv, hq, hkv, dim, cos, sin, *weights, EPS, kc, vc, slots)
    eq, ek = qk_norm_rope(qkv, hq, hkv, dim, cos, sin, *weights, eps=EPS)
    ekc, evc = (torch.full((blocks, page, hkv, dim), 7.0, dtype=cache_dtype) for _ in range(2))
    keep = slots >= 0
    v = qkv[:, (hq + hkv) * dim :].reshape(tokens, hkv, dim)
    write_kv(ekc, evc, ek[keep].to(cache_dtype), v[keep].to(cache_dtype), slots[keep])
    assert torch.equal(q, eq)
    assert torch.equal(kc, ekc) and torch.equal(vc, evc)


@interp_only
@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("tokens", [1, 3])
def test_interp_qk_norm_rope_write_kv_reads_its_rows_of_the_tables(dtype, tokens):
    """With positions, cos/sin are RoPE tables and each token reads its position's row: q and the caches bit for
    bit those of the same kernel given the gathered rows."""
    from gmtool.kernels.layers import qk_norm_rope_write_kv

    hq, hkv, dim = 4, 2, 64
    qkv, weights = _qk_case(tokens, hq, hkv, dim, dtype, True, seed=11)
    qkv[:, (hq + hkv) * dim :] = _randn(tokens, hkv * dim, seed=12, dtype=dtype)
    cos, sin = (t.contiguous() for t in _cos_sin(_angles(11, dim), dtype))  # a table of 11 positions
    positions = torch.tensor([7, 0, 10][:tokens])
    slots = torch.tensor([9, -1, 17][:tokens], dtype=torch.int64)
    outs = []
    for rows in (positions, None):
        kc, vc = (torch.full((5, 4, hkv, dim), 7.0, dtype=dtype) for _ in range(2))
        c, s_ = (cos, sin) if rows is not None else (cos[positions], sin[positions])
        q = qk_norm_rope_write_kv(qkv, hq, hkv, dim, c, s_, *weights, EPS, kc, vc, slots, positions=rows)
        outs.append((q, kc, vc))
    assert all(torch.equal(a, b) for a, b in zip(*outs))


@interp_only
@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("tokens", [1, 3, 7])
@pytest.mark.parametrize("inter", [96, 1000])
def test_interp_silu_mul(dtype, tokens, inter):
    from gmtool.kernels.layers import silu_mul

    x = _strided(tokens, 2 * inter, dtype, seed=inter + tokens, scale=3.0)
    _check(silu_mul(x), silu_mul_ref(x), dtype)


def _gemm_partials(tokens, n, dtype, bias, seed):
    """A small-M GEMM's product of n columns two ways: as split-K Partials (three K slices) and reduced."""
    from gmtool.kernels.small_m import Config, linear

    k = 96
    x = _strided(tokens, k, dtype, seed=seed, scale=0.5)
    wt = _randn(n, k, seed=seed + 1, dtype=dtype, scale=0.2)
    b = _randn(n, seed=seed + 2, dtype=dtype) if bias else None
    split = Config(16, 32, 32, 3)
    return linear(x, wt, b, split, partial=True), linear(x, wt, b, split)


@interp_only
@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("bias", [False, True])
def test_interp_silu_mul_sums_a_gemm_s_partials_bit_for_bit(dtype, bias):
    from gmtool.kernels.layers import silu_mul

    parts, rows = _gemm_partials(3, 2 * 80, dtype, bias, seed=11)
    assert torch.equal(silu_mul(parts), silu_mul(rows))


@interp_only
@pytest.mark.parametrize("dtype", [F32, F16])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("norm", [False, True])
def test_interp_qk_norm_rope_write_kv_sums_a_gemm_s_partials_bit_for_bit(dtype, bias, norm):
    """The QKV GEMM's split-K partials: q and both caches (k rotated, v as summed) equal the reduced path's."""
    from gmtool.kernels.layers import qk_norm_rope_write_kv

    tokens, hq, hkv, dim = 3, 4, 2, 32
    parts, rows = _gemm_partials(tokens, (hq + 2 * hkv) * dim, dtype, bias, seed=21)
    _, weights = _qk_case(tokens, hq, hkv, dim, dtype, norm, seed=5)
    cos, sin = _cos_sin(_angles(tokens, dim), dtype)
    slots = torch.tensor([9, -1, 17], dtype=torch.int64)
    outs = []
    for qkv in (parts, rows):
        kc, vc = (torch.full((5, 4, hkv, dim), 7.0, dtype=dtype) for _ in range(2))
        outs.append((qk_norm_rope_write_kv(qkv, hq, hkv, dim, cos, sin, *weights, EPS, kc, vc, slots), kc, vc))
    assert all(torch.equal(a, b) for a, b in zip(*outs))
    assert not torch.equal(outs[0][1], torch.full_like(outs[0][1], 7.0))  # the caches were written


@interp_only
def test_interp_fused_forward_reads_rope_rows_in_the_qk_kernel(monkeypatch):
    """tiny-qwen3 fused with a RoPE table: a forward that writes the cache in the QK kernel hands it the table and
    the positions (no gather), and the logits equal those of the forward that gathers them."""
    from gmtool.model import fused as fused_mod
    from gmtool.model.rotary_table import RopeRows

    from .helpers import Rig

    monkeypatch.setattr(fused_mod, "_triton_runs", lambda x: True)
    rig = Rig()
    fused = fused_mod.fuse_layers(rig.lm.model, "triton", rig.lm.layout, rope_positions=256)
    assert fused.counts["rope_positions"] == 256
    batch = rig.batch("1*4@9", seed=2)
    gathers = []
    real = RopeRows.gathered
    monkeypatch.setattr(RopeRows, "gathered", lambda self: gathers.append(1) or real(self))
    table = rig.lm.model.model.rotary_emb.forward
    calls, real_call = [], type(table).__call__
    monkeypatch.setattr(type(table), "__call__", lambda self, *a: calls.append(1) or real_call(self, *a))
    start = [t.clone() for t in rig.cache.k + rig.cache.v]
    outs = []
    for on in (True, False):
        for t, s in zip(rig.cache.k + rig.cache.v, start):
            t.copy_(s)
        fused.ops.rope_rows = on
        outs.append(rig.eager(batch).clone())
        assert (calls == []) == on and (gathers == []) == on, (on, calls, gathers)  # rows: no gather at all
        calls.clear()
        gathers.clear()
    assert torch.equal(*outs)


@interp_only
@pytest.mark.parametrize("composition", ["1*4@9", "5+2@3"])  # a decode step; a prefill and a decode row
def test_interp_fused_forward_writes_the_cache_in_the_qk_kernel(monkeypatch, composition):
    """tiny-qwen3 with gmtool's fused layers, their Triton kernels interpreted: every layer writes its K/V in the
    QK-norm + RoPE kernel, and the logits and the whole cache equal those of the same forward writing them
    through the attention's write_kv (cache_writer off), from the same starting cache."""
    from gmtool.kernels import layers
    from gmtool.model import attention
    from gmtool.model import fused as fused_mod

    from .helpers import Rig

    monkeypatch.setattr(fused_mod, "_triton_runs", lambda x: True)
    rig = Rig()
    fused_mod.fuse_layers(rig.lm.model, "triton", rig.lm.layout)
    batch = rig.batch(composition, seed=2)
    start = [t.clone() for t in rig.cache.k + rig.cache.v]
    writes = []
    real = layers.qk_norm_rope_write_kv
    monkeypatch.setattr(layers, "qk_norm_rope_write_kv", lambda *a, **k: writes.append(1) or real(*a, **k))

    def run():
        for t, s in zip(rig.cache.k + rig.cache.v, start):
            t.copy_(s)
        return rig.eager(batch).clone(), [t.clone() for t in rig.cache.k + rig.cache.v]

    fused_out, fused_cache = run()
    assert len(writes) == rig.lm.model.config.num_hidden_layers
    monkeypatch.setattr(attention, "cache_writer", lambda: None)
    plain_out, plain_cache = run()
    assert len(writes) == rig.lm.model.config.num_hidden_layers  # the second forward wrote through write_kv
    assert torch.equal(fused_out, plain_out)
    assert all(torch.equal(a, b) for a, b in zip(fused_cache, plain_cache))
    assert not all(torch.equal(a, s) for a, s in zip(fused_cache, start))  # the forward wrote the cache
