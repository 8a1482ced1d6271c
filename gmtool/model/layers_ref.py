"""Torch references for the fused decoder-layer kernels in gmtool.kernels.layers (same signatures).

They repeat Hugging Face's Llama/Qwen3 ops in HF's order, roundings included, so they are both what the
kernels are checked against and what torch.compile traces when Inductor does the fusing. Plain torch only:
no triton import, no data-dependent Python control flow.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def rms_norm_ref(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """LlamaRMSNorm/Qwen3RMSNorm.forward over the last dim."""
    xf = x.float()
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return weight * xf.to(x.dtype)


def add_rms_norm_ref(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """A decoder layer's `residual + x` (in the activation dtype), then the next RMSNorm of that sum:
    returns (normed, sum); the sum is the residual stream the layer after reads."""
    s = residual + x
    return rms_norm_ref(s, weight, eps), s


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def qk_norm_rope_ref(
    qkv: torch.Tensor,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    cos: torch.Tensor,
    sin: torch.Tensor,
    q_weight: torch.Tensor | None = None,
    k_weight: torch.Tensor | None = None,
    eps: float = 1e-6,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q [T, Hq, D], k [T, Hkv, D] from qkv [T, (Hq + 2 Hkv) D]: per-head norm (if weights), then RoPE."""
    tokens, q_width = qkv.shape[0], num_heads * head_dim
    q = qkv[:, :q_width].view(tokens, num_heads, head_dim)
    k = qkv[:, q_width : q_width + num_kv_heads * head_dim].view(tokens, num_kv_heads, head_dim)
    if q_weight is not None:
        q = rms_norm_ref(q, q_weight, eps)
    if k_weight is not None:
        k = rms_norm_ref(k, k_weight, eps)
    cos, sin = cos.unsqueeze(1), sin.unsqueeze(1)  # broadcast over heads, as apply_rotary_pos_emb does
    q = (q * cos) + (_rotate_half(q) * sin)
    k = (k * cos) + (_rotate_half(k) * sin)
    return q.contiguous(), k.contiguous()


def silu_mul_ref(x: torch.Tensor) -> torch.Tensor:
    """act_fn(gate) * up for x = [gate | up] along the last dim."""
    inter = x.shape[-1] // 2
    return (F.silu(x[..., :inter]) * x[..., inter:]).contiguous()
