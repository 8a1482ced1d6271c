"""Varlen causal attention over packed tokens, K/V (cached prefix and new tokens) read from the paged cache.

Token i of sequence s sits at position kv_lens[s] - q_len_s + i and attends to kv positions <= its own;
the new tokens' K/V must already be in the cache (write_kv runs first). All per-request metadata (cu_q,
kv_lens, block_tables) is read from device buffers.

Two launch shapes, one kernel:
- `varlen_attention`: grid (num_seqs, cdiv(max_q_len, BLOCK_M), H); tiles beyond a sequence's q_len exit.
  Safe in a graph only while max_q_len is part of the graph's key.
- `varlen_attention_wide`: grid (num_tokens // BLOCK_M + num_seqs, 1, H), which depends on the bucket only.
  Sequence s owns the tiles from cu_q[s] // BLOCK_M + s on (at least cdiv(q_len_s, BLOCK_M) of them, since
  floor((c + q) / M) - floor(c / M) + 1 >= ceil(q / M)); a program finds its sequence by binary search.

Rows of padded tokens (cu_q[num_seqs] <= t < num_tokens) are written with zeros, so no stale or NaN rows
leak into the rest of the forward.

Layer options as in decode_attention: with a sliding window a tile reads only from its first row's window start
on; SOFTCAP caps the logits; learned sinks join each row's denominator; V may have its own head dim (DV).
"""

from __future__ import annotations

import triton
import triton.language as tl

from gmtool.kernels import VARLEN_BLOCK_M
from gmtool.kernels.common import LOG2E, NEG_INIT, cdiv, check_cache, dot_precision, pow2
from gmtool.kernels.jit_helpers import softcap_log2
from gmtool.kernels.launcher import BoundKernel

_NEG = tl.constexpr(NEG_INIT)
BLOCK_M = VARLEN_BLOCK_M
BLOCK_N = 64
NUM_WARPS = 4
NUM_STAGES = 2


# num_seqs follows the batch in a bound (piecewise) launch: no value of it may select another compiled variant
# the metadata's offsets in the input arena follow the bucket: no variant per alignment (see decode_attention)
@triton.jit(do_not_specialize=["num_seqs"], do_not_specialize_on_alignment=["cu_ptr", "lens_ptr", "bt_ptr"])
def _varlen_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    cu_ptr,
    lens_ptr,
    bt_ptr,
    sink_ptr,
    qk_scale,
    scale,
    num_tokens,
    num_seqs,
    stride_qt,
    stride_qh,
    stride_ot,
    stride_oh,
    stride_kblk,
    stride_kt,
    stride_kh,
    stride_vblk,
    stride_vt,
    stride_vh,
    stride_btb,
    stride_btn,
    G: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    DV: tl.constexpr,
    DV_PAD: tl.constexpr,
    PAGE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    WIDE: tl.constexpr,
    PREC: tl.constexpr,
    WINDOW: tl.constexpr,
    SOFTCAP: tl.constexpr,
    SINKS: tl.constexpr,
):
    h = tl.program_id(2)
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    dv = tl.arange(0, DV_PAD)
    dv_ok = dv < DV
    r = tl.arange(0, BLOCK_M)

    # Every program zeroes its stride of the padded tail first: the work is spread over the whole grid.
    worker = tl.program_id(0) * tl.num_programs(1) + tl.program_id(1)
    workers = tl.num_programs(0) * tl.num_programs(1)
    total = tl.load(cu_ptr + num_seqs)
    zeros = tl.zeros([BLOCK_M, DV_PAD], tl.float32).to(out_ptr.dtype.element_ty)
    for row0 in range(total + worker * BLOCK_M, num_tokens, workers * BLOCK_M):
        rows = row0 + r
        tl.store(
            out_ptr + rows[:, None] * stride_ot + h * stride_oh + dv[None, :],
            zeros,
            mask=(rows < num_tokens)[:, None] & dv_ok[None, :],
        )

    if WIDE:
        tile = tl.program_id(0)
        lo = tile * 0  # tensors from the start
        hi = lo + num_seqs - 1
        while lo < hi:  # largest s with cu_q[s] // BLOCK_M + s <= tile
            mid = (lo + hi + 1) // 2
            first = tl.load(cu_ptr + mid) // BLOCK_M + mid
            lo = tl.where(first <= tile, mid, lo)
            hi = tl.where(first <= tile, hi, mid - 1)
        s = lo
        m_blk = tile - (tl.load(cu_ptr + s) // BLOCK_M + s)
    else:
        s = tl.program_id(0)
        m_blk = tl.program_id(1)
    q_start = tl.load(cu_ptr + s)
    q_len = tl.load(cu_ptr + s + 1) - q_start
    if m_blk * BLOCK_M >= q_len:
        return

    kv_len = tl.load(lens_ptr + s)
    i = m_blk * BLOCK_M + r
    i_ok = i < q_len
    q_pos = kv_len - q_len + i
    q = tl.load(
        q_ptr + (q_start + i)[:, None] * stride_qt + h * stride_qh + d[None, :],
        mask=i_ok[:, None] & d_ok[None, :],
        other=0.0,
    )
    q = q.to(k_ptr.dtype.element_ty)

    m_i = tl.full([BLOCK_M], _NEG, tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, DV_PAD], tl.float32)
    # Causal: nothing past the last row's own position is needed.
    kv_hi = tl.minimum(kv_len, kv_len - q_len + tl.minimum((m_blk + 1) * BLOCK_M, q_len))
    kv_lo = kv_hi * 0
    if WINDOW > 0:  # nothing before the first row's window start either
        kv_lo = tl.maximum(kv_len - q_len + m_blk * BLOCK_M - WINDOW + 1, 0)
    bt_row = bt_ptr + s * stride_btb
    kvh = h // G
    for start in range(kv_lo, kv_hi, BLOCK_N):
        n = start + tl.arange(0, BLOCK_N)
        n_ok = n < kv_hi
        page = tl.load(bt_row + (n // PAGE) * stride_btn, mask=n_ok, other=0).to(tl.int64)
        tok = page * stride_kblk + (n % PAGE) * stride_kt + kvh * stride_kh
        k = tl.load(k_ptr + tok[:, None] + d[None, :], mask=n_ok[:, None] & d_ok[None, :], other=0.0)
        if SOFTCAP > 0:
            sc = softcap_log2(tl.dot(q, tl.trans(k), input_precision=PREC) * scale, SOFTCAP)
        else:
            sc = tl.dot(q, tl.trans(k), input_precision=PREC) * qk_scale
        seen = n_ok[None, :] & (n[None, :] <= q_pos[:, None])
        if WINDOW > 0:
            seen = seen & (n[None, :] > q_pos[:, None] - WINDOW)
        sc = tl.where(seen, sc, float("-inf"))
        m_new = tl.maximum(m_i, tl.max(sc, 1))
        alpha = tl.exp2(m_i - m_new)
        p = tl.exp2(sc - m_new[:, None])
        l_i = l_i * alpha + tl.sum(p, 1)
        vtok = page * stride_vblk + (n % PAGE) * stride_vt + kvh * stride_vh
        v = tl.load(v_ptr + vtok[:, None] + dv[None, :], mask=n_ok[:, None] & dv_ok[None, :], other=0.0)
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=PREC)
        m_i = m_new

    if SINKS:  # the sink's column joins each row's denominator (its value row is zero)
        l_i += tl.exp2(tl.load(sink_ptr + h).to(tl.float32) * 1.4426950408889634 - m_i)
    # A row with nothing to attend to (inconsistent metadata) gives zeros rather than NaN.
    o = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + (q_start + i)[:, None] * stride_ot + h * stride_oh + dv[None, :],
        o.to(out_ptr.dtype.element_ty),
        mask=i_ok[:, None] & dv_ok[None, :],
    )


def _arguments(
    q,
    k_cache,
    v_cache,
    cu_q,
    kv_lens,
    block_tables,
    num_seqs,
    scale,
    out,
    wide,
    block_m,
    block_n,
    window,
    softcap,
    sinks,
):
    """The shape checks, then the kernel's arguments: (out, positional, constexprs)."""
    check_cache(k_cache, v_cache)
    if q.stride(-1) != 1:
        q = q.contiguous()
    tokens, heads, dim = q.shape
    _, page, kv_heads, cache_dim = k_cache.shape
    dv = v_cache.shape[-1]
    if cache_dim != dim or heads % kv_heads:
        raise ValueError(f"q {tuple(q.shape)} does not fit a cache with {kv_heads} kv heads of dim {cache_dim}")
    if out is None:
        out = q.new_empty(tokens, heads, dv)
    elif out.shape != (tokens, heads, dv) or out.stride(-1) != 1:
        raise ValueError(f"out must be {(tokens, heads, dv)} with head_dim contiguous")
    args = (
        q,
        k_cache,
        v_cache,
        out,
        cu_q,
        kv_lens,
        block_tables,
        sinks if sinks is not None else kv_lens,
        scale * LOG2E,
        scale,
        tokens,
        num_seqs,
        q.stride(0),
        q.stride(1),
        out.stride(0),
        out.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
        block_tables.stride(0),
        block_tables.stride(1),
    )
    consts = dict(
        G=heads // kv_heads,
        D=dim,
        D_PAD=pow2(dim, 16),
        DV=dv,
        DV_PAD=pow2(dv, 16),
        PAGE=page,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        WIDE=wide,
        PREC=dot_precision(k_cache.dtype),
        WINDOW=window or 0,
        SOFTCAP=float(softcap or 0.0),
        SINKS=sinks is not None,
    )
    return out, args, consts


def _launch(
    q,
    k_cache,
    v_cache,
    cu_q,
    kv_lens,
    block_tables,
    num_seqs,
    scale,
    out,
    grid0,
    grid1,
    wide,
    block_m,
    block_n,
    num_warps,
    num_stages,
    window,
    softcap,
    sinks,
):
    out, args, consts = _arguments(
        q,
        k_cache,
        v_cache,
        cu_q,
        kv_lens,
        block_tables,
        num_seqs,
        scale,
        out,
        wide,
        block_m,
        block_n,
        window,
        softcap,
        sinks,
    )
    if num_seqs == 0 or q.shape[0] == 0:
        return out.zero_()
    _varlen_kernel[(grid0, grid1, q.shape[1])](*args, **consts, num_warps=num_warps, num_stages=num_stages)
    return out


def bind_varlen(
    q,
    k_cache,
    v_cache,
    cu_q,
    kv_lens,
    block_tables,
    num_seqs: int | None,
    scale,
    out,
    window: int | None = None,
    softcap: float | None = None,
    sinks=None,
) -> BoundKernel:
    """The kernel bound to a piecewise runner's tensors (q and out contiguous, shaped by the bucket).
    num_seqs given: the wide launch (grid fixed by the bucket, called with it alone); None: the planned launch,
    called with (num_seqs, m_tiles, heads) and num_seqs, both from the step (step_grid)."""
    if q.stride(-1) != 1:
        raise ValueError("a bound launch needs q with head_dim contiguous: it cannot copy q per call")
    wide = num_seqs is not None
    out, args, consts = _arguments(
        q,
        k_cache,
        v_cache,
        cu_q,
        kv_lens,
        block_tables,
        num_seqs or 1,
        scale,
        out,
        wide,
        BLOCK_M,
        BLOCK_N,
        window,
        softcap,
        sinks,
    )
    opts = dict(num_warps=NUM_WARPS, num_stages=NUM_STAGES)
    return BoundKernel(_varlen_kernel, args, consts, opts, varying=() if wide else ("num_seqs",))


def varlen_attention(
    q,
    k_cache,
    v_cache,
    cu_q,
    kv_lens,
    block_tables,
    num_seqs: int,
    max_q_len: int,
    scale,
    out=None,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
    num_warps: int = NUM_WARPS,
    num_stages: int = NUM_STAGES,
    window: int | None = None,
    softcap: float | None = None,
    sinks=None,
):
    """q [T, H, Dk] -> [T, H, Dv]; grid from (num_seqs, max_q_len): max_q_len must bound every q_len."""
    m_tiles = max(1, cdiv(max_q_len, block_m))
    return _launch(
        q,
        k_cache,
        v_cache,
        cu_q,
        kv_lens,
        block_tables,
        num_seqs,
        scale,
        out,
        num_seqs,
        m_tiles,
        False,
        block_m,
        block_n,
        num_warps,
        num_stages,
        window,
        softcap,
        sinks,
    )


def varlen_attention_wide(
    q,
    k_cache,
    v_cache,
    cu_q,
    kv_lens,
    block_tables,
    num_seqs: int,
    scale,
    out=None,
    block_m: int = BLOCK_M,
    block_n: int = BLOCK_N,
    num_warps: int = NUM_WARPS,
    num_stages: int = NUM_STAGES,
    window: int | None = None,
    softcap: float | None = None,
    sinks=None,
):
    """Like varlen_attention with a grid fixed by (num_tokens, num_seqs): any q_len mix replays correctly."""
    tiles = q.shape[0] // block_m + num_seqs
    return _launch(
        q,
        k_cache,
        v_cache,
        cu_q,
        kv_lens,
        block_tables,
        num_seqs,
        scale,
        out,
        tiles,
        1,
        True,
        block_m,
        block_n,
        num_warps,
        num_stages,
        window,
        softcap,
        sinks,
    )
