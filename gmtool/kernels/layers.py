"""Fused element-wise decoder-layer ops: RMSNorm (alone or after the residual add), per-head q/k RMSNorm +
RoPE, SiLU-and-multiply.

Each launcher allocates its output from the input shapes only and never reads device values on the host,
so a call can be captured in a CUDA graph (after one eager call has compiled the kernel). pdl: a
gmtool.kernels.pdl.Pdl mode: each kernel's first statement then waits for the kernel before it and lets the
next one (a GEMM that prefetches its weight) launch; off, the kernels compile as they did without it. Math is fp32,
with the roundings Hugging Face's modules make kept where they change the result (the normalized value
is rounded to the activation dtype before the weight multiply). gmtool.model.layers_ref holds the torch
references these are checked against.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from gmtool.kernels import pdl as pdl_mod
from gmtool.kernels.common import Partials, cdiv, check_cache, pow2
from gmtool.kernels.launcher import FastLaunch

SILU_BLOCK = 1024


@triton.jit
def _row_block(x_ptr, b_ptr, row, M, stride_x, N, cols, mask, dt, SPLIT: tl.constexpr, HAS_BIAS: tl.constexpr):
    """Elements cols of row `row` of a GEMM's product, fp32: the rows themselves (SPLIT 0, stride_x apart), or its
    split-K partials [SPLIT, M, N] summed as gmtool.kernels.small_m's reduce kernel would (the same order, the
    bias after, rounded to dt): the same bits either way."""
    if SPLIT > 0:
        acc = tl.zeros(cols.shape, dtype=tl.float32)
        for s in tl.static_range(SPLIT):
            acc += tl.load(x_ptr + (s * M + row) * N + cols, mask=mask, other=0.0)
        if HAS_BIAS:
            acc += tl.load(b_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        return acc.to(dt).to(tl.float32)
    return tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)


@triton.jit
def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, stride_x, eps, H: tl.constexpr, BLOCK: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_mod.enter(PDL)
    row = tl.program_id(0).to(tl.int64)  # int64: row * stride can pass 2**31 at long prefills
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    y = x * tl.rsqrt(tl.sum(x * x, 0) / H + eps)
    y = y.to(out_ptr.dtype.element_ty).to(tl.float32)  # HF rounds before the weight multiply
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * H + cols, (y * w).to(out_ptr.dtype.element_ty), mask=mask)


# M (the rows, read only with SPLIT) is not specialized: one variant serves every bucket
@triton.jit(do_not_specialize=["M"])
def _add_rms_norm_kernel(
    x_ptr,
    r_ptr,
    w_ptr,
    out_ptr,
    sum_ptr,
    b_ptr,
    M,
    stride_x,
    stride_r,
    eps,
    H: tl.constexpr,
    BLOCK: tl.constexpr,
    SPLIT: tl.constexpr = 0,  # x: a small-M GEMM's split-K partials [SPLIT, M, H] fp32 (0: x is the rows)
    HAS_BIAS: tl.constexpr = False,  # with SPLIT: the GEMM's bias, added after the partials
    PDL: tl.constexpr = 0,
):
    pdl_mod.enter(PDL)
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK)
    mask = cols < H
    dt = out_ptr.dtype.element_ty
    x = _row_block(x_ptr, b_ptr, row, M, stride_x, H, cols, mask, dt, SPLIT, HAS_BIAS)
    r = tl.load(r_ptr + row * stride_r + cols, mask=mask, other=0.0).to(tl.float32)
    s = (x + r).to(dt)  # HF adds in the activation dtype; the norm reads the rounded sum
    tl.store(sum_ptr + row * H + cols, s, mask=mask)
    s = s.to(tl.float32)
    y = s * tl.rsqrt(tl.sum(s * s, 0) / H + eps)
    y = y.to(dt).to(tl.float32)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * H + cols, (y * w).to(dt), mask=mask)


@triton.jit
def _rope_row(cos_ptr, sin_ptr, row, stride_cos, stride_sin, i, mask, HALF: tl.constexpr):
    """Row row of cos and sin, each as its two halves (fp32)."""
    c1 = tl.load(cos_ptr + row * stride_cos + i, mask=mask, other=0.0).to(tl.float32)
    c2 = tl.load(cos_ptr + row * stride_cos + HALF + i, mask=mask, other=0.0).to(tl.float32)
    s1 = tl.load(sin_ptr + row * stride_sin + i, mask=mask, other=0.0).to(tl.float32)
    s2 = tl.load(sin_ptr + row * stride_sin + HALF + i, mask=mask, other=0.0).to(tl.float32)
    return c1, c2, s1, s2


@triton.jit(do_not_specialize=["M"])
def _qk_norm_rope_kernel(
    qkv_ptr,
    b_ptr,
    M,
    cos_ptr,
    sin_ptr,
    qw_ptr,
    kw_ptr,
    q_ptr,
    k_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    pos_ptr,  # ROPE_ROWS: each token's position, its row of the cos/sin tables
    stride_t,
    stride_cos,
    stride_sin,
    stride_kblk,
    stride_kt,
    stride_kh,
    stride_vblk,
    stride_vt,
    stride_vh,
    eps,
    HQ: tl.constexpr,
    HKV: tl.constexpr,
    HALF: tl.constexpr,
    HALF_PAD: tl.constexpr,
    NORM: tl.constexpr,
    PAGE: tl.constexpr = 1,
    WRITE_KV: tl.constexpr = False,  # k and v go to the paged cache at the token's slot (no k tensor)
    SPLIT: tl.constexpr = 0,  # qkv: the QKV GEMM's split-K partials [SPLIT, M, (HQ + 2 HKV) D] (0: the rows)
    HAS_BIAS: tl.constexpr = False,
    PDL: tl.constexpr = 0,
    ROPE_ROWS: tl.constexpr = False,  # cos/sin: RoPE tables [positions, D], read at each token's position
):
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    D: tl.constexpr = 2 * HALF
    i = tl.arange(0, HALF_PAD)
    mask = i < HALF
    if h < HQ:
        w_ptr = qw_ptr
    else:
        w_ptr = kw_ptr
    slot = t * 0
    if ROPE_ROWS:
        # What no kernel before writes is read ahead of the wait: the step's positions and slots (copied in
        # before the graph's first kernel, as the decode split kernel's kv_lens), the RoPE table and the norm's
        # weight. EARLY's trigger comes first: behind these loads it held the next kernel back (B=1 kv 1,024
        # 0.812-0.815 ms against 0.793-0.795 with it first; see gmtool.kernels.pdl).
        pdl_mod.trigger_early(PDL)
        row = tl.load(pos_ptr + t).to(tl.int64)
        c1, c2, s1, s2 = _rope_row(cos_ptr, sin_ptr, row, stride_cos, stride_sin, i, mask, HALF)
        if WRITE_KV:
            slot = tl.load(slot_ptr + t).to(tl.int64)
        if NORM:
            w1 = tl.load(w_ptr + i, mask=mask, other=0.0).to(tl.float32)
            w2 = tl.load(w_ptr + HALF + i, mask=mask, other=0.0).to(tl.float32)
        pdl_mod.wait(PDL)
    else:
        pdl_mod.enter(PDL)
    # q, k and v heads sit back to back in the qkv row, so head h's slice is at h * D for all three.
    W: tl.constexpr = (HQ + 2 * HKV) * D
    x1 = _row_block(qkv_ptr, b_ptr, t, M, stride_t, W, h * D + i, mask, q_ptr.dtype.element_ty, SPLIT, HAS_BIAS)
    x2 = _row_block(qkv_ptr, b_ptr, t, M, stride_t, W, h * D + HALF + i, mask, q_ptr.dtype.element_ty, SPLIT, HAS_BIAS)
    written = mask
    if WRITE_KV:
        if not ROPE_ROWS:
            slot = tl.load(slot_ptr + t).to(tl.int64)
        written = mask & ((slot + i * 0) >= 0)  # a block, as the interpreter's masks must be
        if h >= HQ + HKV:  # a v head (grid HQ + 2 HKV): into the cache as it is
            hv = h - HQ - HKV
            vdst = vc_ptr + (slot // PAGE) * stride_vblk + (slot % PAGE) * stride_vt + hv * stride_vh
            vt = vc_ptr.dtype.element_ty
            tl.store(vdst + i, x1.to(vt), mask=written)
            tl.store(vdst + HALF + i, x2.to(vt), mask=written)
            return
    dt = q_ptr.dtype.element_ty
    if NORM:
        r = tl.rsqrt((tl.sum(x1 * x1, 0) + tl.sum(x2 * x2, 0)) / D + eps)
        if not ROPE_ROWS:
            w1 = tl.load(w_ptr + i, mask=mask, other=0.0).to(tl.float32)
            w2 = tl.load(w_ptr + HALF + i, mask=mask, other=0.0).to(tl.float32)
        # HF rounds twice here (normalized value, then the weighted norm output) before RoPE sees it.
        x1 = ((x1 * r).to(dt).to(tl.float32) * w1).to(dt).to(tl.float32)
        x2 = ((x2 * r).to(dt).to(tl.float32) * w2).to(dt).to(tl.float32)
    if not ROPE_ROWS:  # cos/sin: the step's gathered rows, a kernel's output
        c1, c2, s1, s2 = _rope_row(cos_ptr, sin_ptr, t, stride_cos, stride_sin, i, mask, HALF)
    o1 = (x1 * c1 - x2 * s1).to(dt)
    o2 = (x2 * c2 + x1 * s2).to(dt)
    if h < HQ:
        dst = q_ptr + t * (HQ * D) + h * D
        tl.store(dst + i, o1, mask=mask)
        tl.store(dst + HALF + i, o2, mask=mask)
    elif WRITE_KV:  # as write_kv: a negative slot is left out; k rounded as the k tensor was, then cast
        kdst = kc_ptr + (slot // PAGE) * stride_kblk + (slot % PAGE) * stride_kt + (h - HQ) * stride_kh
        kt = kc_ptr.dtype.element_ty
        tl.store(kdst + i, o1.to(kt), mask=written)
        tl.store(kdst + HALF + i, o2.to(kt), mask=written)
    else:
        dst = k_ptr + t * (HKV * D) + (h - HQ) * D
        tl.store(dst + i, o1, mask=mask)
        tl.store(dst + HALF + i, o2, mask=mask)


@triton.jit(do_not_specialize=["M"])
def _silu_mul_kernel(
    x_ptr,
    out_ptr,
    b_ptr,
    M,
    stride_x,
    I: tl.constexpr,  # noqa: E741 (I: the intermediate size, as in the papers)
    BLOCK: tl.constexpr,
    SPLIT: tl.constexpr = 0,  # x: the gate/up GEMM's split-K partials [SPLIT, M, 2I] (0: x is the rows)
    HAS_BIAS: tl.constexpr = False,
    PDL: tl.constexpr = 0,
):
    pdl_mod.enter(PDL)
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < I
    dt = out_ptr.dtype.element_ty
    gate = _row_block(x_ptr, b_ptr, t, M, stride_x, 2 * I, cols, mask, dt, SPLIT, HAS_BIAS)
    up = _row_block(x_ptr, b_ptr, t, M, stride_x, 2 * I, I + cols, mask, dt, SPLIT, HAS_BIAS)
    tl.store(out_ptr + t * I + cols, (gate * tl.sigmoid(gate) * up).to(out_ptr.dtype.element_ty), mask=mask)


# launched without Triton's per-call binding once a variant is known (gmtool.kernels.launcher.FastLaunch)
_RMS_NORM, _ADD_RMS_NORM = FastLaunch(_rms_norm_kernel), FastLaunch(_add_rms_norm_kernel)
_QK_NORM_ROPE, _SILU_MUL = FastLaunch(_qk_norm_rope_kernel), FastLaunch(_silu_mul_kernel)


def _unit_last(x: torch.Tensor) -> torch.Tensor:
    # Rows may be strided views (a slice of a fused projection); elements within a row must be adjacent.
    return x if x.stride(-1) == 1 else x.contiguous()


@dataclass(frozen=True)
class _Source:
    """A kernel's input rows as _row_block reads them: a tensor, or a GEMM's split-K Partials."""

    ptr: torch.Tensor  # the rows, or the partials [split, M, N]
    bias: torch.Tensor  # the partials' bias (a placeholder where there is none)
    stride: int  # between rows (the tensor's)
    split: int  # 0: rows
    has_bias: bool
    shape: tuple
    dtype: torch.dtype

    @classmethod
    def of(cls, x: "torch.Tensor | Partials") -> "_Source":
        if isinstance(x, Partials):
            bias = x.parts if x.bias is None else x.bias
            return cls(x.parts, bias, x.shape[1], x.parts.shape[0], x.bias is not None, tuple(x.shape), x.dtype)
        x = _unit_last(x)
        return cls(x, x, x.stride(0), 0, False, tuple(x.shape), x.dtype)

    def args(self) -> tuple:
        """(x_ptr, b_ptr, M) as the kernels take them; M is the rows (read only with partials)."""
        return self.ptr, self.bias, self.shape[0]

    def consts(self) -> dict:
        return {"SPLIT": self.split, "HAS_BIAS": self.has_bias}


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float, pdl: int = pdl_mod.Pdl.OFF) -> torch.Tensor:
    """x [N, H] -> contiguous [N, H] of x.dtype: weight * (x / rms(x)) as LlamaRMSNorm/Qwen3RMSNorm."""
    x = _unit_last(x)
    rows, hidden = x.shape
    if weight.shape != (hidden,):
        raise ValueError(f"weight {tuple(weight.shape)} does not fit hidden size {hidden}")
    out = torch.empty((rows, hidden), dtype=x.dtype, device=x.device)
    if rows == 0:
        return out
    block = pow2(hidden)
    _RMS_NORM[(rows,)](
        x,
        weight.contiguous(),
        out,
        x.stride(0),
        eps,
        H=hidden,
        BLOCK=block,
        PDL=int(pdl),
        num_warps=8 if block >= 2048 else 4,
        **pdl_mod.launch_options(pdl),
    )
    return out


def add_rms_norm(
    x: torch.Tensor | Partials,
    residual: torch.Tensor,
    weight: torch.Tensor,
    eps: float,
    pdl: int = pdl_mod.Pdl.OFF,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(rms_norm(residual + x), residual + x), both contiguous [N, H]: the residual add of one block and the
    norm of the next in one kernel (what engines call fused_add_rms_norm; out of place here). x may be the block's
    last projection's split-K Partials (gmtool.kernels.common): summed here, bit for bit as that GEMM's reduce would."""
    src = _Source.of(x)
    residual = _unit_last(residual)
    (rows, hidden), dtype = src.shape, src.dtype
    if residual.shape != (rows, hidden) or residual.dtype != dtype or weight.shape != (hidden,):
        raise ValueError(
            f"residual {tuple(residual.shape)} {residual.dtype} and weight {tuple(weight.shape)} "
            f"do not fit x {src.shape} {dtype}"
        )
    out = torch.empty((rows, hidden), dtype=dtype, device=residual.device)
    total = torch.empty_like(out)
    if rows == 0:
        return out, total
    block = pow2(hidden)
    x_ptr, b_ptr, m = src.args()
    _ADD_RMS_NORM[(rows,)](
        x_ptr,
        residual,
        weight.contiguous(),
        out,
        total,
        b_ptr,
        m,
        src.stride,
        residual.stride(0),
        eps,
        H=hidden,
        BLOCK=block,
        **src.consts(),
        PDL=int(pdl),
        num_warps=8 if block >= 2048 else 4,
        **pdl_mod.launch_options(pdl),
    )
    return out, total


def qk_norm_rope(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
    pdl: int = pdl_mod.Pdl.OFF,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D] and k [T, Hkv, D] from a fused qkv [T, (Hq + 2 Hkv) D]: optional per-head RMSNorm
    (Qwen3's q_norm/k_norm; None for Llama), then rotate_half RoPE with cos/sin [T, D]. v is not read."""
    return _qk_norm_rope(qkv, num_heads, num_kv_heads, head_dim, cos, sin, q_weight, k_weight, eps, pdl, None)


def qk_norm_rope_write_kv(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None,
    k_weight: torch.Tensor | None,
    eps: float,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    pdl: int = pdl_mod.Pdl.OFF,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """qk_norm_rope with the step's K/V written into the paged caches ([blocks, page, Hkv, D]) at slot_mapping
    [T], as gmtool.kernels.kv_write.write_kv would (negative slots left out): one kernel instead of two, and no
    k tensor. Returns q. positions [T]: cos/sin are RoPE tables [P, D] and each token reads its position's row
    (no gather before the kernel)."""
    check_cache(k_cache, v_cache)
    shape = (num_kv_heads, head_dim)
    if tuple(k_cache.shape[2:]) != shape or tuple(v_cache.shape[2:]) != shape or k_cache.stride(-1) != 1:
        raise ValueError(f"caches {tuple(k_cache.shape)}/{tuple(v_cache.shape)} do not hold {shape} heads")
    if slot_mapping.shape != (qkv.shape[0],):
        raise ValueError(f"slot_mapping {tuple(slot_mapping.shape)} does not fit {qkv.shape[0]} tokens")
    cache = (k_cache, v_cache, slot_mapping)
    return _qk_norm_rope(
        qkv, num_heads, num_kv_heads, head_dim, cos, sin, q_weight, k_weight, eps, pdl, cache, positions
    )[0]


def _qk_norm_rope(qkv, num_heads, num_kv_heads, head_dim, cos, sin, q_weight, k_weight, eps, pdl, cache, rows=None):
    src, cos, sin = _Source.of(qkv), _unit_last(cos), _unit_last(sin)
    tokens, width = src.shape
    if head_dim % 2 or width != (num_heads + 2 * num_kv_heads) * head_dim:
        raise ValueError(f"qkv {src.shape} does not hold {num_heads}+2*{num_kv_heads} heads of even dim {head_dim}")
    if rows is not None:
        if rows.shape != (tokens,) or cos.dim() != 2 or cos.shape[1] != head_dim or sin.shape != cos.shape:
            raise ValueError(f"positions {tuple(rows.shape)} and tables {tuple(cos.shape)} do not fit {tokens} tokens")
    elif cos.shape != (tokens, head_dim) or sin.shape != cos.shape:
        raise ValueError(f"cos/sin {tuple(cos.shape)}/{tuple(sin.shape)} must be [{tokens}, {head_dim}]")
    if (q_weight is None) != (k_weight is None):
        raise ValueError("pass both q_weight and k_weight, or neither")
    dev = src.ptr.device
    q = torch.empty((tokens, num_heads, head_dim), dtype=src.dtype, device=dev)
    k = None if cache else torch.empty((tokens, num_kv_heads, head_dim), dtype=src.dtype, device=dev)
    if tokens == 0:
        return q, k
    norm = q_weight is not None
    qw = q_weight.contiguous() if norm else q  # unread without NORM; any pointer of the type will do
    kw = k_weight.to(qw.dtype).contiguous() if norm else q  # both branches of the kernel's `if` share a type
    half = head_dim // 2
    if cache is None:  # unread: the k tensor is the destination
        kc, vc, slots, kc_strides, vc_strides, page = q, q, q, (0, 0, 0), (0, 0, 0), 1
    else:
        kc, vc, slots = cache
        kc_strides, vc_strides, page = kc.stride()[:3], vc.stride()[:3], kc.shape[1]
    x_ptr, b_ptr, m = src.args()
    _QK_NORM_ROPE[(tokens, num_heads + (2 if cache else 1) * num_kv_heads)](
        x_ptr,
        b_ptr,
        m,
        cos,
        sin,
        qw,
        kw,
        q,
        q if k is None else k,
        kc,
        vc,
        slots,
        q if rows is None else rows,  # unread without ROPE_ROWS
        src.stride,
        cos.stride(0),
        sin.stride(0),
        *kc_strides,
        *vc_strides,
        eps,
        HQ=num_heads,
        HKV=num_kv_heads,
        HALF=half,
        HALF_PAD=pow2(half),
        NORM=norm,
        PAGE=page,
        WRITE_KV=cache is not None,
        **src.consts(),
        PDL=int(pdl),
        num_warps=1,  # a head is 64-128 elements: small programs, many resident per SM
        **pdl_mod.launch_options(pdl),
        **({} if rows is None else {"ROPE_ROWS": True}),  # its default left out: the variant keys stay as they were
    )
    return q, k


def silu_mul(x: "torch.Tensor | Partials", pdl: int = pdl_mod.Pdl.OFF) -> torch.Tensor:
    """x [T, 2I] (gate | up) -> contiguous [T, I] = silu(gate) * up, as the SwiGLU MLP of Llama/Qwen3. x may be the
    gate/up GEMM's split-K Partials: summed here, bit for bit as that GEMM's reduce would."""
    src = _Source.of(x)
    tokens, width = src.shape
    if width % 2:
        raise ValueError(f"silu_mul needs an even last dim, got {width}")
    inter = width // 2
    out = torch.empty((tokens, inter), dtype=src.dtype, device=src.ptr.device)
    if tokens == 0:
        return out
    x_ptr, b_ptr, m = src.args()
    _SILU_MUL[(tokens, cdiv(inter, SILU_BLOCK))](
        x_ptr,
        out,
        b_ptr,
        m,
        src.stride,
        I=inter,
        BLOCK=SILU_BLOCK,
        **src.consts(),
        PDL=int(pdl),
        num_warps=4,
        **pdl_mod.launch_options(pdl),
    )
    return out
