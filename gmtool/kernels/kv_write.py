"""Scatter the step's new K and V into the paged cache by slot, in one launch for both.

Grid (T,): one program per token, so the launch depends only on the bucket. Slots < 0 are skipped (padding
that should not touch the cache); slot = block * block_size + offset, as gmtool's slot_mapping holds.
"""

from __future__ import annotations

import triton
import triton.language as tl

from gmtool.kernels import pdl as pdl_mod
from gmtool.kernels.common import check_cache, pow2
from gmtool.kernels.launcher import BoundKernel, FastLaunch, KernelLaunch


@triton.jit
def _write_kv_kernel(
    k_ptr,
    v_ptr,
    kc_ptr,
    vc_ptr,
    slot_ptr,
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cblk,
    stride_ct,
    stride_ch,
    stride_vblk,
    stride_vct,
    stride_vch,
    HKV: tl.constexpr,
    H_PAD: tl.constexpr,
    D: tl.constexpr,
    D_PAD: tl.constexpr,
    DV: tl.constexpr,
    DV_PAD: tl.constexpr,
    PAGE: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    pdl_mod.enter(PDL)  # before the slot test: a program that returns early has waited too
    t = tl.program_id(0)
    slot = tl.load(slot_ptr + t)
    if slot < 0:
        return
    h = tl.arange(0, H_PAD)
    d = tl.arange(0, D_PAD)
    mask = (h < HKV)[:, None] & (d < D)[None, :]
    dst = (slot // PAGE) * stride_cblk + (slot % PAGE) * stride_ct + h[:, None] * stride_ch + d[None, :]
    k = tl.load(k_ptr + t * stride_kt + h[:, None] * stride_kh + d[None, :], mask=mask)
    tl.store(kc_ptr + dst, k.to(kc_ptr.dtype.element_ty), mask=mask)
    dv = tl.arange(0, DV_PAD)
    vmask = (h < HKV)[:, None] & (dv < DV)[None, :]
    vdst = (slot // PAGE) * stride_vblk + (slot % PAGE) * stride_vct + h[:, None] * stride_vch + dv[None, :]
    v = tl.load(v_ptr + t * stride_vt + h[:, None] * stride_vh + dv[None, :], mask=vmask)
    tl.store(vc_ptr + vdst, v.to(vc_ptr.dtype.element_ty), mask=vmask)


def _arguments(k_cache, v_cache, k, v, slot_mapping) -> tuple[tuple, dict]:
    """The shape checks, then the kernel's arguments (k and v head_dim contiguous): (positional, constexprs)."""
    check_cache(k_cache, v_cache)
    tokens, kv_heads, dim = k.shape
    dv = v.shape[-1]
    if (
        tuple(k_cache.shape[2:]) != (kv_heads, dim)
        or tuple(v_cache.shape[2:]) != (kv_heads, dv)
        or v.shape[0] != tokens
    ):
        raise ValueError(
            f"k/v {tuple(k.shape)}/{tuple(v.shape)} do not fit cache blocks "
            f"{tuple(k_cache.shape[1:])}/{tuple(v_cache.shape[1:])}"
        )
    args = (
        k,
        v,
        k_cache,
        v_cache,
        slot_mapping,
        k.stride(0),
        k.stride(1),
        v.stride(0),
        v.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        v_cache.stride(0),
        v_cache.stride(1),
        v_cache.stride(2),
    )
    consts = dict(
        HKV=kv_heads,
        H_PAD=pow2(kv_heads),
        D=dim,
        D_PAD=pow2(dim),
        DV=dv,
        DV_PAD=pow2(dv),
        PAGE=k_cache.shape[1],
        PDL=0,  # write_kv sets its mode; bound (piecewise) runners launch plainly
    )
    return args, consts


_WRITE_KV = FastLaunch(_write_kv_kernel)  # no per-call binding once a variant is known


def write_kv(k_cache, v_cache, k, v, slot_mapping, pdl: int | None = None) -> None:
    """k [T, Hkv, Dk], v [T, Hkv, Dv] into the caches at slot_mapping [T]; negative slots are left out.
    pdl: a gmtool.kernels.pdl.Pdl mode; None: the caller's scope (pdl.launches)."""
    if k.stride(-1) != 1:
        k = k.contiguous()
    if v.stride(-1) != 1:
        v = v.contiguous()
    if k.shape[0] == 0:
        return
    args, consts = _arguments(k_cache, v_cache, k, v, slot_mapping)
    mode = pdl_mod.current() if pdl is None else pdl
    _WRITE_KV[(k.shape[0],)](*args, **(consts | dict(PDL=int(mode))), num_warps=4, **pdl_mod.launch_options(mode))


class BoundWrite:
    """write_kv bound to a piecewise runner's tensors (the piece's k and v, this layer's cache, the step's slot
    mapping): its grid is the bucket's, so a call takes nothing."""

    __slots__ = ("launch", "grid")

    def __init__(self, k_cache, v_cache, k, v, slot_mapping):
        if k.stride(-1) != 1 or v.stride(-1) != 1:
            raise ValueError("a bound launch needs k and v with head_dim contiguous: it cannot copy them per call")
        args, consts = _arguments(k_cache, v_cache, k, v, slot_mapping)
        self.launch, self.grid = (
            BoundKernel(_write_kv_kernel, args, consts, dict(num_warps=4)),
            (k.shape[0], 1, 1),
        )

    @property
    def paths(self) -> tuple[str, ...]:
        return (self.launch.path,)

    def native_launches(self, ctx) -> list[KernelLaunch]:
        return [KernelLaunch(self.launch, self.grid)]

    def __call__(self) -> None:
        self.launch(self.grid)
