"""The decode attention's Triton kernels compiled while the model is still being built.

compile-ahead's pass (gmtool.kernels.compile_ahead) needs the model: its forwards find the variants, and it runs
at the first capture, after the build. The attention kernels' variants follow from the config alone (heads, head
dim, the KV cache's block size and length, each bucket's size), so a thread can launch them, as compiling_only
holds launches, from the build's start, beside transformers' import and the model's build (several seconds on
the H200's host); the build joins it at its end, and the pass then finds them compiled (a cold cache) or loaded
(a warm one). The split decode kernel is the longest compile of a cold capture (0.85-1.1 s in a child).

Only where the variants can be told from the config: decode buckets, families whose attention is plain (no
sliding window, soft-cap, sinks or MLA) unless their config says otherwise, no --tp (the heads per rank) and no
--pdl (another variant). A guess that misses compiles for nothing; the kernels the capture needs then compile in
the pass, as without this. GMTOOL_EARLY_COMPILE=0 turns it off.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field

import torch

from gmtool.switches import switched_off


@dataclass(frozen=True)
class DecodeGeometry:
    """What the decode attention's kernels specialize on, read from the config."""

    heads: int
    kv_heads: int
    head_dim: int
    block_size: int
    max_kv_len: int
    dtype: torch.dtype
    sizes: tuple[int, ...]  # the decode buckets' sizes, smallest first
    max_tokens: int
    max_seqs: int


@dataclass
class EarlyCompile:
    """The thread compiling, and what it did: its launches, its seconds, the build's wait for it."""

    geometry: DecodeGeometry
    thread: threading.Thread | None = None
    launches: int = 0  # distinct launches held: each bucket's K/V write, split kernel and combine
    seconds: float | None = None
    waited_s: float = 0.0
    error: str | None = None
    _t0: float = field(default_factory=time.perf_counter)

    def join(self) -> None:
        if self.thread is not None and self.thread.is_alive():
            t = time.perf_counter()
            self.thread.join()
            self.waited_s += time.perf_counter() - t

    def summary(self) -> str:
        if self.error is not None:
            return f"attention kernels compiled during the build: failed ({self.error}); they compile at the pass"
        return (
            f"the decode attention kernels of {len(self.geometry.sizes)} bucket sizes compiled (or loaded) during "
            f"the model's build, {self.seconds or 0.0:.2f} s beside it, {self.waited_s:.2f} s waited at its end"
        )


def raw_config(spec: str) -> dict | None:
    """The model's config as its JSON says, without transformers (not imported yet): None where unreadable."""
    from gmtool.model.loading import read_config

    try:
        return read_config(spec)[0]
    except Exception:  # the build says what is wrong with it
        return None


PLAIN_TYPES = {"full_attention", "attention"}  # layer_types entries of plain attention
# families whose attention is plain when the config leaves a field out (a saved config holds only what differs
# from its class's defaults: gemma2's leave out their window and soft-cap, falcon's its one KV head)
PLAIN_FAMILIES = {"llama", "qwen2", "qwen2_moe", "qwen3", "qwen3_moe"}


def geometry(cfg, raw: dict | None) -> DecodeGeometry | None:
    """The decode geometry of a run of cfg over a model of config raw; None where it cannot be told, or the run
    captures no decode bucket."""
    if raw is None or cfg.scenario != "decode" or cfg.tp != 1 or cfg.pdl:
        return None
    if raw.get("model_type") not in PLAIN_FAMILIES:
        return None
    windowed = raw.get("sliding_window") and raw.get("use_sliding_window") is not False
    if windowed or any(raw.get(k) for k in ("attn_logit_softcapping", "kv_lora_rank", "text_config")):
        return None
    if set(raw.get("layer_types") or ()) - PLAIN_TYPES:  # sliding layers
        return None
    try:
        heads = int(raw["num_attention_heads"])
        kv_heads = int(raw.get("num_key_value_heads") or heads)
        head_dim = int(raw.get("head_dim") or int(raw["hidden_size"]) // heads)
    except (KeyError, TypeError, ValueError, ZeroDivisionError):
        return None
    policy = cfg.policy()
    sizes = tuple(s for s in sorted(policy.sizes) if s <= cfg.max_num_seqs)
    if not sizes or heads <= 0 or kv_heads <= 0 or heads % kv_heads:
        return None
    return DecodeGeometry(
        heads, kv_heads, head_dim, cfg.block_size, cfg.max_kv_len, cfg.torch_dtype, sizes, policy.max_tokens,
        cfg.max_num_seqs,
    )  # fmt: skip


def start(cfg) -> EarlyCompile | None:
    """Start compiling cfg's decode attention kernels in a thread (CUDA, Triton attention, compile-ahead on);
    None where nothing is started. A second build of the geometry in a process starts another: its launches find
    the first's kernels compiled, and its figures are its own."""
    from gmtool.kernels import compile_ahead, triton_prep

    if cfg.torch_device.type != "cuda" or cfg.attention_backend != "triton" or switched_off("GMTOOL_EARLY_COMPILE"):
        return None
    if compile_ahead.unavailable():
        return None
    geom = geometry(cfg, raw_config(cfg.model))
    if geom is None:
        return None
    from gmtool.kernels import TritonAttention  # imported here, not beside the main thread's imports

    triton_prep.import_compile_modules()  # so are what Triton's compiles import at their first use

    device = cfg.torch_device
    if device.index is None:  # a thread's current device is its own: name this one's
        device = torch.device("cuda", torch.cuda.current_device())
    run = EarlyCompile(geom)
    run.thread = threading.Thread(
        target=_compile, args=(run, TritonAttention(), device), name="gmtool-early-compile", daemon=True
    )
    run.thread.start()
    return run


def _compile(run: EarlyCompile, backend, device: torch.device) -> None:
    """Each decode bucket's K/V write and attention launched as the HF layers launch them (ForwardContext.attend
    over an executor's own input layout: the metadata's alignment is a key of the variant), held and compiled."""
    from gmtool.core.buckets import BucketPolicy
    from gmtool.core.inputs import PersistentInputs
    from gmtool.core.kv_cache import KVCacheSpec, PagedKVCache
    from gmtool.kernels import compile_ahead, triton_prep
    from gmtool.model.attention import ForwardContext

    g = run.geometry
    try:
        if device.type == "cuda":
            torch.cuda.set_device(device)
        triton_prep.import_for_compiles()  # before this thread forks compile children (ChildCompiles)
        spec = KVCacheSpec(1, g.kv_heads, g.head_dim, g.block_size, g.max_kv_len, g.dtype)
        cache = PagedKVCache(spec, 2, device)  # a block's strides do not depend on the number of blocks
        inputs = PersistentInputs(g.max_tokens, g.max_seqs, spec.blocks_per_seq, 1, g.dtype, device)
        policy = BucketPolicy(list(g.sizes), g.max_tokens)
        held: list[int] = []
        with compile_ahead.compiling_only(device, held_out=held), torch.no_grad():
            for size in g.sizes:
                views = inputs.views(policy.key_for(size, size, True))
                q = torch.empty(size, g.heads, g.head_dim, dtype=g.dtype, device=device)
                k = torch.empty(size, g.kv_heads, g.head_dim, dtype=g.dtype, device=device)
                ForwardContext(cache, views, "decode", backend=backend).attend(0, q, k, torch.empty_like(k), 1.0)
        run.launches = held[0] if held else 0
    except Exception as e:  # an optimization only: the pass compiles what is missing
        from gmtool.errors import first_line

        run.error = first_line(e, typed=True)
    finally:
        run.seconds = time.perf_counter() - run._t0
