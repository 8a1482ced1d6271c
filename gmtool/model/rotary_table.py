"""RoPE's cos/sin for every position the KV cache can hold, computed once by the model's own rotary module.

A Hugging Face rotary embedding recomputes cos/sin from the position ids at every step: a product (a K=1
GEMM in older transformers), a cat, cos, sin, two scalings and two casts, about 8 kernels ahead of the first
layer of every decode graph, none of which can overlap the next (qwen3-0.6b on an H200: 14 us of kernels, and a
cuBLAS first use per bucket at capture). Where the rotary frequencies do not depend on the sequence, the values
at position p are the same at every step, so a table gathered by position gives them in one kernel.
qwen3-0.6b's --fuse --small-m-gemm --pdl decode graph, kv 1024 (H200, 2026-12-01, tools/pdl_decode.py, the two
trees alternated in one call): B=1 0.884 and 0.885 ms against 0.896 and 0.895; B=32 2.189 against 2.199-2.200.

The table is the module's own output for positions 0..n-1 (its frequencies, scaling and dtype, whatever the
rope type computes), and is used only if a direct call at a few positions gives the same bits: a rope type
whose values change with the sequence length (dynamic NTK, longrope) is left to the module, as is anything
whose check differs.
"""

from __future__ import annotations

import torch

# Hugging Face rope types whose inv_freq and attention scaling are fixed at init (dynamic and longrope switch
# their frequencies on the sequence length, in transformers' dynamic_rope_update)
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})


class RotaryTable:
    """cos/sin of positions [0, n) as one [2, n, dim] tensor; a call gathers the rows of position_ids."""

    def __init__(self, cos_sin: torch.Tensor):
        self.cos_sin = cos_sin

    @property
    def positions(self) -> int:
        return self.cos_sin.shape[1]

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What rotary(x, position_ids) returns, [*position_ids.shape, dim] each, in one gather."""
        rows = self.cos_sin.index_select(1, position_ids.reshape(-1))
        shape = (*position_ids.shape, rows.shape[-1])
        return rows[0].view(shape), rows[1].view(shape)


def build(
    rotary: torch.nn.Module, positions: int, dtype: torch.dtype, device: torch.device
) -> tuple[RotaryTable | None, str | None]:
    """(the table, None), or (None, why not): the rotary module's values for positions [0, positions), checked
    bit for bit against direct calls at a few positions."""
    rope_type = getattr(rotary, "rope_type", None)
    if rope_type not in STATIC_ROPE_TYPES:
        return None, f"RoPE recomputed per step: rope type {rope_type!r} is not one of {sorted(STATIC_ROPE_TYPES)}"
    if positions < 1:
        return None, "RoPE recomputed per step: no positions"
    x = torch.empty(1, dtype=dtype, device=device)
    with torch.no_grad():
        cos, sin = rotary(x, torch.arange(positions, device=device)[None])
        table = RotaryTable(torch.stack((cos[0], sin[0])).contiguous())
        probe = torch.tensor([[0, 1, positions // 2, positions - 1]], device=device).clamp(max=positions - 1)
        want, got = rotary(x, probe), table(x, probe)
    if any(w.dtype != g.dtype or w.shape != g.shape or not torch.equal(w, g) for w, g in zip(want, got)):
        return None, "RoPE recomputed per step: a table of its values differs from the module's own"
    return table, None
