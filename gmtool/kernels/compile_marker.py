"""The marker a finished compile-ahead pass leaves in Triton's cache directory for its configuration: what decides
which variants a pass compiles (configuration), hashed into the marker's name (done_marker). A later run of the
same configuration finds it and skips the pass."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import torch

SKIPPED = "skipped"  # the note's first word when a finished pass for this configuration left its marker


def triton_cache_dir() -> Path | None:
    """Triton's disk cache (TRITON_CACHE_DIR, else its default under the home directory); None if unknown."""
    try:
        from triton import knobs

        d = knobs.cache.dir
    except Exception:  # no knobs in this Triton, or a setting it cannot read
        d = os.environ.get("TRITON_CACHE_DIR")
    return Path(d) if d else None


def _cache_env() -> dict:
    """Every TRITON_* variable (TRITON_DEBUG, say, changes the compile options) and those Triton's own cache key
    reads (DISABLE_LLVM_OPT and the like)."""
    env = {k: v for k, v in os.environ.items() if k.startswith("TRITON_") and k != "TRITON_CACHE_DIR"}
    try:
        from triton._C.libtriton import get_cache_invalidating_env_vars

        env.update(get_cache_invalidating_env_vars())
    except Exception:  # a Triton without the list: the TRITON_* ones stand
        pass
    return dict(sorted(env.items()))


def configuration(ex, key, others, batch) -> dict:
    """What decides which Triton variants a pass compiles: the software, the device, gmtool's sources (the
    kernels, and the code choosing their constexprs and shapes), the model and its fused layers, the cache and the
    shapes the pass runs."""
    import triton

    sources = hashlib.sha256()
    package = Path(__file__).parents[1]
    for f in sorted(package.rglob("*.py")):
        sources.update(str(f.relative_to(package)).encode() + f.read_bytes())
    lm, dev = ex.lm, ex.device
    config = lm.config.to_json_string() if hasattr(lm.config, "to_json_string") else repr(lm.config)
    fused = getattr(lm, "fused", None)
    return {
        "triton": triton.__version__,
        "torch": torch.__version__,
        "device": torch.cuda.get_device_name(dev) if dev.type == "cuda" else str(dev),
        "capability": list(torch.cuda.get_device_capability(dev)) if dev.type == "cuda" else None,
        "env": _cache_env(),
        "sources": sources.hexdigest(),
        "model": hashlib.sha256(config.encode()).hexdigest(),
        "dtype": str(next(lm.model.parameters()).dtype),
        "fused": getattr(fused, "summary", None),
        "ops": [getattr(getattr(fused, "ops", None), a, None) for a in ("triton", "small_m", "pdl")],
        "tp": getattr(lm, "tp", 1),
        "forward": type(ex.forward_impl).__name__,
        "attention": getattr(ex.attention, "name", type(ex.attention).__name__),
        "cache": [repr(ex.cache.spec), ex.cache.num_blocks],
        # whichever decode bucket is captured first (its batch's sequences select no variant); a prefill key's own
        "shapes": [sorted(map(repr, (key, *others))), None if key.decode else batch.num_seqs],
    }


def done_marker(ex, key, others, batch) -> Path | None:
    """The file a finished pass leaves in Triton's cache directory for this configuration. Its presence skips
    the pass: with every variant on disk, loading them at their first launches, one by one, was faster than the
    pass (H200, 2026-12-01, 35 decode buckets --fuse, warm cache: 1.84 and 1.45 s without it against 2.32 and
    1.86 s with it). If the cache lost kernels since, they compile at their first launch, as without the pass.
    None where the directory is unknown (the pass then always runs)."""
    root = triton_cache_dir()
    if root is None:
        return None
    try:
        digest = hashlib.sha256(json.dumps(configuration(ex, key, others, batch), sort_keys=True).encode())
    except Exception:  # a model or config without what the digest reads: run the pass, as before
        return None
    return root / "gmtool-compiled-ahead" / digest.hexdigest()[:32]


def exists(marker: Path) -> bool:
    try:
        return marker.exists()
    except OSError:  # an unreadable cache directory: run the pass
        return False


def mark(marker: Path | None) -> None:
    if marker is None:
        return
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(time.strftime("%Y-%m-%dT%H:%M:%S") + "\n")
    except OSError:  # a read-only cache: the next run compiles ahead again
        pass
