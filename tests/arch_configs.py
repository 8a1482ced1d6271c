"""Tiny configs of every causal-LM architecture transformers ships, built from its own config classes.

Each is 2 layers of hidden size 64 (MoE: 4 experts, 2 per token; MLA: small LoRA ranks and unequal K/V head
dims), with any sliding window shrunk to a few tokens so that short test sequences cross it.
"""

from __future__ import annotations

import json
from pathlib import Path

TINY = {
    "num_hidden_layers": 2,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 16,
    "vocab_size": 256,
    "max_position_embeddings": 512,
    # MoE
    "num_experts": 4,
    "num_local_experts": 4,
    "n_routed_experts": 4,
    "num_experts_per_tok": 2,
    "moe_intermediate_size": 32,
    "shared_expert_intermediate_size": 32,
    "n_shared_experts": 1,
    "n_group": 1,
    "topk_group": 1,
    "first_k_dense_replace": 1,
    "decoder_sparse_step": 1,
    # MLA (DeepSeek-V2/V3 and kin): K head dim 16 + 8, V head dim 24
    "kv_lora_rank": 32,
    "q_lora_rank": 32,
    "qk_nope_head_dim": 16,
    "qk_rope_head_dim": 8,
    "v_head_dim": 24,
    # layers that reuse an earlier layer's K/V (Gemma 3n, Gemma 4): the last one
    "num_kv_shared_layers": 1,
    "pad_token_id": 0,
    "bos_token_id": 1,
    "eos_token_id": 2,
}
WINDOW = 6  # a window shorter than the test sequences, so every boundary is crossed
EXTRA = {  # what those classes' own checks demand of a tiny config
    "zaya": {"num_experts_per_tok": 1},
    "xlnet": {"d_head": 16},
    "dots3_note_text": {"num_key_value_heads": 4},
    "gemma4_assistant": {"hidden_size_per_layer_input": 0},
    "gpt_neo": {"attention_types": [[["global", "local"], 1]]},
    "mamba2": {"num_heads": 4, "head_dim": 32},
    # Gemma 4 shares K/V only between layers of one type; its tiny pattern (sliding, full) has none to share
    "gemma4_text": {"num_kv_shared_layers": 0},
    "gemma4_unified_text": {"num_kv_shared_layers": 0},
    # Mamba-2 heads that fill the expanded hidden size (2 x 64); hybrids' layer patterns for 2 layers
    "bamba": {"mamba_n_heads": 4, "mamba_d_head": 32},
    "granitemoehybrid": {"mamba_n_heads": 4, "mamba_d_head": 32},
    "zamba": {"layers_block_type": ["hybrid", "hybrid"]},  # one shared block tied across two
    "zamba2": {"layers_block_type": ["mamba", "hybrid"]},
    "dory": {"n_input_layers": 1, "n_recurrent_layers": 0, "n_output_layers": 1},
    "codegen": {"rotary_dim": 8},
    "gptj": {"rotary_dim": 8},
    "plbart": {"decoder_layers": 2, "decoder_attention_heads": 4, "decoder_ffn_dim": 128},
    "whisper": {"decoder_layers": 2, "decoder_attention_heads": 4, "decoder_ffn_dim": 128},
    "reformer": {
        "is_decoder": True,
        "attention_head_size": 16,
        "attn_layers": ["local", "lsh"],
        "axial_pos_embds_dim": [32, 32],
    },
}


def causal_lm_types() -> list[str]:
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def _shrink(d: dict, attribute_map: dict) -> None:
    """TINY's values for the keys this (sub-)config has (under the class's own names: GPT-2's n_embd...);
    per-layer lists and tables are dropped, to be derived again for 2 layers; a sliding window shrunk to WINDOW."""
    from transformers import CONFIG_MAPPING

    layers = d.get(attribute_map.get("num_hidden_layers", "num_hidden_layers"))
    for k in list(d):
        if isinstance(d[k], list) and layers and len(d[k]) == layers and layers != TINY["num_hidden_layers"]:
            del d[k]
    d.pop("per_layer_config", None)
    for k, v in TINY.items():
        k = attribute_map.get(k, k)
        if k in d:
            d[k] = v
    if "qk_rope_head_dim" in d and "head_dim" in d:
        d["head_dim"] = TINY["qk_rope_head_dim"]  # MLA configs' rotary head dim
    if "kv_lora_rank" in d and "num_key_value_heads" in d:
        # MLA expands K and V per query head; transformers' eager attention groups them by this field anyway
        d["num_key_value_heads"] = d.get(attribute_map.get("num_attention_heads", "num_attention_heads"))
    if d.get("sliding_window"):
        d["sliding_window"] = WINDOW
    d.update(EXTRA.get(d.get("model_type"), {}))
    for v in d.values():
        if isinstance(v, dict) and "model_type" in v:
            sub = CONFIG_MAPPING.get(v["model_type"]) if v["model_type"] in CONFIG_MAPPING else None
            _shrink(v, getattr(sub, "attribute_map", {}))


def tiny_config(model_type: str) -> dict:
    """The config of a tiny model_type as a config.json dict (sub-configs of multimodal models shrunk too)."""
    from transformers import CONFIG_MAPPING

    cls = CONFIG_MAPPING[model_type]
    d = cls().to_dict()
    _shrink(d, cls.attribute_map)
    d = cls(**{k: v for k, v in d.items() if k != "model_type"}).to_dict()  # what the class makes of it
    d["model_type"] = model_type
    return d


def write_config(model_type: str, folder: Path) -> Path:
    path = folder / f"{model_type}.json"
    path.write_text(json.dumps(tiny_config(model_type)))
    return path
