"""One-row decode GEMMs that compute the add+RMSNorm before them, so the norm's kernel is not launched.

At B=1 a decode step is a chain of short kernels; each costs its start after the one before ends and its first
trip to memory, whatever it computes. Leaving the add+RMSNorm kernels out of qwen3-0.6b's step (--fuse
--small-m-gemm --pdl, B=1 kv 1,024, results wrong, timing only) took it from 0.871 to 0.823 ms (H200, 2026-12-01,
.diag/whatif.py). Here QKV and gate/up, the GEMMs after those norms, compute the norm themselves from the same
inputs: each program first reads the whole row (the block output or its split-K partials, and the residual: a few
KB, in L2) for its sum of squares; each K step then reads its slice again (now in cache) and normalizes it into the
x tile. Program (0, 0) also stores the residual sum, which the next add reads. The step: 0.840 and 0.844 ms
against 0.868 and 0.865 (the same call, graphs alternated), the logits bit for bit those of the unfolded step,
at hidden 1,024, where both kernels reduce the sum of squares with 4 warps; the norm kernel takes 8 from 2,048
up, so there the scale may differ in its last fp32 bit and a rounded element by one ulp (within tolerance).

The same way, down_proj computes SiLU-and-mul of its K slice of the gate/up row (silu_linear: no first pass, the
slice only): B=1 kv 1,024 0.804-0.806 ms against 0.818-0.819, kv 4,096 0.930 against 0.946, the logits bit for
bit (H200, 2026-12-02, .diag/siluab.py, graphs alternated in one process). An earlier try (2026-12-01) that
computed it over the whole [16, BLOCK_K] x tile was slower (1.127 against 0.989 ms); here it is one row of
registers, as the norm's. And the first layer's QKV GEMM reads its row straight from the embedding table by the
token id (NormedRow.embedded, with a zero residual): neither the embedding's kernel nor the first RMSNorm's runs,
0.801-0.802 ms against 0.808-0.809 (the same bits; .diag/microab.py, the same day).

Tried and dropped: the decode attention's split combine folded into o_proj the same way (each K step combining
the partials of the heads it covers): 1.051-1.052 ms against 0.865-0.868, and 1.077-1.082 with one K step a
program (the same call). One row only: every program reads the whole row, which at more rows costs more than
the kernel it replaces. The MMA is gmtool.kernels.small_m's on the same x tile (row 0 of 16); block sizes are
small_m.pick's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gmtool.kernels import pdl as pdl_mod
from gmtool.kernels import small_m
from gmtool.kernels.common import NormedRow, Partials, cdiv, num_sms, pow2
from gmtool.kernels.launcher import FastLaunch
from gmtool.kernels.layers import _row_block

# the first pass holds the whole row in registers: past this (hidden 8,192 models) the norm kernel runs
MAX_K = 4096


@triton.jit
def _norm_gemm_kernel(
    x_ptr,  # the block output row [1, K], or its split-K partials [X_SPLIT, 1, K] (GATHER: a table [V, K])
    xb_ptr,  # the partials' bias
    ids_ptr,  # GATHER: the row of x_ptr to read, ids_ptr[0]
    r_ptr,  # the residual row
    nw_ptr,  # the norm's weight
    total_ptr,  # residual + x: out, for the next add
    w_ptr,
    b_ptr,
    out_ptr,
    N,
    K,
    stride_wn,
    steps_per_split,
    eps,
    X_SPLIT: tl.constexpr,
    X_BIAS: tl.constexpr,
    K_PAD: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr = 0,
    PF_LINES: tl.constexpr = 1,
    PF_STRIDE: tl.constexpr = 1,
    GATHER: tl.constexpr = False,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + tl.minimum(rn, N - 1).to(tl.int64)[:, None] * stride_wn
    k0 = pid_k * steps_per_split * BLOCK_K
    span = tl.minimum(steps_per_split * BLOCK_K, K - k0)
    if PDL != 0:  # as small_m's kernel: nothing but the weight prefetch before the wait
        small_m.prefetch_then_wait(w_rows, k0, span, K, BLOCK_K, PF_LINES, PF_STRIDE)
    dt = w_ptr.dtype.element_ty  # the activations' (the launcher checks)
    if GATHER:  # the token id is the step's input (copied in before the graph's first kernel)
        row = tl.load(ids_ptr).to(tl.int64)
    else:
        row = (pid_n * 0).to(tl.int64)
    # the row's sum of squares, as gmtool.kernels.layers' add+RMSNorm kernel takes it
    cols = tl.arange(0, K_PAD)
    cmask = cols < K
    s = _row_block(x_ptr, xb_ptr, row, 1, K, K, cols, cmask, dt, X_SPLIT, X_BIAS)
    s = (s + tl.load(r_ptr + cols, mask=cmask, other=0.0).to(tl.float32)).to(dt)
    if (pid_n == 0) & (pid_k == 0):
        tl.store(total_ptr + cols, s, mask=cmask)
    s = s.to(tl.float32)
    rstd = tl.rsqrt(tl.sum(s * s, 0) / K + eps)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kk in range(0, span, BLOCK_K):
        k = k0 + kk + rk
        if EVEN_K:
            k_ok = rk >= 0
            w = tl.load(w_rows + k[None, :])
        else:
            k_ok = k < K
            w = tl.load(w_rows + k[None, :], mask=k_ok[None, :], other=0.0)
        v = _row_block(x_ptr, xb_ptr, row, 1, K, K, k, k_ok, dt, X_SPLIT, X_BIAS)
        v = (v + tl.load(r_ptr + k, mask=k_ok, other=0.0).to(tl.float32)).to(dt).to(tl.float32)
        nw = tl.load(nw_ptr + k, mask=k_ok, other=0.0).to(tl.float32)
        y = ((v * rstd).to(dt).to(tl.float32) * nw).to(dt)  # HF's two roundings, as the norm kernel makes them
        x = tl.where(rm[:, None] == 0, y[None, :], 0.0).to(dt)  # row 0 of the MMA's 16
        acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
    small_m.store_product(acc, out_ptr, b_ptr, rn, rm, pid_k, 1, N, rn < N, rm == 0, HAS_BIAS, PARTIAL)


_NORM_GEMM = FastLaunch(_norm_gemm_kernel)


def norm_folds(hidden: int) -> bool:
    """Whether a row this wide can be folded (the first pass holds it in registers)."""
    return hidden <= MAX_K


def linear(
    x: NormedRow,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    pdl: int = pdl_mod.Pdl.OFF,
    partial: bool = False,
):
    """rms_norm(x.residual + x.x) * x.weight @ weight^T (+ bias) for one row, the norm computed in the GEMM; x.total
    gets the residual sum. Returns [1, N] of the activation dtype, or its split-K Partials where partial and K is
    split (as gmtool.kernels.small_m.linear)."""
    if weight.stride(-1) != 1:
        raise ValueError("weight rows must be contiguous (nn.Linear's layout)")
    n, k = weight.shape
    if tuple(x.shape) != (1, k) or x.dtype != weight.dtype:
        raise ValueError(
            f"a NormedRow {tuple(x.shape)} {x.dtype} does not fit weight {tuple(weight.shape)} {weight.dtype}"
        )
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias {tuple(bias.shape)} does not fit {n} outputs")
    if not norm_folds(k):
        raise ValueError(f"a NormedRow of {k} columns is not folded (at most {MAX_K})")
    xp, xb, x_split, x_bias = _source(x.x)
    head = (xp, xb, xp if x.ids is None else x.ids, x.residual, x.weight, x.total)  # ids unread without GATHER
    # GATHER's default left out: the same variant key as before it existed
    gather = {} if x.ids is None else {"GATHER": True}
    consts = dict(X_SPLIT=x_split, X_BIAS=x_bias, K_PAD=pow2(k), **gather)
    return _one_row_gemm(_NORM_GEMM, head, weight, bias, pdl, partial, (float(x.eps),), consts)


# Its preamble and K loop are _norm_gemm_kernel's, written out again: the two moved into @triton.jit helpers
# compiled to other PTX (index math after the wait instead of before it; sm_90, 2026-12-02), and the kernels as
# they are were the ones measured on the H200.
@triton.jit
def _silu_gemm_kernel(
    x_ptr,  # the gate/up product row [1, 2K], or its split-K partials [X_SPLIT, 1, 2K]
    xb_ptr,  # the partials' bias
    w_ptr,
    b_ptr,
    out_ptr,
    N,
    K,
    stride_wn,
    steps_per_split,
    X_SPLIT: tl.constexpr,
    X_BIAS: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr = 0,
    PF_LINES: tl.constexpr = 1,
    PF_STRIDE: tl.constexpr = 1,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    w_rows = w_ptr + tl.minimum(rn, N - 1).to(tl.int64)[:, None] * stride_wn
    k0 = pid_k * steps_per_split * BLOCK_K
    span = tl.minimum(steps_per_split * BLOCK_K, K - k0)
    if PDL != 0:  # as small_m's kernel: nothing but the weight prefetch before the wait
        small_m.prefetch_then_wait(w_rows, k0, span, K, BLOCK_K, PF_LINES, PF_STRIDE)
    dt = w_ptr.dtype.element_ty
    row = pid_n * 0
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kk in range(0, span, BLOCK_K):
        k = k0 + kk + rk
        if EVEN_K:
            k_ok = rk >= 0
            w = tl.load(w_rows + k[None, :])
        else:
            k_ok = k < K
            w = tl.load(w_rows + k[None, :], mask=k_ok[None, :], other=0.0)
        gate = _row_block(x_ptr, xb_ptr, row, 1, 2 * K, 2 * K, k, k_ok, dt, X_SPLIT, X_BIAS)
        up = _row_block(x_ptr, xb_ptr, row, 1, 2 * K, 2 * K, K + k, k_ok, dt, X_SPLIT, X_BIAS)
        y = (gate * tl.sigmoid(gate) * up).to(dt)  # as gmtool.kernels.layers' SiLU-and-mul kernel rounds it
        x = tl.where(rm[:, None] == 0, y[None, :], 0.0).to(dt)  # row 0 of the MMA's 16
        acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
    small_m.store_product(acc, out_ptr, b_ptr, rn, rm, pid_k, 1, N, rn < N, rm == 0, HAS_BIAS, PARTIAL)


_SILU_GEMM = FastLaunch(_silu_gemm_kernel)


def silu_linear(
    x: "torch.Tensor | Partials",
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    pdl: int = pdl_mod.Pdl.OFF,
    partial: bool = False,
):
    """silu(gate) * up @ weight^T (+ bias) for one row x = [gate | up] ([1, 2K], or the gate/up GEMM's split-K
    Partials), the SiLU-and-multiply computed where the GEMM reads its x tiles: gmtool.kernels.layers.silu_mul
    then small_m.linear, bit for bit, in one kernel. Returns as small_m.linear."""
    if weight.stride(-1) != 1:
        raise ValueError("weight rows must be contiguous (nn.Linear's layout)")
    n, k = weight.shape
    if tuple(x.shape) != (1, 2 * k) or x.dtype != weight.dtype:
        raise ValueError(f"a gate/up row {tuple(x.shape)} {x.dtype} does not fit weight {tuple(weight.shape)}")
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias {tuple(bias.shape)} does not fit {n} outputs")
    xp, xb, x_split, x_bias = _source(x)
    return _one_row_gemm(_SILU_GEMM, (xp, xb), weight, bias, pdl, partial, (), dict(X_SPLIT=x_split, X_BIAS=x_bias))


def _source(x: "torch.Tensor | Partials") -> tuple:
    """A one-row GEMM's input as its kernel reads it: (the row or the partials, their bias pointer, X_SPLIT,
    X_BIAS)."""
    if isinstance(x, Partials):
        return x.parts, x.parts if x.bias is None else x.bias, x.parts.shape[0], x.bias is not None
    x = x.contiguous()
    return x, x, 0, False


def _one_row_gemm(kernel, head: tuple, weight, bias, pdl: int, partial: bool, tail: tuple, consts: dict):
    """Launch a one-row GEMM kernel as kernel(*head, weight, bias, out, N, K, stride, steps, *tail, **consts) with
    small_m.pick's blocks; its product as small_m.linear returns it (Partials where partial and K is split)."""
    n, k = weight.shape
    cfg = small_m.pick(1, n, k, num_sms(weight.device), weight.element_size(), partial=partial)
    per, split = small_m.slices(cfg, k)
    b = bias.contiguous() if bias is not None else None
    out, dst = small_m.product_buffers(1, n, split, partial, weight.dtype, weight.device)
    kernel[(cdiv(n, cfg.block_n), split)](
        *head,
        weight,
        weight if b is None else b,  # unread without HAS_BIAS
        dst,
        n,
        k,
        weight.stride(0),
        per,
        *tail,
        **consts,
        **small_m.launch_options(cfg, weight, bias, split, pdl),
    )
    return small_m.finish_product(out, dst, b, weight.dtype, pdl)
