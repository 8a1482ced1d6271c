"""Each rank's share of the model: column-parallel projections keep 1/N of their output features (whole
heads: q/k/v rows are head-major, so a contiguous chunk is a run of heads, and rank r's query heads read
exactly rank r's KV heads under GQA), row-parallel ones 1/N of their input features, then an all-reduce sums
the partial outputs. The bias of a row-parallel layer is added once, after the sum.

Which layer is which comes from the model config's base_model_tp_plan ("colwise"/"rowwise" per module
pattern; anything else there, the norms' "replicated_with_grad_allreduce" say, stays whole), else from the
projection names every supported family uses. Embeddings, norms and the LM head stay whole on every rank, so
each rank computes the same logits.
"""

from __future__ import annotations

import re

import torch
import torch.nn.functional as F

from gmtool.errors import GmtoolError
from gmtool.model import families
from gmtool.parallel import comm

OWN_PLAN = {
    "layers.*.self_attn.q_proj": "colwise",
    "layers.*.self_attn.k_proj": "colwise",
    "layers.*.self_attn.v_proj": "colwise",
    "layers.*.self_attn.o_proj": "rowwise",
    "layers.*.mlp.gate_proj": "colwise",
    "layers.*.mlp.up_proj": "colwise",
    "layers.*.mlp.down_proj": "rowwise",
}


class RowParallelLinear(torch.nn.Linear):
    """A Linear holding 1/N of the input features: the partial products are summed over the ranks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = torch.ops.gmtool.all_reduce(F.linear(x, self.weight))
        return y if self.bias is None else y + self.bias


def tp_refusal(config, world: int) -> str | None:
    """Why the model cannot be split over `world` ranks (read from its config, before any weights), or None."""
    config = families.text_config(config)  # a multimodal config holds the language model's sizes inside
    heads = getattr(config, "num_attention_heads", None)
    kv = getattr(config, "num_key_value_heads", None) or heads
    # a size the config lacks (GPT-2's MLP width) or gives per layer (Gemma 3n's): shard_model checks each weight
    for what, sizes in (
        ("attention heads", heads),
        ("KV heads", kv),
        ("MLP width", getattr(config, "intermediate_size", None)),
    ):
        for n in sizes if isinstance(sizes, (list, tuple)) else [sizes]:
            if isinstance(n, int) and n % world:
                return f"--tp {world}: the model's {n} {what} do not divide by {world}; choose a --tp that divides {n}"
    return None


def _style(plan: dict, name: str) -> str | None:
    for pattern, style in plan.items():
        if re.fullmatch(re.escape(pattern).replace(r"\*", r"\d+"), name):
            return style if style in ("colwise", "rowwise") else None
    return None


def shard_model(model: torch.nn.Module, rank: int, world: int) -> str:
    """Replace each projection's weight by rank's share, in place; returns the plan's source for the notes."""
    base = families.base_model(model)
    hf_plan = getattr(families.text_config(model.config), "base_model_tp_plan", None) or {}
    plan, source = (hf_plan, "the model's tp_plan") if hf_plan else (OWN_PLAN, "gmtool's column/row split")
    counts = {"colwise": 0, "rowwise": 0}
    for name, m in base.named_modules():
        style = _style(plan, name)
        if style is None or not isinstance(m, torch.nn.Linear):
            continue
        dim = 0 if style == "colwise" else 1
        if m.weight.shape[dim] % world:
            raise GmtoolError(f"--tp {world}: {name} has {m.weight.shape[dim]} features, not divisible by {world}")
        m.weight = torch.nn.Parameter(m.weight.chunk(world, dim)[rank].clone(), requires_grad=False)
        if style == "colwise":
            m.out_features = m.weight.shape[0]
            if m.bias is not None:
                m.bias = torch.nn.Parameter(m.bias.chunk(world)[rank].clone(), requires_grad=False)
        else:
            m.in_features = m.weight.shape[1]
            m.__class__ = RowParallelLinear
        counts[style] += 1
    if not counts["rowwise"]:
        raise GmtoolError(f"--tp {world}: {type(model).__name__} has no projection {source} splits by rows")
    comm.all_reduce  # noqa: B018 (imported for the op's registration: torch.ops.gmtool.all_reduce)
    return (
        f"--tp {world}: rank {rank} of {world}, {counts['colwise']} column- and {counts['rowwise']} "
        f"row-parallel projections ({source}), an all-reduce after each row-parallel one"
    )
