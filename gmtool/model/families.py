"""Model families: what gmtool knows of each architecture, in one table.

- `FUSED_RESIDUAL`: base models whose forward is embed, rotary, the plain pre-norm decoder layers and a final
  norm (masks aside, which gmtool's attention never reads). `--fuse` replaces that forward with the
  (hidden, residual) loop engines use, each residual add inside the RMSNorm after it. Other families keep
  their own forward; their attention, MLP and RMSNorms are still fused where `gmtool.model.fused` finds them exact.
- `refusal()`: why gmtool cannot run a model faithfully, said before anything is captured.
"""
from __future__ import annotations

# base model class -> its decoder layer class
FUSED_RESIDUAL = {"LlamaModel": "LlamaDecoderLayer", "Qwen2Model": "Qwen2DecoderLayer",
                  "Qwen3Model": "Qwen3DecoderLayer", "MistralModel": "MistralDecoderLayer"}


def sliding_window(config) -> int | None:
    """The attention window of any layer that has one; None when every layer attends to all its context."""
    window = getattr(config, "sliding_window", None)
    if not window:
        return None
    types = getattr(config, "layer_types", None)
    if types is not None:
        return window if "sliding_attention" in types else None
    return window if getattr(config, "use_sliding_window", True) else None


def load_refusal(config) -> str | None:
    """Why a model cannot be captured at all (checked before its weights are built)."""
    rope = getattr(config, "rope_scaling", None) or {}
    if isinstance(rope, dict) and rope.get("rope_type", rope.get("type")) == "dynamic":
        return "dynamic RoPE syncs with the host on every step: it cannot be captured"
    return None


def run_refusal(name: str, config, max_kv_len: int) -> str | None:
    """Why a model cannot be run faithfully with these options."""
    window = sliding_window(config)
    if window is not None and max_kv_len > window:
        # gmtool's attention reads the whole context: past the window, eager and graphs would agree on
        # something the model does not compute
        return (f"{name} has sliding-window attention ({window} tokens), which gmtool does not implement: use "
                f"--max-kv-len {window} or less")
    return None
