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
whose check differs, and any module that is not called as rotary(x, position_ids) -> (cos, sin): one with a
rope type per layer type (Gemma 3, OLMo 3: rope_type is a dict, the forward takes the layer type), or one that
returns complex frequencies (DeepSeek-V2).
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass

import torch

# Hugging Face rope types whose inv_freq and attention scaling are fixed at init (dynamic and longrope switch
# their frequencies on the sequence length, in transformers' dynamic_rope_update)
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})
# the only call the table answers: the base model's rotary_emb(hidden_states, position_ids)
FORWARD_PARAMS = ["self", "x", "position_ids"]


@dataclass(frozen=True)
class RopeRows:
    """A step's cos/sin left as the table and the positions: a kernel that reads its rows itself
    (gmtool.kernels.layers.qk_norm_rope_write_kv with positions) needs no gather kernel ahead of the first layer;
    gathered() is the pair any other reader takes."""

    cos_sin: torch.Tensor  # [2, P, D]
    positions: torch.Tensor  # [T]

    def gathered(self) -> tuple[torch.Tensor, torch.Tensor]:
        rows = self.cos_sin.index_select(1, self.positions)
        return rows[0], rows[1]


class RotaryTable:
    """cos/sin of positions [0, n) as one [2, n, dim] tensor; a call gathers the rows of position_ids.
    module_forward: the module's own forward, for an x of another dtype or device than the table's."""

    def __init__(self, cos_sin: torch.Tensor, module_forward=None):
        self.cos_sin = cos_sin
        self.module_forward = module_forward

    @property
    def positions(self) -> int:
        return self.cos_sin.shape[1]

    def serves(self, x: torch.Tensor) -> bool:
        """Whether the table answers for x: the module casts to x's dtype, so another dtype or device than the
        table's is left to it (where there is one)."""
        return self.module_forward is None or (x.dtype == self.cos_sin.dtype and x.device == self.cos_sin.device)

    def rows(self, x: torch.Tensor, position_ids: torch.Tensor) -> "RopeRows | None":
        """What __call__ would gather, not gathered; None where the table does not serve x."""
        return RopeRows(self.cos_sin, position_ids.reshape(-1)) if self.serves(x) else None

    def __call__(self, x: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """What rotary(x, position_ids) returns, [*position_ids.shape, dim] each, in one gather."""
        if not self.serves(x):
            return self.module_forward(x, position_ids)
        cos, sin = RopeRows(self.cos_sin, position_ids.reshape(-1)).gathered()
        shape = (*position_ids.shape, cos.shape[-1])
        return cos.view(shape), sin.view(shape)


def _not_tabled(rotary: torch.nn.Module) -> str | None:
    """Why rotary's calls cannot be answered from a table, read from the module alone; None if they may be."""
    rope_type = getattr(rotary, "rope_type", None)
    if isinstance(rope_type, dict):  # Gemma 3, OLMo 3: the forward takes the layer type too
        return f"RoPE recomputed per step: a rope type per layer type ({rope_type!r})"
    if not isinstance(rope_type, str) or rope_type not in STATIC_ROPE_TYPES:
        return f"RoPE recomputed per step: rope type {rope_type!r} is not one of {sorted(STATIC_ROPE_TYPES)}"
    try:
        params = list(inspect.signature(type(rotary).forward).parameters)
    except (TypeError, ValueError):
        params = None
    if params != FORWARD_PARAMS:
        return f"RoPE recomputed per step: {type(rotary).__name__}.forward takes {params}, not (x, position_ids)"
    return None


def _cos_sin(out, n: int) -> bool:
    """out is a (cos, sin) pair of real [1, n, dim] tensors, as a table row gather gives."""
    return (
        isinstance(out, (tuple, list))
        and len(out) == 2
        and all(isinstance(t, torch.Tensor) and not t.is_complex() and t.dim() == 3 for t in out)
        and out[0].shape == out[1].shape
        and tuple(out[0].shape[:2]) == (1, n)
    )


def build(
    rotary: torch.nn.Module, positions: int, dtype: torch.dtype, device: torch.device
) -> tuple[RotaryTable | None, str | None]:
    """(the table, None), or (None, why not): the rotary module's values for positions [0, positions), checked
    bit for bit against direct calls at a few positions."""
    why = _not_tabled(rotary)
    if why:
        return None, why
    if positions < 1:
        return None, "RoPE recomputed per step: no positions"
    x = torch.empty(1, dtype=dtype, device=device)
    with torch.no_grad():
        try:
            out = rotary(x, torch.arange(positions, device=device)[None])
        except Exception as e:  # noqa: BLE001 (a foreign module: it is left to compute its values itself)
            return None, f"RoPE recomputed per step: {type(rotary).__name__}(x, position_ids) raised {type(e).__name__}"
        if not _cos_sin(out, positions):
            return None, f"RoPE recomputed per step: {type(rotary).__name__} does not return a (cos, sin) pair"
        cos, sin = out
        table = RotaryTable(torch.stack((cos[0], sin[0])).contiguous(), type(rotary).forward.__get__(rotary))
        probe = torch.tensor([[0, 1, positions // 2, positions - 1]], device=device).clamp(max=positions - 1)
        want, got = rotary(x, probe), table(x, probe)
    if not _cos_sin(want, 4) or any(
        w.dtype != g.dtype or w.shape != g.shape or not torch.equal(w, g) for w, g in zip(want, got)
    ):
        return None, "RoPE recomputed per step: a table of its values differs from the module's own"
    return table, None
