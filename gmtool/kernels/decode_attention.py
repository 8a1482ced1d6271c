"""Paged flash-decoding: one query token per sequence, K/V read through block tables.

The launch shape is a function of the bucket only (batch slots, kv heads, the block table width), so one
CUDA graph serves any decode batch that fits it: kv lengths and block tables are read from device buffers
at run time, and each program reads only the pages that cover its share of [0, kv_len).

Stage 1: grid (B, Hkv, num_splits). A program owns all G query heads of one kv head (so K/V are read once
per kv head, not G times) and one contiguous split of the sequence; online softmax in fp32, exp2 domain.
Stage 2: grid (B, H) combines the splits by log-sum-exp. With one split stage 1 writes the output itself. The
split count is the bucket's (from its longest possible sequence), so a short sequence leaves splits empty: those
programs return at once and the combine reads only the splits that held tokens.

Layer options (compile-time constants, static per layer): a sliding window reads only the last WINDOW tokens'
pages, the splits dividing the window rather than the whole sequence; SOFTCAP caps the logits; learned sinks
join the softmax's denominator once, where the splits are combined. V may have its own head dim (DV).

Tried and dropped (qwen3-0.6b --fuse --small-m-gemm --pdl, kv 1,023, H200, 2026-12-02, variants alternated in one
process): the last split of each kv head to finish combining the partials itself (an atomic count per sequence
and kv head, which that split resets; no combine kernel): B=1 0.898-0.903 ms against 0.847-0.848, B=32 2.479
against 2.302-2.304. A split's first block-table entries read beside kv_len rather than after it: B=1
0.851-0.853 against 0.845-0.848, B=32 2.481 against 2.310-2.312. 32-token splits and tiles: B=1 0.838-0.840
against 0.845-0.849, B=32 2.485-2.490 against 2.305-2.312.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from gmtool.kernels import pdl as pdl_mod
from gmtool.kernels.common import LOG2E, NEG_INIT, cdiv, check_cache, dot_precision, num_sms, pow2
from gmtool.kernels.jit_helpers import softcap_log2
from gmtool.kernels.launcher import BoundKernel, FastLaunch, KernelLaunch

_NEG = tl.constexpr(NEG_INIT)
BLOCK_N = 64  # tokens per iteration: several 16-token pages, so each step has enough bytes in flight
NUM_STAGES = 2
# Below this a split's fixed cost (q load, partial write, combine) dominates. 64 (one BLOCK_N tile a split):
# qwen3-0.6b's --fuse --small-m-gemm --pdl decode graph at B=1 kv 1024 took 1.004 ms against 1.039 at 128
# (H200, 2026-12-01, one process, alternating); B=32 unchanged (2.385 ms: its split count is set by the SMs).
# K/V prefetched into L2 before the PDL wait was tried there too: 7-14 us less at B=1, 300 us more at B=32.
MIN_SPLIT_TOKENS = 64
MAX_SPLITS = 64
# Programs per SM to aim for. Compiled for sm_90 at D=128 bf16 (triton 3.9), a program takes ~39 KB of
# shared memory (two pipeline stages of K and V tiles) and 80 registers a thread, so about 5 fit on an SM:
# 8 per SM keeps enough requests in flight to cover HBM latency, and the last, partial round of programs is
# a small part of the whole.
WAVES = 8


def choose_num_splits(batch: int, num_kv_heads: int, max_kv_len: int, sms: int) -> int:
    """Splits per sequence, from the bucket shape only (never from kv_lens), so a graph keeps its split."""
    want = cdiv(WAVES * sms, batch * num_kv_heads)
    useful = cdiv(max_kv_len, MIN_SPLIT_TOKENS)
    n = max(1, min(want, useful, MAX_SPLITS))
    # a power of two: few distinct shapes of work over a bucket list
    return 1 << (n.bit_length() - 1)


def combine_dims(programs: int, dv_pad: int, sms: int) -> int:
    """Output dims per combine program: 32 where a program per (sequence, head) leaves most SMs idle and the
    heads shared out 32 dims a program still fit on them, else whole heads. Every program reads all of its
    head's splits, for fewer dims each. qwen3-0.6b --fuse --small-m-gemm --pdl, 64 splits a kv head (max kv
    4,224), H200, 2026-12-02, .diag/splitrule.py, alternated in one process: B=1 kv 1,024 0.827 ms against
    0.835; 64 dims a program at B=4, 1.015 against 1.025, was left out: it is one more variant to compile in a
    cold capture; 32 dims at B=32 was slower (2.342 against 2.316 ms)."""
    narrow = min(32, dv_pad)
    return narrow if programs * (dv_pad // narrow) <= sms else dv_pad


def split_warps(group: int, d_pad: int) -> int:
    """The split kernel's warps: two where a kv head serves at most two q heads of up to 128 dims, else four.
    qwen3-0.6b (G 2, D 128) --fuse --small-m-gemm --pdl, max kv 4,224 (H200, 2026-12-02, .diag/warpab.py,
    graphs alternated in one process), kv 1,024: B=1 0.819-0.820 ms against 0.825-0.828, B=8 1.176 against
    1.209-1.212, B=32 2.233-2.237 against 2.319-2.322; kv 4,096: B=1 0.950 against 0.968. One warp was slower
    everywhere (0.910 ms at B=1, 2.755 at B=32). The kernel alone (.diag/attnwarps.py, the same day): at G 4 and 7
    (B=32 kv 4,096: 152.6 against 140.2 us, 158.6 against 89.1) and at D 192 and 256 (591.6 against 515.2 us,
    182.8 against 159.4) two warps were slower; at G 1, D 96 and G 8, D 64 the same. d_pad: the key head's
    padded dims (MLA's 192, with values of 128, takes four)."""
    return 2 if group <= 2 and d_pad <= 128 else 4


def combine_warps(dims: int, dv_pad: int) -> int:
    """The combine's warps: two where a program holds a whole head of up to 128 dims (qwen3-0.6b, with the split
    kernel at two warps, the same measurement as split_warps': B=4 1.000 ms against 1.019, B=8 1.156 against
    1.176, B=32 2.209 against 2.236), four where it holds 32 of a head's dims (B=1: two warps 0.823 against 0.819)
    or a wider head (not measured: a program's [splits, dims] tile over half the threads)."""
    return 2 if dims == dv_pad <= 128 else 4


# the split count is a run-time value (one compiled variant for every count; only SPLIT, one split or several,
# is a constant): as a constexpr each count the buckets chose (1, 2, 4 and 8 over the 35 default decode buckets
# at kv 1024) compiled its own variant of both kernels
# block tables and kv lengths sit in the input arena at offsets that follow the bucket (odd or even multiples of
# 8 bytes): specialized on their alignment they compiled a variant for batch 1 and one for even batches
@triton.jit(do_not_specialize=["num_splits"], do_not_specialize_on_alignment=["bt_ptr", "lens_ptr"])
def _decode_split_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    bt_ptr,
    lens_ptr,
    out_ptr,
    part_ptr,
    lse_ptr,
    sink_ptr,
    qk_scale,
    scale,
    stride_qb,
    stride_qh,
    stride_kblk,
    stride_kt,
    stride_kh,
    stride_vblk,
    stride_vt,
    stride_vh,
    stride_btb,
    stride_btn,
    stride_ob,
    stride_oh,
    num_splits,
    NUM_HEADS: tl.constexpr,
    G: tl.constexpr,
    G_PAD: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    DV: tl.constexpr,
    DV_PAD: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SPLIT: tl.constexpr,
    PREC: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
    PDL: tl.constexpr = 0,
    PRE_LENS: tl.constexpr = 0,
):
    # PRE_LENS (with PDL): kv_lens is the step's input, copied in before the graph's first kernel, and no kernel of
    # the chain writes it, so it is read before the wait, and the splits past a sequence's tokens end without
    # waiting for the kernel ahead. qwen3-0.6b --fuse --small-m-gemm --pdl, 64 splits a kv head (max kv 4,224),
    # H200, 2026-12-02, .diag/splitrule.py, alternated in one process: B=1 kv 1,024 0.831 ms against 0.842, kv
    # 4,096 0.967 against 0.971, B=8 1.204 against 1.210, B=32 unchanged; at kv 16,384 (all 64 splits hold
    # tokens) 1.322 against 1.314. The combine doing the same (only the splits that held tokens read, after the
    # wait): slower, B=1 0.859 against 0.842.
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    if not PRE_LENS:
        pdl_mod.enter(PDL)  # q, the cache and kv_lens are earlier kernels' writes
    kv_len = tl.load(lens_ptr + b)
    first, per_split = _split_span(kv_len, num_splits, WINDOW, BLOCK_N)
    lo = first + split * per_split
    hi = tl.minimum(lo + per_split, kv_len)
    if SPLIT:
        # past this sequence's tokens: the combine reads only the splits that hold some. Under PRE_LENS split 0
        # goes on to the wait even so: the kernel still ends only after the one ahead, which the chain relies on.
        if lo >= hi and split >= PRE_LENS:
            return
    if PRE_LENS:
        pdl_mod.enter(PDL)  # q and the cache are earlier kernels' writes

    g = tl.arange(0, G_PAD)
    d = tl.arange(0, D_PAD)
    dv = tl.arange(0, DV_PAD)
    g_ok = g < G
    d_ok = d < D
    dv_ok = dv < DV
    heads = kvh * G + g
    q = tl.load(
        q_ptr + b * stride_qb + heads[:, None] * stride_qh + d[None, :], mask=g_ok[:, None] & d_ok[None, :], other=0.0
    )
    q = q.to(k_ptr.dtype.element_ty)

    m_i = tl.full([G_PAD], _NEG, tl.float32)
    l_i = tl.zeros([G_PAD], tl.float32)
    acc = tl.zeros([G_PAD, DV_PAD], tl.float32)
    bt_row = bt_ptr + b * stride_btb
    for start in range(lo, hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < hi
        page = tl.load(bt_row + (n // PAGE) * stride_btn, mask=n_ok, other=0).to(tl.int64)
        tok = page * stride_kblk + (n % PAGE) * stride_kt + kvh * stride_kh
        k = tl.load(k_ptr + tok[:, None] + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        if SOFTCAP > 0:
            s = softcap_log2(tl.dot(q, tl.trans(k), input_precision=PREC) * scale, SOFTCAP)
        else:
            s = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        s = tl.where(n_ok[None, :], s, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(s, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(s - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        # Masked V rows must be zeros, not whatever the page holds: 0 * NaN would poison the tile.
        vtok = page * stride_vblk + (n % PAGE) * stride_vt + kvh * stride_vh
        v = tl.load(v_ptr + vtok[:, None] + dv[None, :], mask=n_ok[:, None] & dv_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new

    # An empty split (or kv_len == 0) has l == 0 and acc == 0: it contributes zeros, never NaN.
    has = l_i > 0
    out_mask = g_ok[:, None] & dv_ok[None, :]
    if not SPLIT:
        total = l_i
        if SINKS:  # the sink's column joins the denominator (its value row is zero)
            total += tl.exp2(tl.load(sink_ptr + heads, mask=g_ok, other=0.0).to(tl.float32) * 1.4426950408889634 - m_i)
        o = acc / tl.where(total > 0, total, 1.0)[:, None]
        tl.store(
            out_ptr + b * stride_ob + heads[:, None] * stride_oh + dv[None, :],
            o.to(out_ptr.dtype.element_ty),
            mask=out_mask,
        )
    else:
        o = acc / tl.where(has, l_i, 1.0)[:, None]
        row = (b * NUM_HEADS + heads) * num_splits + split
        tl.store(part_ptr + row[:, None] * DV + dv[None, :], o, mask=out_mask)
        tl.store(lse_ptr + row, tl.where(has, m_i + tl.log2(tl.where(has, l_i, 1.0)), float("-inf")), mask=g_ok)


@triton.jit
def _split_span(kv_len, num_splits, WINDOW: tl.constexpr, BLOCK_N: tl.constexpr):
    """(the first token a sequence's query sees, tokens per split): the splits divide what the query sees, in
    whole tiles, so a short sequence fills the first few splits and leaves the rest empty."""
    first = kv_len * 0
    if WINDOW > 0:
        first = tl.maximum(kv_len - WINDOW, 0)
    return first, tl.cdiv(tl.cdiv(kv_len - first, num_splits), BLOCK_N) * BLOCK_N


@triton.jit(do_not_specialize=["num_splits"], do_not_specialize_on_alignment=["lens_ptr"])
def _combine_kernel(
    part_ptr,
    lse_ptr,
    out_ptr,
    sink_ptr,
    lens_ptr,
    stride_ob,
    stride_oh,
    num_splits,
    NUM_HEADS: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    S_PAD: tl.constexpr,
    SINKS: tl.constexpr,
    WINDOW: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DC: tl.constexpr,  # output dims a program (combine_dims)
    PDL: tl.constexpr = 0,
):
    pdl_mod.enter(PDL)  # the partials are the split kernel's
    b = tl.program_id(0)
    h = tl.program_id(1)
    s = tl.arange(0, S_PAD)
    d = tl.program_id(2) * DC + tl.arange(0, DC)
    # Only the splits that held tokens wrote partials (the split kernel's span, again from kv_lens). The loads
    # do not wait for kv_len: every split of the count is read at once, and what the empty ones hold (stale, or
    # never written) is masked after, so the program makes one trip to memory, not two.
    kv_len = tl.load(lens_ptr + b)
    d_ok = d < D
    row = (b * NUM_HEADS + h) * num_splits + s
    lse = tl.load(lse_ptr + row, mask=s < num_splits, other=float("-inf"))
    o = tl.load(part_ptr + row[:, None] * D + d[None, :], mask=(s < num_splits)[:, None] & d_ok[None, :], other=0.0)
    first, per_split = _split_span(kv_len, num_splits, WINDOW, BLOCK_N)
    s_ok = (s < num_splits) & (s * per_split < kv_len - first)
    lse = tl.where(s_ok, lse, float("-inf"))
    o = tl.where(s_ok[:, None], o, 0.0)  # never 0 * NaN: an unwritten partial may hold anything
    top = tl.max(lse, 0)
    top = tl.where(top == float("-inf"), 0.0, top)  # every split empty: weights become 0, output 0
    w = tl.exp2(lse - top)
    total = tl.sum(w, 0)
    if SINKS:  # once per head, not per split
        total += tl.exp2(tl.load(sink_ptr + h).to(tl.float32) * 1.4426950408889634 - top)
    res = tl.sum(o * w[:, None], 0) / tl.where(total > 0, total, 1.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + d, res.to(out_ptr.dtype.element_ty), mask=d_ok)


def _arguments(
    q, k_cache, v_cache, block_tables, kv_lens, scale, num_splits, out, block_n, window, softcap, sinks, scratch=None
):
    """The shape checks, then both kernels' arguments: (out, the split kernel's (grid, positional, constexprs), the
    combine kernel's or None). The split partials have bucket-only shapes: fresh ones, or scratch(role, numel)'s."""
    check_cache(k_cache, v_cache)
    if q.stride(-1) != 1:
        q = q.contiguous()
    batch, heads, dim = q.shape
    _, page, kv_heads, cache_dim = k_cache.shape
    dv = v_cache.shape[-1]
    if cache_dim != dim or heads % kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit a cache with {kv_heads} kv heads of dim {cache_dim}")
    group = heads // kv_heads
    if num_splits is None:
        seen = block_tables.shape[1] * page if window is None else min(window, block_tables.shape[1] * page)
        num_splits = choose_num_splits(batch, kv_heads, seen, num_sms(q.device))
    if not 1 <= num_splits <= MAX_SPLITS:  # the combine reads MAX_SPLITS partials at most
        raise ValueError(f"num_splits {num_splits}: 1 to {MAX_SPLITS}")
    if out is None:
        out = q.new_empty(batch, heads, dv)
    elif out.shape != (batch, heads, dv) or out.stride(-1) != 1:
        raise ValueError(f"out must be {(batch, heads, dv)} with head_dim contiguous")
    dv_pad = pow2(dv, 16)
    if num_splits > 1:
        scratch = scratch or (lambda role, n: torch.empty(n, dtype=torch.float32, device=q.device))
        part = scratch("part", batch * heads * num_splits * dv)
        lse = scratch("lse", batch * heads * num_splits)
    else:
        part = lse = out  # unused by the one-split variant
    sink_arg = sinks if sinks is not None else lse
    split = (
        (batch, kv_heads, num_splits),
        (
            q,
            k_cache,
            v_cache,
            block_tables,
            kv_lens,
            out,
            part,
            lse,
            sink_arg,
            scale * LOG2E,
            scale,
            q.stride(0),
            q.stride(1),
            k_cache.stride(0),
            k_cache.stride(1),
            k_cache.stride(2),
            v_cache.stride(0),
            v_cache.stride(1),
            v_cache.stride(2),
            block_tables.stride(0),
            block_tables.stride(1),
            out.stride(0),
            out.stride(1),
            num_splits,
        ),
        dict(
            NUM_HEADS=heads,
            G=group,
            G_PAD=pow2(group, 16),
            D=dim,
            D_PAD=pow2(dim, 16),
            DV=dv,
            DV_PAD=dv_pad,
            PAGE=page,
            BLOCK_N=block_n,
            SPLIT=num_splits > 1,
            PREC=dot_precision(k_cache.dtype),
            WINDOW=window or 0,
            SOFTCAP=float(softcap or 0.0),
            SINKS=sinks is not None,
            PDL=0,  # decode_attention sets its mode; bound (piecewise) runners launch plainly
            PRE_LENS=0,
        ),
    )
    combine = None
    if num_splits > 1:
        dc = combine_dims(batch * heads, dv_pad, num_sms(q.device))
        combine = (
            (batch, heads, dv_pad // dc),
            (part, lse, out, sink_arg, kv_lens, out.stride(0), out.stride(1), num_splits),
            dict(
                NUM_HEADS=heads,
                D=dv,
                D_PAD=dv_pad,
                S_PAD=pow2(MAX_SPLITS),  # one variant for every split count: past the count, masked
                SINKS=sinks is not None,
                WINDOW=window or 0,
                BLOCK_N=block_n,
                PDL=0,
                DC=dc,
            ),
        )
    return out, split, combine


_DECODE_SPLIT, _COMBINE = FastLaunch(_decode_split_kernel), FastLaunch(_combine_kernel)  # no per-call binding


def decode_attention(
    q,
    k_cache,
    v_cache,
    block_tables,
    kv_lens,
    scale,
    num_splits=None,
    out=None,
    block_n: int = BLOCK_N,
    num_warps: int | None = None,
    num_stages: int = NUM_STAGES,
    window: int | None = None,
    softcap: float | None = None,
    sinks=None,
    pdl: int | None = None,
    scratch=None,
    pre_lens: bool | None = None,
):
    """q [B, H, Dk] -> [B, H, Dv]; sequence b attends to its first kv_lens[b] tokens via block_tables[b], the
    last `window` of them with a window; softcap caps the logits; sinks [H] are per-head sink logits.

    kv_lens[b] == 0 (a padded slot) gives zeros. Buffers allocated here have bucket-only shapes, so the
    call can be captured in a CUDA graph (after one eager call has compiled the kernels). pdl: a
    gmtool.kernels.pdl.Pdl mode for both kernels; None: the caller's scope (pdl.launches). scratch(role, numel):
    the split partials' buffers ("part", "lse"; default: fresh ones). pre_lens: read kv_lens before the PDL wait
    (None: whenever PDL is on; the interpreter tests take that path without PDL).
    """
    out, (grid, args, consts), combine = _arguments(
        q, k_cache, v_cache, block_tables, kv_lens, scale, num_splits, out, block_n, window, softcap, sinks, scratch
    )
    mode = pdl_mod.current() if pdl is None else pdl
    on = dict(PDL=int(mode), PRE_LENS=int(bool(mode) if pre_lens is None else pre_lens))
    warps = num_warps or split_warps(consts["G"], consts["D_PAD"])
    _DECODE_SPLIT[grid](*args, **(consts | on), num_warps=warps, num_stages=num_stages, **pdl_mod.launch_options(mode))
    if combine is not None:
        grid, args, consts = combine
        # Under EARLY too, the combine lets the kernel after it (o_proj's GEMM) launch only once its own wait has
        # returned: o_proj's programs and their weight prefetch then stay off the SMs and DRAM while the split
        # kernel reads K/V. qwen3-0.6b --fuse --small-m-gemm --pdl, kv 1,023 (H200, 2026-12-02, .diag/modeab.py,
        # graphs alternated in one process): B=1 0.838-0.840 ms against 0.846-0.849, B=8 1.208-1.212 against
        # 1.232-1.234. The split kernel doing the same: B=1 0.833-0.834 alone but 0.840 with the combine's, B=8
        # no gain; the QK-norm+RoPE or SiLU kernels: slower (0.854-0.874 ms at B=1).
        late = min(int(mode), pdl_mod.Pdl.AFTER_WAIT)
        warps = combine_warps(consts["DC"], consts["D_PAD"])
        _COMBINE[grid](*args, **(consts | {"PDL": late}), num_warps=warps, **pdl_mod.launch_options(mode))
    return out


def split_scratch_numels(batches, heads: int, kv_heads: int, dv: int, seen_tokens: int, sms: int) -> tuple[int, int]:
    """The largest split partials ("part", "lse" element counts) a decode launch of any of these batch sizes
    needs: splits shrink as batches grow, so the product stays near WAVES * sms / kv_heads rows."""
    rows = [b * heads * s for b in batches if (s := choose_num_splits(b, kv_heads, seen_tokens, sms)) > 1]
    return (max(rows) * dv, max(rows)) if rows else (0, 0)


class BoundDecode:
    """Decode attention bound to a piecewise runner's tensors: its grids depend on the bucket only, so a call
    takes nothing. scratch(role, numel) gives the split partials ("part", "lse"): runners launch one after
    the other on one stream, so every runner of a shape can share one pair."""

    __slots__ = ("split", "split_grid", "combine", "combine_grid")

    def __init__(
        self, q, k_cache, v_cache, block_tables, kv_lens, scale, out, scratch, window=None, softcap=None, sinks=None
    ):
        if q.stride(-1) != 1:
            raise ValueError("a bound launch needs q with head_dim contiguous: it cannot copy q per call")
        _, (self.split_grid, args, consts), combine = _arguments(
            q, k_cache, v_cache, block_tables, kv_lens, scale, None, out, BLOCK_N, window, softcap, sinks, scratch
        )
        opts = dict(num_warps=split_warps(consts["G"], consts["D_PAD"]), num_stages=NUM_STAGES)
        self.split = BoundKernel(_decode_split_kernel, args, consts, opts)
        self.combine = None
        if combine is not None:
            self.combine_grid, args, consts = combine
            warps = combine_warps(consts["DC"], consts["D_PAD"])
            self.combine = BoundKernel(_combine_kernel, args, consts, dict(num_warps=warps))

    @property
    def paths(self) -> tuple[str, ...]:
        return (self.split.path,) if self.combine is None else (self.split.path, self.combine.path)

    def native_launches(self, ctx) -> list[KernelLaunch]:
        out = [KernelLaunch(self.split, self.split_grid)]
        return out if self.combine is None else out + [KernelLaunch(self.combine, self.combine_grid)]

    def __call__(self) -> None:
        self.split(self.split_grid)
        if self.combine is not None:
            self.combine(self.combine_grid)
