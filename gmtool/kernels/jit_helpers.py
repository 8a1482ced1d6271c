"""Triton device functions shared by the attention kernels (this module imports triton; common.py does not)."""

from __future__ import annotations

import triton
import triton.language as tl


@triton.jit
def softcap_log2(s, cap: tl.constexpr):
    """Scaled logits s soft-capped (cap * tanh(s / cap)), returned in the exp2 domain the kernels use.
    tanh(x) = 1 - 2 / (exp(2x) + 1): exp overflowing to inf still gives exactly +-1."""
    t = 1.0 - 2.0 / (tl.exp(2.0 * s / cap) + 1.0)
    return t * cap * 1.4426950408889634
