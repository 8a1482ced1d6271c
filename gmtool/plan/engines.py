"""The serving engines' default capture lists, and a capture set written as each engine's flag.

Sources (read 2026-12; each engine changes these between releases, so they are labelled with the setting that
produces them):
- vLLM, vllm/config/compilation.py and vllm.config.VllmConfig: default `cudagraph_capture_sizes` are
  [1, 2, 4] + range(8, 256, 8) + range(256, max + 1, 16), max = min(2 * max_num_seqs, 512): 35 sizes up to
  256, 51 up to 512 (max_num_seqs 256). Set with `--cudagraph-capture-sizes` (vllm serve; `--cuda-graph-sizes`
  is its deprecated name) or `compilation_config={"cudagraph_capture_sizes": [...]}`.
- SGLang, python/sglang/srt/server_args.py `_generate_cuda_graph_batch_sizes`: [1, 2, 4, 8, 12] +
  range(16, 257, 8) + range(272, 512, 16) + range(512, max + 1, 32), those up to max: 36 sizes with
  `--cuda-graph-max-bs 256`.
  Set with `--cuda-graph-bs 1 2 4 ...`.
- TensorRT-LLM, tensorrt_llm/llmapi/llm_args.py `CudaGraphConfig._generate_cuda_graph_batch_sizes`
  (max_batch_size 128): range(1, 32) + [32, 64, 128] without padding (the default: only those exact sizes run
  on a graph), [1, 2, 4] + range(8, 129, 8) with `enable_padding: true`. Set with `cuda_graph_config:
  {batch_sizes: [...], enable_padding: true}` in the `--extra_llm_api_options` YAML.
SGLang and TensorRT-LLM count sequences, vLLM counts tokens: for decode steps (one token per sequence) they are
the same number; the plan is made on num_tokens. SGLang and TensorRT-LLM replay their graphs for decode batches
only (SGLang's `ForwardMode.is_cuda_graph`: decode, target-verify and idle batches, not extend or mixed ones;
TensorRT-LLM's `DecodingCUDAGraphRunner`: generation-only batches): their
rows run a workload's prefill and mixed steps eager. vLLM's piecewise graphs serve any batch by its token count.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from gmtool.core.buckets import DEFAULT_DECODE_BUCKETS


@dataclass(frozen=True)
class EngineDefault:
    name: str
    sizes: tuple[int, ...]
    padding: bool = True  # False: a step not captured exactly runs eager
    setting: str = ""
    decode_only: bool = False  # True: only decode batches run on its graphs; prefill and mixed steps run eager


def _vllm(max_size: int) -> tuple[int, ...]:
    return tuple([1, 2, 4] + list(range(8, 256, 8)) + list(range(256, max_size + 1, 16)))


def _sglang(max_bs: int) -> tuple[int, ...]:
    every = [1, 2, 4, 8, 12] + list(range(16, 257, 8)) + list(range(272, 512, 16)) + list(range(512, max_bs + 1, 32))
    return tuple(b for b in every if b <= max_bs)


ENGINE_DEFAULTS = (
    EngineDefault("vllm", _vllm(256), setting="max_num_seqs 128 (max capture size 256)"),
    EngineDefault("vllm-512", _vllm(512), setting="max_num_seqs 256 (max capture size 512)"),
    EngineDefault("sglang", _sglang(256), setting="--cuda-graph-max-bs 256", decode_only=True),
    EngineDefault(
        "trtllm",
        tuple(list(range(1, 32)) + [32, 64, 128]),
        padding=False,
        setting="max_batch_size 128, enable_padding false",
        decode_only=True,
    ),
    EngineDefault(
        "trtllm-padded",
        tuple([1, 2, 4] + list(range(8, 129, 8))),
        setting="max_batch_size 128, enable_padding true",
        decode_only=True,
    ),
    EngineDefault("gmtool", tuple(DEFAULT_DECODE_BUCKETS), setting="gmtool's default decode buckets"),
)


def flags(sizes) -> dict:
    """Ready-to-paste settings for a capture set."""
    sizes = sorted(int(s) for s in sizes)
    if not sizes:  # eager beats every graph on this workload
        return {
            "vllm": {"cli": "--enforce-eager"},
            "sglang": {"cli": "--disable-cuda-graph"},
            "trtllm": {"yaml": "cuda_graph_config: null"},
        }
    spaced = " ".join(map(str, sizes))
    return {
        "vllm": {
            "cli": f"--cudagraph-capture-sizes {spaced}",
            "compilation_config": f"--compilation-config '{json.dumps({'cudagraph_capture_sizes': sizes})}'",
            "python": f"compilation_config={{'cudagraph_capture_sizes': {sizes}}}",
        },
        "sglang": {"cli": f"--cuda-graph-bs {spaced}"},
        "trtllm": {"yaml": f"cuda_graph_config:\n  batch_sizes: {sizes}\n  enable_padding: true"},
    }
