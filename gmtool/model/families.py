"""Model families: what gmtool knows of each architecture, in one table (`FAMILIES`, by model_type).

- `fused_residual`: the base model's forward is embed, rotary, the plain pre-norm decoder layers and a final
  norm (masks aside, which gmtool's attention never reads). `--fuse` replaces that forward with the
  (hidden, residual) loop engines use, each residual add inside the RMSNorm after it (`FUSED_RESIDUAL`).
  Other families keep their own forward; their attention, MLP and RMSNorms are still fused where
  `gmtool.model.fused` finds them exact, and it names what it leaves.
- `missing`: a feature the family needs that gmtool lacks: the model is refused before its weights are built.
- `logits`: what the causal LM's own forward does to the LM head's output, which gmtool's forward (base model,
  then LM head, on the rows it needs) must do too (a final soft-cap needs no entry: `postprocess_logits`).
Everything else about attention (windows, soft-caps, sinks, head dims) is read from the model itself
(gmtool.model.probe), not from this table.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch


# A logit rule: (text config, logits, in_place) -> logits. In place, it overwrites logits with the same values
# (the same ops in the same order): an LM head writing a graph's persistent logits makes no temporaries.
def _final_softcap(config, logits: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    cap = getattr(config, "final_logit_softcapping", None)
    if not cap:
        return logits
    return logits.div_(cap).tanh_().mul_(cap) if in_place else torch.tanh(logits / cap) * cap


def _scaled(attr: str, divide: bool = False) -> Callable:
    def scale(config, logits: torch.Tensor, in_place: bool = False) -> torch.Tensor:
        s = getattr(config, attr, None)
        if s is None or s == 1:
            return logits
        if in_place:
            return logits.div_(s) if divide else logits.mul_(s)
        return logits / s if divide else logits * s

    return scale


@dataclass(frozen=True)
class Family:
    fused_residual: str | None = None  # the decoder layer class when --fuse may replace the base forward
    missing: str | None = None  # the feature gmtool lacks, in words
    logits: Callable | None = None  # (config, logits) -> logits, as the causal LM's forward post-processes


FAMILIES: dict[str, Family] = {
    "llama": Family(fused_residual="LlamaDecoderLayer"),
    "qwen2": Family(fused_residual="Qwen2DecoderLayer"),
    "qwen3": Family(fused_residual="Qwen3DecoderLayer"),
    "mistral": Family(fused_residual="MistralDecoderLayer"),
    "cohere": Family(logits=_scaled("logit_scale")),
    "cohere2": Family(logits=_scaled("logit_scale")),
    "cohere2_moe": Family(logits=_scaled("logit_scale")),
    "granite": Family(logits=_scaled("logits_scaling", divide=True)),
    "granitemoe": Family(logits=_scaled("logits_scaling", divide=True)),
    "granitemoeshared": Family(logits=_scaled("logits_scaling", divide=True)),
    "granite_swa": Family(logits=_scaled("logits_scaling", divide=True)),
    "granitemoe_swa": Family(logits=_scaled("logits_scaling", divide=True)),
    "minicpm3": Family(logits=_scaled("logits_scaling", divide=True)),  # hidden / s before a bias-free head
    "hyperclovax": Family(logits=_scaled("logits_scaling")),
    "granitemoehybrid": Family(missing="Mamba layers (a recurrent state, not a KV cache)"),
    "llama4_text": Family(missing="chunked local attention"),
}
NO_FAMILY = Family()

# base model class -> its decoder layer class, for gmtool.model.fused
FUSED_RESIDUAL = {
    f.fused_residual.removesuffix("DecoderLayer") + "Model": f.fused_residual
    for f in FAMILIES.values()
    if f.fused_residual
}


def family(config) -> Family:
    """The family of the config's model_type, else of its language model's (Llama 4's config holds llama4_text)."""
    for cfg in (config, text_config(config)):
        if (f := FAMILIES.get(getattr(cfg, "model_type", ""))) is not None:
            return f
    return NO_FAMILY


def base_model(model: torch.nn.Module) -> torch.nn.Module | None:
    """The decoder stack the causal LM runs before its LM head: the module under base_model_prefix, or `model`
    where a multimodal family's text-only class keeps it there under another prefix (Llama 4, Mllama), or that
    module's `language_model` where it holds one."""
    base = getattr(model, model.base_model_prefix, None)
    base = base if isinstance(base, torch.nn.Module) else getattr(model, "model", None)
    # a multimodal model (Gemma 3's) holds its text decoder beside a vision tower: gmtool runs text alone
    text = getattr(base, "language_model", None)
    return text if isinstance(text, torch.nn.Module) else base


# what families call a decoder layer's attention and MLP, and the norm after the last layer (Llama's names first;
# Falcon's, GPT-NeoX's, Phi's, Mixtral's, ...)
ATTENTION_NAMES = ("self_attn", "self_attention", "attention", "attn")
MLP_NAMES = ("mlp", "block_sparse_moe", "feed_forward", "ffn")
FINAL_NORM_NAMES = ("norm", "ln_f", "final_layernorm", "final_layer_norm", "norm_f")


def part(module: torch.nn.Module, names: tuple[str, ...]) -> torch.nn.Module | None:
    """module's submodule under the first of names it has (ATTENTION_NAMES, MLP_NAMES, FINAL_NORM_NAMES)."""
    return next((m for n in names if isinstance(m := getattr(module, n, None), torch.nn.Module)), None)


def decoder_layers(model: torch.nn.Module, num_layers: int) -> torch.nn.ModuleList | None:
    """The causal LM's decoder layers: its base model's `layers`, else the first module list of num_layers
    modules there (Falcon's `h`); None where there is none."""
    base = base_model(model)
    if base is None:
        return None
    stack = getattr(base, "layers", None)
    if isinstance(stack, torch.nn.ModuleList):
        return stack
    return next((m for m in base.children() if isinstance(m, torch.nn.ModuleList) and len(m) == num_layers), None)


def text_config(config):
    """The config of the language model (multimodal configs hold it inside; some hold several, or none)."""
    try:
        return config.get_text_config()
    except (AttributeError, ValueError):
        return config


def architecture(config) -> str:
    """The name users know the model by: its architecture class, else its model_type."""
    archs = getattr(config, "architectures", None) or []
    return archs[0] if archs else getattr(config, "model_type", type(config).__name__)


def rope_types(config) -> set[str]:
    """The RoPE types the (text) config names: one, or one per layer type (Gemma 3's rope_parameters)."""
    text = text_config(config)
    rope = getattr(text, "rope_scaling", None) or getattr(text, "rope_parameters", None) or {}
    sets = (
        rope.values() if isinstance(rope, dict) and all(isinstance(v, dict) for v in rope.values()) and rope else [rope]
    )
    return {
        str(r.get("rope_type", r.get("type")))
        for r in sets
        if isinstance(r, dict) and r.get("rope_type", r.get("type"))
    }


LONGROPE_NOTE = (
    "longrope: the step's largest position picks the RoPE factors of every token in it (transformers' rule), so "
    "a request's logits depend on its batchmates, and on the position padding lanes hold"
)


OTHER_TOWERS = ("vision", "visual", "image", "img", "audio", "speech", "tower")


def learned_positions(model: torch.nn.Module) -> tuple[str, int] | None:
    """A table of learned absolute positions (GPT-2's wpe, OPT's and BioGPT's embed_positions, offset past their
    first rows): its module name and how many positions it holds; None where positions are rotary or computed."""
    words = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    for name, m in model.named_modules():
        leaf, path = name.rsplit(".", 1)[-1].lower(), name.lower()
        if any(w in path for w in OTHER_TOWERS):  # a multimodal model's vision or audio tower: not the text's
            continue
        if isinstance(m, torch.nn.Embedding) and m is not words and ("pos" in leaf or leaf == "wpe"):
            return name, m.num_embeddings - int(getattr(m, "offset", 0) or 0)
    return None


def load_refusal(config) -> str | None:
    """Why a model cannot be captured at all (checked before its weights are built)."""
    missing = family(config).missing
    if missing:
        return f"{architecture(config)} needs {missing}, which gmtool does not implement"
    if "dynamic" in rope_types(config):
        return f"{architecture(config)}: dynamic RoPE syncs with the host on every step: it cannot be captured"
    return None


def postprocess_logits(config, logits: torch.Tensor, in_place: bool = False) -> torch.Tensor:
    """The family's logit rule, else a final soft-cap where the config sets one (every causal LM that has the
    field applies it: Gemma 2/3/3n/4, VaultGemma, nanochat, ...). gmtool.model.probe checks the result against
    the causal LM's own forward at load. in_place: logits overwritten and returned, no temporary."""
    f = family(config).logits or _final_softcap
    return f(text_config(config), logits, in_place)  # a multimodal model's language config holds the fields
