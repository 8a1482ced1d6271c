"""How much memory a run will take, worked out from its config before any weights are built, and the refusal
of a run that cannot fit the device.

A rough bound, by part: the model weights, the paged KV cache, the persistent input buffers (one set per graph
mode and one for the eager reference: their block tables grow with --max-kv-len x --max-num-seqs), the
largest forward's working set (attention reads every block-table entry of a sequence), and what the captured
graphs keep (on the CPU the tapes' op records, per graph; on CUDA the shared pool is the working set).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from gmtool.config import SweepConfig
from gmtool.errors import GmtoolError
from gmtool.model.attention import MASKED_CHUNK_BYTES

GiB = 2**30
TAPE_BYTES_PER_OP = 2048  # a recorded op: its argument list, slots and frees (measured: ~1 KB)
PROCESS_BYTES = 512 << 20  # Python, torch and transformers themselves
TAPE_OPS_PER_LAYER = 60  # ATen ops of one decoder layer and its attention, rounded up


@dataclass
class Estimate:
    parts: dict[str, int]  # part -> bytes
    options: dict[str, str]  # part -> the option that shrinks it
    kv_block_bytes: int = 0  # one KV block of every layer (the whole model's heads: a --tp rank holds 1/tp)

    @property
    def total(self) -> int:
        return PROCESS_BYTES + sum(self.parts.values())

    @property
    def largest(self) -> str:
        return max(self.parts, key=self.parts.get)

    def describe(self) -> str:
        return ", ".join(f"{k} {v / GiB:.1f}" for k, v in self.parts.items() if v >= GiB // 20)


def _model_config(spec: str):
    """The model's config without building it; None when it cannot be read here (loading says why later)."""
    from gmtool.model import loading

    try:  # read as load_model reads it: never through AutoConfig, which may run a folder's own code (auto_map)
        return loading._config_from_dict(loading.read_config(spec)[0])
    except Exception:  # any unreadable config is load_model's to report, with its own message
        return None


def _field(config, name: str, default):
    """A size from the (text) config; per-layer lists give their largest; a field the config holds per layer
    only (transformers raises on reading it) or not at all gives the default."""
    try:
        v = getattr(config, name, None)
    except Exception:  # noqa: BLE001 (transformers' per-layer attributes raise their own error type)
        return default
    if isinstance(v, (list, tuple)):
        v = max((x for x in v if isinstance(x, (int, float))), default=None)
    return v if isinstance(v, (int, float)) and not isinstance(v, bool) and v else default


MAX_META_LAYERS = 1024  # more than any model built: the formula's count instead of a build on the meta device


def _meta_params(config) -> int | None:
    """The model's exact parameter count, from the model built on the meta device (no memory; MoE experts
    included, which the formula below leaves out); None when it cannot be built so."""
    if _field(config, "num_hidden_layers", 1) > MAX_META_LAYERS:  # its build alone would take minutes
        return None
    try:
        from transformers import AutoModelForCausalLM

        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
    except Exception:  # noqa: BLE001 (loading says why a model cannot be built)
        return None
    return sum(p.numel() for p in model.parameters())


def estimate(cfg: SweepConfig, config) -> Estimate:
    from gmtool.model.families import text_config

    full_config, config = config, text_config(config)
    g = lambda name, default=None: _field(config, name, default)  # noqa: E731
    layers, hidden, vocab = g("num_hidden_layers", 1), g("hidden_size", 1), g("vocab_size", 1)
    heads = g("num_attention_heads", 1)
    kv_heads, head_dim = g("num_key_value_heads", heads), g("head_dim", hidden // heads)
    inter = g("intermediate_size", 4 * hidden)
    elem = torch.empty((), dtype=cfg.torch_dtype).element_size()
    params = _meta_params(full_config) or vocab * hidden * (
        1 if getattr(config, "tie_word_embeddings", False) else 2
    ) + layers * (hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * inter)

    width = math.ceil(cfg.max_kv_len / cfg.block_size)  # block-table entries per sequence
    length = width * cfg.block_size
    # MLA (DeepSeek) as transformers computes it: K of nope + rope dims, V of its own (the probe reads them later)
    k_dim = (g("qk_nope_head_dim", 0) + g("qk_rope_head_dim", 0)) or head_dim
    block = layers * cfg.block_size * kv_heads * (k_dim + g("v_head_dim", k_dim)) * elem
    kv = cfg.kv_blocks_needed * block
    if cfg.kv_cache_gb is not None:
        kv = min(kv, int(cfg.kv_cache_gb * GiB))

    graph_modes = len(cfg.graph_modes)
    tokens, max_seqs = max(cfg.max_tokens or 0, max(cfg.bucket_sizes)), cfg.max_num_seqs
    arena = 8 * (4 * tokens + 3 * max_seqs + 1 + max_seqs * width)
    inputs = (1 + graph_modes) * (2 * arena + max_seqs * vocab * elem) + graph_modes * tokens * hidden * elem

    # one forward: activations per token, and attention over the whole block table of each row it reads
    act = tokens * (8 * hidden + 4 * inter + 2 * vocab) * 4
    if cfg.scenario == "decode":
        attn = min(tokens, max_seqs) * length * (2 * kv_heads * head_dim + 3 * heads) * 4
    else:
        per_token = min(tokens * length * kv_heads * head_dim * 4, MASKED_CHUNK_BYTES)
        attn = 4 * per_token + tokens * length * (heads * 4 * 3 + 2)
    work = act + attn

    parts = {"weights": params * elem, "KV cache": kv, "input buffers": inputs, "working set": work}
    if cfg.torch_device.type != "cuda":
        graphs = sum(len({c.num_seqs for c in cs}) for cs in cfg.compositions_by_bucket.values()) * graph_modes
        parts["graph tapes"] = graphs * (layers * TAPE_OPS_PER_LAYER + 50) * TAPE_BYTES_PER_OP
    options = {
        "weights": "--model or --dtype",
        "KV cache": "--max-kv-len, --block-size or the compositions' prefixes (or give --kv-cache-gb)",
        "input buffers": "--max-kv-len or --max-num-seqs",
        "working set": "--buckets (the largest), --max-tokens, --max-kv-len or --block-size",
        "graph tapes": "--buckets (fewer buckets)",
    }
    return Estimate(parts, options, block)


def available_bytes(device: torch.device) -> int:
    """What the device can still give: CUDA's free memory, or the CPU's MemAvailable."""
    if device.type == "cuda":
        return torch.cuda.mem_get_info(device)[0]
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def check_fits(cfg: SweepConfig) -> Estimate | None:
    """Refuse (GmtoolError) a run whose estimate exceeds what the device has, naming the option to change."""
    config = _model_config(cfg.model)
    if config is None:
        return None
    est = estimate(cfg, config)
    if cfg.kv_cache_gb is not None and est.kv_block_bytes:
        # the null block and one more, on the smallest share a rank can hold: below that the cache would exceed
        # the budget (PagedKVCache.from_budget keeps two blocks) and every batch past one block would fail, after
        # the model's load
        least = 2 * est.kv_block_bytes // max(cfg.tp, 1)
        if cfg.kv_cache_gb * GiB < least:
            raise GmtoolError(
                f"--kv-cache-gb {cfg.kv_cache_gb:g} cannot hold two KV blocks of this model ({least:,} bytes at "
                f"--block-size {cfg.block_size}): raise --kv-cache-gb, or leave it out to size the cache by what "
                "the device has"
            )
    have = available_bytes(cfg.torch_device)
    if est.total > have:
        where = "the CPU" if cfg.torch_device.type != "cuda" else str(cfg.torch_device)
        raise GmtoolError(
            f"this run needs about {est.total / GiB:.1f} GiB ({est.describe()} GiB), {where} has "
            f"{have / GiB:.1f} GiB available: lower {est.options[est.largest]}"
        )
    return est
