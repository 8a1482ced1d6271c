"""Host-side helpers shared by the kernel launchers (no triton import here)."""

from __future__ import annotations

import functools
from dataclasses import dataclass, replace

import torch

# The running max starts finite: with -inf, a tile whose scores are all masked would give -inf - -inf = NaN
# in the rescale factor. Kernels wrap it as tl.constexpr (jit code may only read constexpr globals).
NEG_INIT = -1.0e30
LOG2E = 1.4426950408889634
# The most rows gmtool.kernels.small_m's GEMM takes (decode batches); above it cuBLAS's tiles fit the work.
SMALL_M_MAX = 32
# The most rows --small-m-gemm sends to it: at 17-32 rows cuBLAS was faster at each qwen3-0.6b projection (H200,
# gemm_bench, 2026-12-01: 5.3-7.7 against 5.9-8.5 us), at 1 and 8 rows the small-M GEMM (4.9-6.0 against
# 5.3-12.7 us)
SMALL_M_DEFAULT = 16


@dataclass(frozen=True)
class Partials:
    """x @ W^T (+ bias) left as its split-K partial sums, parts [split, M, N] fp32: what
    gmtool.kernels.small_m.linear(partial=True) returns where K is split. The kernel that reads the product next
    (gmtool.kernels.layers.add_rms_norm) adds them in the order, and with the rounding to dtype, the reduce kernel
    would: the same bits, one kernel fewer (two a layer in a decode step: o_proj and down_proj)."""

    parts: torch.Tensor
    bias: torch.Tensor | None
    dtype: torch.dtype  # the product's (x's): the sum is rounded to it, as the reduce kernel's output is

    @property
    def shape(self) -> torch.Size:
        return self.parts.shape[1:]


@dataclass(frozen=True)
class NormedRow:
    """rms_norm(residual + x) * weight for one row, left for the next GEMM to compute where it reads its x tiles
    (gmtool.kernels.folded): the add+RMSNorm kernel is not launched. x is the block's output row (a
    tensor [1, H], or its last projection's Partials; or, with ids, the row ids[0] of an embedding table x [V, H]);
    total [1, H], the residual for the next add, is written by that GEMM."""

    x: "torch.Tensor | Partials"
    residual: torch.Tensor
    weight: torch.Tensor
    eps: float
    total: torch.Tensor
    ids: torch.Tensor | None = None  # [1]: x is a table, its row ids[0] read on the device (no embedding kernel)

    @classmethod
    def embedded(cls, table: torch.Tensor, ids: torch.Tensor, residual: torch.Tensor, weight, eps) -> "NormedRow":
        """The row ids[0] of table (an nn.Embedding's weight [V, H]) as x: the first layer's norm, folded with the
        embedding lookup into its QKV GEMM (residual: a zero row, the first layer having none)."""
        if ids.numel() != 1 or table.dim() != 2 or not table.is_contiguous():
            raise ValueError(f"an embedded NormedRow is one id of a contiguous [V, H] table: ids {tuple(ids.shape)}")
        return replace(cls.of(table[:1], residual, weight, eps), x=table, ids=ids.reshape(1))

    @classmethod
    def of(cls, x, residual: torch.Tensor, weight: torch.Tensor, eps: float) -> "NormedRow":
        if tuple(residual.shape) != (1, weight.shape[0]) or tuple(x.shape) != tuple(residual.shape):
            raise ValueError(f"a NormedRow is one row: x {tuple(x.shape)}, residual {tuple(residual.shape)}")
        residual = residual.contiguous()
        return cls(x, residual, weight.contiguous(), eps, torch.empty_like(residual))

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.residual.shape)

    @property
    def dtype(self) -> torch.dtype:
        return self.residual.dtype


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the launchers' host code: triton.cdiv is a constexpr function in Triton 3.6 and 3.9, whose
    call unwraps its arguments (about 4 us a call on the CPU; small_m.pick made up to 13 of them a projection)."""
    return -(-a // b)


def pow2(n: int, floor: int = 1) -> int:
    """Triton tiles need power-of-two sizes; tl.dot needs at least 16 on each side."""
    return max(floor, 1 << max(0, int(n) - 1).bit_length())


def dot_precision(dtype: torch.dtype) -> str:
    # fp32 caches are for checks: TF32 (triton's default for fp32 dots) would lose ~3 digits.
    return "ieee" if dtype == torch.float32 else "tf32"


@functools.lru_cache(maxsize=None)
def _sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def num_sms(device: torch.device) -> int:
    """SMs of the device; CPU tensors (triton interpreter) count as an H200."""
    if device.type != "cuda":
        return 132
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


def check_cache(k_cache: torch.Tensor, v_cache: torch.Tensor) -> None:
    # K and V share pages (blocks, tokens, kv heads); V may have its own head dim. D contiguous for vector loads.
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError("k_cache and v_cache must have the same blocks, block size and kv heads")
    if k_cache.dim() != 4 or k_cache.stride(-1) != 1 or v_cache.dim() != 4 or v_cache.stride(-1) != 1:
        raise ValueError("caches must be [num_blocks, block_size, num_kv_heads, head_dim], head_dim contiguous")
