"""y = x @ W^T (+ bias) for a few rows of x (M <= 32, decode batches): a GEMM that streams the weight.

At small M a linear layer is a weight read: qwen3-0.6b's decode step reads 1.2 GB of weights and little else.
cuBLAS picks tiles made for large M there and reaches 0.4-2.1 TB/s on an H200 (copy: 4.2 TB/s). This kernel
gives each program a BLOCK_N slice of W's rows (and, where N alone keeps under a quarter of the SMs busy, a
slice of K: split-K), so every program streams a contiguous run of weight bytes while x (a few KB) sits in
cache. The product is computed swapped, W_tile @ x_tile^T, so the weight tile is the MMA's A operand in
its stored (K-contiguous) layout and the small M is the MMA's narrow side.

Split-K programs write fp32 partials; a second kernel sums them in a fixed order, adds the bias and rounds:
no atomics, so a result does not depend on the order programs ran in. Summing them in the GEMM instead (the
last program of each block to arrive, counted on a device counter) was bit-exact and removed 56 kernels from
a qwen3-0.6b decode step, but was no faster under PDL (H200, 2026-12-01, B=1 kv 1024: 0.997 and 1.000 ms
against 1.016 and 0.987 with the second kernel, measured alternately in one run): it was dropped. Where the
product's next reader is the residual stream's add+RMSNorm (o_proj and down_proj under --fuse), `partial=True`
hands it the partials (gmtool.kernels.common.Partials) and it sums them itself, in the same order with the same
rounding: no second kernel and nothing added to the GEMM. With the decode combine's loads made independent of
the kv length, the same step took 0.906 and 0.906 ms against 0.961 and 0.962 (H200, 2026-12-01, the two trees
alternated in one call; 281 graph nodes against 337).

SiLU-and-multiply in the gate/up GEMM's epilogue (each program streaming gate and up rows into two
accumulators: one kernel fewer a layer) was tried too (H200, 2026-12-01, qwen3-0.6b B=1 kv 1024, the two trees
alternated): 1.000 and 0.996 ms under --pdl against 0.978 and 0.975 without it; 1.109 and 1.000 against 1.124
and 1.003 without PDL. Slower where it matters: dropped. SiLU-and-mul in the down
projection's loads is gmtool.kernels.folded.silu_linear's, for one row.

Block sizes come from the shape (`pick`), never from autotuning: autotune would time kernels inside a CUDA
graph capture. Launchers allocate from shapes only and read no device value, so a call can be captured (after
one eager call compiled it).
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gmtool.kernels.common import SMALL_M_MAX as MAX_M
from gmtool.kernels import pdl as pdl_mod
from gmtool.kernels.common import Partials, cdiv, dot_precision, num_sms, pow2
from gmtool.kernels.launcher import FastLaunch
from gmtool.kernels.pdl import prefetch_l2

REDUCE_BLOCK = 1024


@dataclass(frozen=True)
class Config:
    block_m: int
    block_n: int
    block_k: int
    split: int  # K slices, each its own program; 1 stores the result directly
    num_warps: int = 4
    num_stages: int = 4


def _pick_narrow(n: int, k: int, sms: int, elem_bytes: int, partial: bool = False) -> Config:
    """M <= 16 (decode at B <= 16). Tuned on the H200 (gemm_bench --tune, 2026-12-01) at qwen3-0.6b's and
    llama-3.1-8b's shapes, the fastest were wide blocks (BLOCK_N 64) even where they leave SMs idle: 64 programs
    for qwen3-0.6b's QKV beat 256 of 16 rows (4.9 against 5.8 us). Below a third of the SMs (N = 1024: 16
    blocks), K is split until there are 64 programs, in BLOCK_K 128 steps (o_proj 5.3 against 6.3 us, down 5.9
    against 8.3, with the kernel summing partials counted; 256 where only that fits a slice in the pipeline); a
    long K is split too, to 32 steps at most per program (llama's down_proj, K 14,336: 32.3 against 40.8 us)."""
    block_n = min(64, pow2(n, 16))
    blocks = cdiv(n, block_n)
    few = blocks < sms // 3
    block_k = min(128 if few or blocks >= 2 * sms else 256, pow2(k, 16))
    steps = cdiv(k, block_k)
    split = 1
    # partial: the caller's next kernel sums the slices, so a split costs no second kernel: K is split until
    # the programs fill one wave. On the H200 (2026-12-01, tools/pdl_decode.py, qwen3-0.6b --pdl) this took B=1
    # decode from 0.908 to 0.891 ms with B=32 unchanged (the QKV GEMM: 64 -> 128 programs; at 96, gate/up is left).
    # Splitting further was slower in the same measurement: gate/up in 2 slices (192 programs) 0.933-0.934 ms,
    # o_proj and down in 8 (128 programs, their norm summing 8 partials) 0.929-0.946, against 0.890-0.892.
    wave = partial and not few
    while (few and blocks * split < 64) or (wave and blocks * split * 2 <= sms) or cdiv(steps, split) > 32:
        if cdiv(steps, split * 2) < 2:  # each slice at least two BLOCK_K steps
            break
        split *= 2
    # Where the slice is longer than the pipeline, BLOCK_K 256 if that puts the whole slice in flight at once. In
    # qwen3-0.6b's --fuse --small-m-gemm --pdl decode graph (H200, 2026-12-02, .diag/gapab.py, alternated in one
    # process) down_proj (K 3,072 in 4 slices: 6 steps of 128 against 4 stages, or 3 of 256) took B=1 kv 1,023
    # from 0.866 to 0.845 ms, B=32 unchanged; o_proj at 256 (its 4 steps of 128 already fit) was slower, 0.850
    # against 0.838, as were down at 256 in 2 or 3 slices (0.877, 0.853) or with 2 stages (0.880).
    if few and cdiv(steps, split) > _stages(block_n, block_k, elem_bytes):
        wide = min(256, pow2(k, 16))
        if cdiv(cdiv(k, wide), split) <= _stages(block_n, wide, elem_bytes):
            block_k, steps = wide, cdiv(k, wide)
    split = cdiv(steps, cdiv(steps, split))  # slices that hold any K
    return Config(16, block_n, block_k, split, num_stages=_stages(block_n, block_k, elem_bytes))


def _stages(block_n: int, block_k: int, elem_bytes: int, block_m: int = 16) -> int:
    """Pipeline stages whose buffers (a W tile and an x tile each) fit in an SM's shared memory, 2 to 4: fp32
    tiles are twice the bytes."""
    return max(2, min(4, (160 << 10) // ((block_n + block_m) * block_k * elem_bytes)))


@functools.lru_cache(maxsize=1024)  # a pure function of a few ints, asked once per projection per forward
def pick(m: int, n: int, k: int, sms: int, elem_bytes: int = 2, partial: bool = False) -> Config:
    """Block sizes by shape. DRAM stays busy when enough weight bytes are in flight (about latency x bandwidth:
    ~3 MB on an H200), spread over the SMs. Where N gives at least two programs per SM, the widest BLOCK_N that
    still does keeps each program's run of rows long. Where it gives fewer programs than SMs but at least a
    quarter (o_proj and down_proj of small models: N = hidden), each program keeps more bytes in flight instead
    (BLOCK_K 512): one kernel, no second one to sum partials, which would cost a graph node (~1 us) per use.
    Below a quarter, K is split until there are about two programs per SM, each slice at least two BLOCK_K steps.
    Up to 16 rows: _pick_narrow, tuned on the H200.
    """
    if m <= 16:
        return _pick_narrow(n, k, sms, elem_bytes, partial)
    block_m = 32  # tl.dot needs 16 on each side
    target = 2 * sms
    block_n = next((bn for bn in (64, 32) if cdiv(n, bn) >= target), 16)
    blocks = cdiv(n, block_n)
    block_k = 128 if block_n == 64 else 256 if blocks >= sms else 512
    block_k = min(block_k, pow2(k, 16))
    steps = cdiv(k, block_k)
    split = 1
    if 4 * blocks < sms and steps >= 4:
        per = max(2, cdiv(steps, cdiv(target, blocks)))  # K steps per slice
        split = cdiv(steps, per)
    return Config(block_m, block_n, block_k, split, num_stages=_stages(block_n, block_k, elem_bytes, block_m))


@triton.jit
def prefetch_then_wait(w_rows, k0, span, K, BLOCK_K: tl.constexpr, PF_LINES: tl.constexpr, PF_STRIDE: tl.constexpr):
    """A PDL GEMM's start: this program's W slice into L2 while the kernel before still runs (weights are
    read-only, so this may precede the wait), then the wait. Every 128-byte line of the slice, clamped to the row
    (no address past K); the step's last element too, whose line is a new one where a row does not start on a
    line. The next kernel may launch after the wait, in every mode: a GEMM ends a launch-early cascade
    (pdl.Pdl.EARLY)."""
    lines = tl.arange(0, PF_LINES) * PF_STRIDE
    for kk in range(0, span, BLOCK_K):
        prefetch_l2(w_rows + tl.minimum(k0 + kk + lines, K - 1)[None, :])
        prefetch_l2(w_rows + tl.minimum(k0 + kk + BLOCK_K - 1, K - 1))
    pdl_mod.enter(1)


@triton.jit
def store_product(
    acc, out_ptr, b_ptr, rn, rm, pid_k, M, N, n_mask, m_mask, HAS_BIAS: tl.constexpr, PARTIAL: tl.constexpr
):
    """The [BLOCK_N, BLOCK_M] accumulator (W tile @ x tile^T) as rows of the output: fp32 partials [split, M, N]
    where K is split (summed by _split_reduce_kernel or the next kernel), else + bias, rounded to out's dtype."""
    mask = n_mask[:, None] & m_mask[None, :]
    if PARTIAL:
        tl.store(out_ptr + (pid_k * M + rm[None, :]) * N + rn[:, None], acc, mask=mask)
    else:
        if HAS_BIAS:
            acc += tl.load(b_ptr + rn, mask=n_mask, other=0.0).to(tl.float32)[:, None]
        tl.store(out_ptr + rm[None, :] * N + rn[:, None], acc.to(out_ptr.dtype.element_ty), mask=mask)


# M is not specialized (1, multiples of 16): one compiled variant per shape and BLOCK_M serves every bucket
@triton.jit(do_not_specialize=["M"])
def _small_m_kernel(
    x_ptr,
    w_ptr,
    b_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    steps_per_split,
    HAS_BIAS: tl.constexpr,
    PARTIAL: tl.constexpr,
    EVEN_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    PRECISION: tl.constexpr,
    PDL: tl.constexpr = 0,  # gmtool.kernels.pdl.Pdl: 0 compiles no griddepcontrol and no prefetch
    PF_LINES: tl.constexpr = 1,  # with PDL: L2 lines per W row per BLOCK_K step, PF_STRIDE elements apart
    PF_STRIDE: tl.constexpr = 1,
):
    pid_n = tl.program_id(0)
    pid_k = tl.program_id(1)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rm = tl.arange(0, BLOCK_M)
    rk = tl.arange(0, BLOCK_K)
    n_mask = rn < N
    m_mask = rm < M
    # rows past N re-read row N-1 instead of being masked: the loads stay unpredicated along K
    w_rows = w_ptr + tl.minimum(rn, N - 1).to(tl.int64)[:, None] * stride_wn
    x_rows = x_ptr + rm[:, None] * stride_xm
    k0 = pid_k * steps_per_split * BLOCK_K  # a multiple of BLOCK_K the compiler can see: vector loads
    span = tl.minimum(steps_per_split * BLOCK_K, K - k0)  # the last slice may be shorter
    if PDL != 0:  # x (and the output's memory) belong to earlier kernels: nothing below runs before the wait
        prefetch_then_wait(w_rows, k0, span, K, BLOCK_K, PF_LINES, PF_STRIDE)
    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for kk in range(0, span, BLOCK_K):
        k = k0 + kk + rk
        if EVEN_K:
            w = tl.load(w_rows + k[None, :])
            x = tl.load(x_rows + k[None, :], mask=m_mask[:, None], other=0.0)
        else:
            k_mask = k < K
            w = tl.load(w_rows + k[None, :], mask=k_mask[None, :], other=0.0)
            x = tl.load(x_rows + k[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        acc = tl.dot(w, tl.trans(x), acc, input_precision=PRECISION)
    store_product(acc, out_ptr, b_ptr, rn, rm, pid_k, M, N, n_mask, m_mask, HAS_BIAS, PARTIAL)


@triton.jit(do_not_specialize=["M"])
def _split_reduce_kernel(
    p_ptr, b_ptr, out_ptr, M, N, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = 0
):
    pdl_mod.enter(PDL)  # the partials are the GEMM's: read after its end
    m = tl.program_id(0)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < N
    acc = tl.zeros((BLOCK,), dtype=tl.float32)
    for s in tl.static_range(SPLIT):  # a fixed order: the same sum on every run
        acc += tl.load(p_ptr + (s * M + m) * N + cols, mask=mask, other=0.0)
    if HAS_BIAS:
        acc += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + m * N + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


_SMALL_M, _SPLIT_REDUCE = FastLaunch(_small_m_kernel), FastLaunch(_split_reduce_kernel)  # no per-call binding


def linear(
    x: torch.Tensor,
    weight: torch.Tensor,
    bias: torch.Tensor | None = None,
    config: Config | None = None,
    pdl: int = pdl_mod.Pdl.OFF,
    partial: bool = False,
):
    """x [M, K] (M <= MAX_M), weight [N, K] as nn.Linear stores it, bias [N] or None -> contiguous [M, N] of
    x.dtype, accumulated in fp32. config: block sizes to use instead of pick's (tests, tuning). pdl: a
    gmtool.kernels.pdl.Pdl mode (the caller checked pdl.problem()): launched with PDL, W prefetched into L2
    before the wait for the kernel ahead. partial: where K is split, Partials instead (the reduce kernel not
    launched: the caller's next kernel sums them); an unsplit product is the tensor either way."""
    if x.stride(-1) != 1:
        x = x.contiguous()
    if weight.stride(-1) != 1:
        raise ValueError("weight rows must be contiguous (nn.Linear's layout)")
    m, k = x.shape
    n = weight.shape[0]
    if weight.shape[1] != k or weight.dtype != x.dtype or m > MAX_M:
        raise ValueError(
            f"x {tuple(x.shape)} {x.dtype} and weight {tuple(weight.shape)} {weight.dtype}: "
            f"need x [M <= {MAX_M}, K], weight [N, K] of one dtype"
        )
    if bias is not None and bias.shape != (n,):
        raise ValueError(f"bias {tuple(bias.shape)} does not fit {n} outputs")
    if m == 0 or n == 0:
        return torch.empty((m, n), dtype=x.dtype, device=x.device)
    if k == 0:
        out = torch.zeros((m, n), dtype=x.dtype, device=x.device)
        return out if bias is None else out.copy_(bias.expand(m, n))
    cfg = config or pick(m, n, k, num_sms(x.device), x.element_size(), partial=partial)
    if cfg.block_m < m:
        raise ValueError(f"block_m {cfg.block_m} is smaller than the {m} rows of x")
    per, split = slices(cfg, k)
    b = bias.contiguous() if bias is not None else None
    out, dst = product_buffers(m, n, split, partial, x.dtype, x.device)
    _SMALL_M[(cdiv(n, cfg.block_n), split)](
        x,
        weight,
        x if b is None else b,
        dst,
        m,
        n,
        k,
        x.stride(0),
        weight.stride(0),
        per,
        **launch_options(cfg, weight, bias, split, pdl),
    )
    return finish_product(out, dst, b, x.dtype, pdl)


def product_buffers(m: int, n: int, split: int, partial: bool, dtype, device) -> tuple:
    """(out, dst) for a GEMM kernel of split K slices: the [M, N] output (None where split and the caller takes the
    partials: it would be a graph pool's for nothing) and what the kernel writes, out itself or fp32 partials
    [split, M, N]."""
    out = None if split > 1 and partial else torch.empty((m, n), dtype=dtype, device=device)
    return out, out if split == 1 else torch.empty((split, m, n), dtype=torch.float32, device=device)


def finish_product(out, dst, bias, dtype, pdl: int):
    """What a launcher returns once its GEMM kernel wrote dst (product_buffers'): the product; or, where out is
    None, its Partials for the next kernel to sum; or the partials summed into out by the reduce kernel."""
    if dst is out:
        return out
    if out is None:
        return Partials(dst, bias, dtype)
    reduce_partials(dst, bias, out, pdl)
    return out


def slices(cfg: Config, k: int) -> tuple[int, int]:
    """(BLOCK_K steps per K slice, slices that hold any K): cfg.split rounded to what K fills."""
    per = cdiv(cdiv(k, cfg.block_k), cfg.split)
    return per, cdiv(cdiv(k, cfg.block_k), per)


def launch_options(cfg: Config, weight: torch.Tensor, bias, split: int, pdl: int) -> dict:
    """The GEMM kernels' constexprs and launch options for cfg over weight [N, K]."""
    k = weight.shape[1]
    lines = max(1, cfg.block_k * weight.element_size() // pdl_mod.L2_LINE)  # at least one address per step
    return dict(
        HAS_BIAS=bias is not None,
        PARTIAL=split > 1,
        EVEN_K=k % cfg.block_k == 0,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        PRECISION=dot_precision(weight.dtype),
        PDL=int(pdl),
        PF_LINES=lines,
        PF_STRIDE=cfg.block_k // lines,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        **pdl_mod.launch_options(pdl),
    )


def reduce_partials(parts: torch.Tensor, bias: torch.Tensor | None, out: torch.Tensor, pdl: int = pdl_mod.Pdl.OFF):
    """out [M, N] = the split-K partials [split, M, N] summed in a fixed order (+ bias), rounded to out's dtype."""
    split, m, n = parts.shape
    _SPLIT_REDUCE[(m, cdiv(n, REDUCE_BLOCK))](
        parts,
        parts if bias is None else bias,
        out,
        m,
        n,
        SPLIT=split,
        HAS_BIAS=bias is not None,
        BLOCK=REDUCE_BLOCK,
        PDL=int(pdl),
        num_warps=4,
        **pdl_mod.launch_options(pdl),
    )
