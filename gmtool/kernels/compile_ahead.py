"""Triton kernels compiled before the first capture, in parallel threads.

A cold start compiled each Triton variant at its first launch, one after the other: the 35 default decode
buckets spent about 3.4 of 6 s compiling (H200, 2026-12-01). A compile spends most of its time in LLVM and
ptxas, which run without the GIL: compiled side by side, four variants took 2.2 s instead of 5.2 s on two CPU
cores (Triton 3.9). `compiling_only()` runs a forward whose Triton launches compile, in a thread pool, and do
not run (Triton's AsyncCompileMode with every launch turned into a warmup); leaving it waits for every
compile. The torch ops of such a forward still run, over whatever the skipped kernels left in their outputs:
only floating values, never an index, come out of gmtool's Triton kernels, so nothing reads out of bounds.

On by default since each worker also loads what it compiled: the load builds Triton's C launcher for the
kernel's signature (a cc run, about 0.2 s each), which otherwise happened at each first launch, one after the
other, as long as the compiles themselves. A cold capture of the 35 default decode buckets with --fuse (H200,
2026-12-01, 8 kernel variants) took 2.95 and 3.63 s with it against 6.49 and 5.71 s without; with a warm Triton
cache 1.51 and 2.20 s against 1.39 and 1.36 s (the pass itself: 0.36-0.44 s). GMTOOL_COMPILE_AHEAD=0 turns it
off. A warm cache is why a finished pass leaves a marker for its configuration (done_marker): the next run of
the same configuration skips the pass and loads each kernel at its first launch.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

WORKERS = 8
OFF = ("0", "false", "off", "no")  # GMTOOL_COMPILE_AHEAD values that turn it off


def unavailable() -> str | None:
    """Why kernels cannot be compiled ahead here; None when they can."""
    if os.environ.get("GMTOOL_COMPILE_AHEAD", "1").strip().lower() in OFF:
        return f"off: GMTOOL_COMPILE_AHEAD={os.environ['GMTOOL_COMPILE_AHEAD']}"
    if os.environ.get("TRITON_INTERPRET") == "1":
        return "the Triton interpreter compiles nothing"
    if _async_mode() is None:
        return "this Triton has no AsyncCompileMode"
    return None


def _async_mode():
    try:
        import triton
    except ImportError:
        return None
    cls = getattr(triton, "AsyncCompileMode", None)
    if cls is None:
        try:
            from triton.runtime._async_compile import AsyncCompileMode as cls
        except ImportError:
            return None
    return cls


@contextlib.contextmanager
def compiling_only(device: torch.device, workers: int = WORKERS):
    """Inside: a Triton launch compiles its kernel in a worker thread (once per variant) and returns without
    running it. On leaving: every compile has finished and sits in Triton's caches, as a launch leaves it."""
    from triton.runtime.jit import JITFunction

    mode = _async_mode()
    launch = JITFunction.run

    @functools.wraps(launch)  # __wrapped__ names Triton's run: launcher.FastLaunch compares launches with it
    def compile_instead(self, *args, grid, warmup, **kwargs):
        return launch(self, *args, grid=grid, warmup=True, **kwargs)

    # a thread's current CUDA device is its own, and Triton compiles for the current one: the workers take this
    # thread's (a device without an index, "cuda", names it)
    index = (
        (device.index if device.index is not None else torch.cuda.current_device()) if device.type == "cuda" else None
    )

    def bind_device():
        if index is not None:
            torch.cuda.set_device(index)

    class LoadingToo(mode):
        """Each worker loads the kernel it compiled too: the load builds Triton's C launcher for the kernel's
        signature (a cc run, about 0.2 s each on the H200's host, once per signature and Triton cache) and
        would otherwise happen at the first launch, one after the other."""

        def submit(self, key, compile_fn, *callbacks):  # finalize (and, from Triton 3.9, cleanup)
            def compile_and_load():
                kernel = compile_fn()
                try:
                    kernel._init_handles()
                except Exception:  # the first launch loads it again, and says what is wrong
                    pass
                return kernel

            return super().submit(key, compile_and_load, *callbacks)

    with ThreadPoolExecutor(workers, initializer=bind_device) as pool, LoadingToo(pool):
        JITFunction.run = compile_instead
        try:
            yield
        finally:
            JITFunction.run = launch


def _async_compiling() -> bool:
    """Whether an AsyncCompileMode is active in this context: its compiles run in threads, and Triton calls
    the post-compile hook when the mode exits, not when the compile ends."""
    try:
        from triton.runtime._async_compile import active_mode
    except ImportError:
        return False
    return active_mode.get() is not None


class CompileLog:
    """What Triton compiled (or, with a warm cache, loaded from disk) while it was open: each compile's kernel,
    variant (Triton's own description: the constexprs and specializations) and seconds. Kernels compiled
    in AsyncCompileMode (compiling_only) count, without seconds: compile-ahead's pass times them together."""

    def __init__(self):
        self.events: list[tuple[str, str, float | None]] = []
        self._started: dict[str, float | None] = {}  # per compile key: when it began (None: in a thread)

    def before(self, *, key, repr, fn, **_) -> None:
        self._started[str(key)] = None if _async_compiling() else time.perf_counter()
        return None  # anything truthy would skip the compile

    def after(self, *, key, repr, fn, **_) -> None:
        t0 = self._started.pop(str(key), None)
        self.events.append((fn.name, repr, None if t0 is None else time.perf_counter() - t0))

    def summary(self) -> dict:
        """compiles, seconds, and per kernel: variants and seconds, the dearest first."""
        kernels: dict[str, dict] = {}
        for name, _, sec in self.events:
            k = kernels.setdefault(name, {"variants": 0, "s": 0.0})
            k["variants"] += 1
            k["s"] += sec or 0.0
        ranked = dict(sorted(kernels.items(), key=lambda kv: -kv[1]["s"]))
        return {
            "compiles": len(self.events),
            "untimed": sum(sec is None for *_, sec in self.events),  # compiled ahead, in threads
            "compile_s": sum(sec or 0.0 for *_, sec in self.events),
            "kernels": {n: {"variants": k["variants"], "s": round(k["s"], 3)} for n, k in ranked.items()},
        }


@contextlib.contextmanager
def compile_log():
    """Yields a CompileLog of the Triton compiles inside (an empty one where this Triton has no JIT hooks)."""
    log = CompileLog()
    try:
        from triton import knobs

        hooks = knobs.runtime
        saved = hooks.jit_cache_hook, hooks.jit_post_compile_hook
    except (ImportError, AttributeError):
        yield log
        return
    hooks.jit_cache_hook, hooks.jit_post_compile_hook = log.before, log.after
    try:
        yield log
    finally:
        hooks.jit_cache_hook, hooks.jit_post_compile_hook = saved


SKIPPED = "skipped"  # the note's first word when a finished pass for this configuration left its marker


def _triton_cache_dir() -> Path | None:
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


def configuration(ex, key, small, batch) -> dict:
    """What decides which Triton variants a pass compiles: the software, the device, gmtool's sources (the
    kernels, and the code choosing their constexprs and shapes), the model and its fused layers, the cache and the
    two shapes the pass runs."""
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
        "shapes": [repr(key), repr(small), batch.num_seqs],
    }


def done_marker(ex, key, small, batch) -> Path | None:
    """The file a finished pass leaves in Triton's cache directory for this configuration. Its presence skips
    the pass: with every variant on disk, loading them at their first launches, one by one, was faster than the
    pass (H200, 2026-12-01, 35 decode buckets --fuse, warm cache: 1.84 and 1.45 s without it against 2.32 and
    1.86 s with it). If the cache lost kernels since, they compile at their first launch, as without the pass.
    None where the directory is unknown (the pass then always runs)."""
    root = _triton_cache_dir()
    if root is None:
        return None
    try:
        digest = hashlib.sha256(json.dumps(configuration(ex, key, small, batch), sort_keys=True).encode())
    except Exception:  # a model or config without what the digest reads: run the pass, as before
        return None
    return root / "gmtool-compiled-ahead" / digest.hexdigest()[:32]


def _exists(marker: Path) -> bool:
    try:
        return marker.exists()
    except OSError:  # an unreadable cache directory: run the pass
        return False


def _mark(marker: Path | None) -> None:
    if marker is None:
        return
    try:
        marker.parent.mkdir(parents=True, exist_ok=True)
        marker.write_text(time.strftime("%Y-%m-%dT%H:%M:%S") + "\n")
    except OSError:  # a read-only cache: the next run compiles ahead again
        pass


_triton_key: threading.Thread | None = None


def hash_triton_in_background() -> None:
    """Start Triton's hash of its own installation (libtriton.so and its sources) in a thread. Triton computes
    it once per process, at the first kernel it loads or compiles: 0.4-0.7 s on the H200's host (profiled,
    2026-12-01), inside the first warm-up. Started at model load, it runs beside building the model (hashlib
    releases the GIL over large buffers); before_first_capture waits for it, so it is never computed twice."""
    global _triton_key
    if _triton_key is not None or os.environ.get("TRITON_INTERPRET") == "1":
        return
    try:
        from triton.runtime.cache import triton_key
    except ImportError:
        return

    def run():
        try:
            triton_key()
        except Exception:  # the first kernel computes it then, and says what is wrong
            pass

    _triton_key = threading.Thread(target=run, name="gmtool-triton-key", daemon=True)
    _triton_key.start()


def before_first_capture(ex, key, batch, fn) -> None:
    """Before an executor's first warm-up (on CUDA, unless GMTOOL_COMPILE_AHEAD=0): this shape's forward and the
    smallest decode bucket's run inside compiling_only(), so the kernels later shapes need (split decode for
    small batches) are compiled too. Their torch ops run over the views' current contents; the warm-up and the
    capture's first replay then compute the batch properly. Sets ex.compile_ahead_s, or ex.compile_ahead_note: why not."""
    from gmtool.model.attention import forward_context

    if _triton_key is not None:
        _triton_key.join()
    ex.compile_ahead_note = unavailable()
    if ex.device.type != "cuda" or ex.compile_ahead_note is not None:
        return
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        ex.compile_ahead_note = "not under --tp (every rank would run collectives on skipped kernels' output)"
        return
    small = ex.policy.key_for(ex.policy.sizes[0], min(ex.policy.sizes[0], batch.num_seqs), True)
    other = key.decode and small != key
    marker = done_marker(ex, key, small, batch)
    if marker is not None and _exists(marker):
        ex.compile_ahead_note = f"{SKIPPED}: this configuration's kernels were compiled into {marker.parents[1]} before"
        return
    t0 = time.perf_counter()
    try:
        with compiling_only(ex.device), torch.no_grad():
            fn()  # within the caller's forward context: this shape, this batch
            if other:  # a zeroed arena: every index the torch ops read is 0, in range (the null block, token 0)
                ex.inputs.arena.zero_()
                views = ex.inputs.views(small)
                with forward_context(ex._context(small, views, batch)):
                    ex.forward(views)
        ex.compile_ahead_s = time.perf_counter() - t0
        _mark(marker)
    except Exception as e:  # an optimization only: kernels then compile at their first launch, as before
        ex.compile_ahead_note = f"failed ({type(e).__name__}: {str(e).strip()[:120]}); kernels compile at launch"
    if other:
        ex.inputs.invalidate()  # the next load rewrites every field and padding lane
        ex.inputs.load(batch, key)
