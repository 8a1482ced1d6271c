"""Triton kernels compiled before the first capture, in parallel: each in a forked process, loaded in a thread.

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
off. A warm cache is why a finished pass leaves a marker for its configuration (compile_marker): the next run of
the same configuration skips the pass and loads each kernel at its first launch.

Threads were not enough: Triton holds the GIL through most of a compile, so nine variants in eight threads ran
nearly one after the other (a one-line kernel 0.8-1.0 s beside the others). Each variant now compiles in a
forked process first (compile_children.ChildCompiles), its launcher in a grandchild beside it, and the thread
loads it from the disk cache; the longest compile is forked first (by_compile_cost). Cold, the 35 default decode
buckets with --fuse: 1.83, 1.87 and 1.84 s against 2.47 and 2.32 s in threads (H200, 2026-12-02, fresh processes
alternated, .diag/ctime.py; the pass 0.96-1.05 s against 1.26-1.51). GMTOOL_COMPILE_FORK=0 compiles in the
threads. Triton's own first-launch work starts at the model's load (triton_prep).
"""

from __future__ import annotations

import contextlib
import functools
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from gmtool.kernels import compile_children, compile_marker, triton_prep
from gmtool.kernels.compile_children import IN_CHILD, ChildCompiles
from gmtool.kernels.launcher import HELD
from gmtool.switches import switched_off

WORKERS = 8


def unavailable() -> str | None:
    """Why kernels cannot be compiled ahead here; None when they can."""
    if switched_off("GMTOOL_COMPILE_AHEAD"):
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


# one compiling_only() at a time in a process: each replaces Triton's run and compile and puts back what it found,
# so two that overlapped would leave the first one's stand-in in place for good
_WINDOW = threading.RLock()


@contextlib.contextmanager
def compiling_only(device: torch.device, workers: int = WORKERS, held_out: list | None = None):
    """Inside: a Triton launch of this thread returns without running (another thread's runs: the build's own
    work beside gmtool.kernels.early_compile); on leaving, each variant launched compiles in a worker thread
    (first in a forked child: ChildCompiles, yielded, None where forks() is False), and when it is left every
    compile has finished and sits in Triton's caches, as a launch leaves it. held_out gets the number of
    distinct launches held. Another thread's compiling_only() waits for this one to end."""
    with _WINDOW, _compiling_only(device, workers, held_out) as children:
        yield children


@contextlib.contextmanager
def _compiling_only(device: torch.device, workers: int, held_out: list | None):
    from triton.runtime.jit import JITFunction

    mode = _async_mode()
    launch = JITFunction.run

    # Launches are held until the forwards inside are done, then made as warmups (compiled in the workers, not
    # run). Made as they came, the compiles' threads took the GIL from the forward issuing them: the last variant
    # (the second shape's decode kernel) began compiling 0.53 s after the first; held, 0.28 s after (H200,
    # 2026-12-01, two calls, one cold process each). A launch returns launcher.HELD: FastLaunch and BoundKernel
    # keep no variant from it. Its tensors are held as stand-ins (_StandIns): not the forward's activations.
    # A launch the same as one held (the same kernel, stand-ins, ints and constexprs: layers past the first
    # repeat the first's) is not held again: each made its way through Triton's binder, 0.2-0.3 s for the pass's
    # ~700 launches of 35 decode shapes (H200, 2026-12-02).
    held: dict = {}
    stand_ins = _StandIns()
    owner = threading.get_ident()

    @functools.wraps(launch)  # __wrapped__ names Triton's run: launcher.FastLaunch compares launches with it
    def compile_instead(self, *args, grid, warmup, **kwargs):
        if threading.get_ident() != owner:
            return launch(self, *args, grid=grid, warmup=warmup, **kwargs)
        made = (self, tuple(map(stand_ins, args)), grid, {k: stand_ins(v) for k, v in kwargs.items()})
        try:
            key = (id(self), made[1], grid, tuple(made[3].items()), _types(made[1]), _types(made[3].values()))
            hash(key)
        except TypeError:  # an unhashable argument: held as it is
            key = len(held)
        held.setdefault(key, made)
        return HELD

    # a thread's current CUDA device is its own, and Triton compiles for the current one: the workers take this
    # thread's (a device without an index, "cuda", names it)
    index = (
        (device.index if device.index is not None else torch.cuda.current_device()) if device.type == "cuda" else None
    )

    def bind_device():
        if index is not None:
            torch.cuda.set_device(index)

    children = ChildCompiles() if compile_children.forks() else None

    class LoadingToo(mode):
        """Each worker loads the kernel it compiled too: the load builds Triton's C launcher for the kernel's
        signature (a cc run, about 0.2 s each on the H200's host, once per signature and Triton cache) and
        would otherwise happen at the first launch, one after the other. With ChildCompiles, a forked process
        compiles it first, into Triton's disk cache: the worker's compile then finds it there."""

        def submit(self, key, compile_fn, *callbacks):  # finalize (and, from Triton 3.9, cleanup)
            # a key submitted before gets its first compile back from the mode: no second child
            child = children.start(key, compile_fn, prebuilding) if children is not None else None

            def compile_and_load():
                if child is not None:
                    children.wait(child)
                kernel = compile_fn()
                try:
                    kernel._init_handles()
                except Exception:  # the first launch loads it again, and says what is wrong
                    pass
                return kernel

            return super().submit(key, compile_and_load, *callbacks)

    import triton.compiler as compiler_package

    compile_kernel, prebuilding = compiler_package.compile, [True]

    @functools.wraps(compile_kernel)
    def compile_and_build_its_launcher(src, *args, **kwargs):
        """Triton's compile, with the kernel's C launcher built beside it: the launcher's source follows from the
        signature alone, known before the compile. One after the other, a compile of 0.3-0.7 s and its launcher
        of 0.25-0.32 s made the pass's longest chain; built beside, most loads then found theirs, in 0-2 ms
        (H200, 2026-12-01). A kernel whose binder Triton made in here keeps this as its compile: outside the
        pass it only compiles."""
        if prebuilding[0] == IN_CHILD:  # a compile child has no threads: the launcher in a process of its own
            builder = compile_children.fork_to_run(functools.partial(_build_launcher, src))
            kernel = compile_kernel(src, *args, **kwargs)
            if builder is None or not compile_children.reap(builder, time.monotonic() + ChildCompiles.CHILD_TIMEOUT_S):
                _build_launcher(src)
            return kernel
        if prebuilding[0]:
            with contextlib.suppress(RuntimeError):  # the pass ended since: its pool takes no more
                builders.submit(_build_launcher, src)
        return compile_kernel(src, *args, **kwargs)

    builders, mode_in_use = ThreadPoolExecutor(workers), None
    try:
        with ThreadPoolExecutor(workers, initializer=bind_device) as pool, LoadingToo(pool) as mode_in_use:
            JITFunction.run = compile_instead
            compiler_package.compile = compile_and_build_its_launcher  # what Triton's binder takes at a first launch
            try:
                yield children
                for kernel, args, grid, kwargs in by_compile_cost(held.values()):
                    launch(kernel, *args, grid=grid, warmup=True, **kwargs)
            finally:
                if children is not None:
                    children.all_started()  # every fork made (or a launch raised): the workers may go on
                if held_out is not None:
                    held_out.append(len(held))
                held.clear()
                JITFunction.run = launch
                compiler_package.compile = compile_kernel
    finally:
        # only once the mode's exit has waited for every compile: a compile queued behind busy pool threads (more
        # variants than threads) starts there, and is the pass's too
        prebuilding[0] = False
        builders.shutdown(wait=False)  # a launcher still building is found in the cache, or built again, by its load
        _unset(mode_in_use)


def _types(values) -> tuple:
    """The types of a launch's arguments: 1, True and 1.0 are equal keys, Triton's variants for them are not."""
    return tuple(type(v) for v in values)


def by_compile_cost(launches) -> list:
    """Held launches, the kernels with the longest source first (stable: a kernel's launches keep their order):
    the longest compile starts first. In launch order the decode split kernel's variants, 0.85-1.1 s each in a
    child against 0.2-0.5 s for the others, were forked last, 0.35 s into the pass (H200, 2026-12-02)."""
    return sorted(launches, key=lambda h: -len(getattr(h[0], "src", "") or ""))


def _unset(mode) -> None:
    """Triton 3.6's AsyncCompileMode raises a failed compile from its exit before unsetting itself (3.9 unsets it
    first): left active, every later launch in this thread would submit its compile to the pass's shut-down pool,
    failing the capture the pass's failure should leave to compile at launch."""
    try:
        from triton.runtime._async_compile import active_mode
    except ImportError:
        return
    if mode is not None and active_mode.get() is mode:
        active_mode.set(None)


class _StandIns:
    """A tensor argument as Triton specializes a launch on it, its dtype and whether its address is 16-byte
    aligned, in a tensor of a few bytes on the same device: held launches must not keep the forwards'
    activations alive until the pass ends (a prefill shape's three layers can hold gigabytes). Anything else
    is itself."""

    def __init__(self):
        self.made: dict[tuple, torch.Tensor] = {}

    def __call__(self, a):
        if not isinstance(a, torch.Tensor):
            return a
        aligned = a.data_ptr() % 16 == 0
        key = (a.device, a.dtype, aligned)
        s = self.made.get(key)
        if s is None:
            base = torch.empty(32, dtype=a.dtype, device=a.device)  # the allocator's blocks are 512-byte aligned
            s = base[:1] if aligned else base[1:2]  # one element in: misaligned, for elements under 16 bytes
            if (s.data_ptr() % 16 == 0) != aligned:
                return a  # no stand-in of that class: the tensor itself
            self.made[key] = s
        return s


class _PlainKernelMetadata:
    """What a launcher reads of a compiled kernel's metadata, as gmtool's kernels have it: one CTA, no cluster, no
    TMA descriptor, no scratch. Where the real metadata differs, the launcher built from it is another (built at
    the kernel's load, as without the prebuild)."""

    cluster_dims = (1, 1, 1)
    num_ctas = 1
    tensordesc_meta = None
    global_scratch_size = profile_scratch_size = 0
    global_scratch_align = profile_scratch_align = 1
    launch_cooperative_grid = launch_pdl = False

    def __getattr__(self, name):  # another Triton's field: its default
        return None


def _build_launcher(src) -> None:
    """Build (and cache on disk) the C launcher Triton makes for src's signature at the kernel's load."""
    try:
        from triton.runtime import driver

        driver.active.launcher_cls(src, _PlainKernelMetadata())
    except Exception:  # an optimization only: the load builds it, and says what is wrong
        pass


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
            "untimed": sum(sec is None for *_, sec in self.events),  # compiled ahead, in the pass
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


PASS_LAYERS = 3  # layers 0, 1 and 2: an int argument that follows the layer is 0, 1 and neither (Triton keys those)


def pass_layers(config) -> int:
    """How many leading layers compile-ahead's forwards run: PASS_LAYERS, or up to the first layer of each type
    the config lists (a sliding-window model's full-attention layer). Later layers launch the same variants; one
    that does not (another MLP from some depth on) compiles at its first launch, as without the pass."""
    n = config.num_hidden_layers
    types = list(getattr(config, "layer_types", None) or [])[:n]
    first_of_each = max((types.index(t) + 1 for t in set(types)), default=0)
    return min(n, max(PASS_LAYERS, first_of_each))


@contextlib.contextmanager
def leading_layers(lm):
    """Inside: the model's forward runs only its pass_layers() first decoder layers. Its decoder stack runs
    `layers[: config.num_hidden_layers]`, as transformers' own forwards and gmtool's fused one do (a family that
    runs all its layers regardless runs them all). The whole forward of the first shape kept the main thread
    0.48 s, the second shape's compiles waiting behind it (H200, 2026-12-01, 28 layers)."""
    from gmtool.model import families

    base = families.base_model(lm.model)
    config = getattr(base, "config", None)
    n = getattr(config, "num_hidden_layers", None)
    if not isinstance(n, int):
        yield
        return
    config.num_hidden_layers = pass_layers(config)
    try:
        yield
    finally:
        config.num_hidden_layers = n


def pass_shapes(ex, key, batch) -> list:
    """The other shapes compile-ahead's pass runs beside key's own: for a decode key every decode bucket's, the
    smallest first (held launches compile in the order they came, and its split decode kernel and combine are
    among the slowest compiles). The variants a shape launches follow from it (the decode split count, the
    combine's dims a program, the small-M GEMM's tiles), and only running the shape tells which: with the
    smallest and the largest alone, the combine variant of the middle buckets compiled inside the capture of
    bucket 128, 0.27-0.36 s of a cold --fuse capture of the 35 default decode buckets (H200, 2026-12-02). All 35
    forwards cost the pass 0.07-0.13 s, and no variant compiles in a capture after it. Making the first two
    shapes' launches (their compiles started) before the other forwards ran gained nothing: the forwards then took
    0.7 s, the compiles' threads holding the GIL, and the pass 1.24-1.26 s against 1.12-1.44 (cold processes
    alternated, .diag/caab.py)."""
    if not key.decode:
        return []
    # a decode bucket holds a sequence a token: one past the sequence slots is never captured (nor its forward sound)
    keys = (ex.policy.key_for(s, s, True) for s in sorted(ex.policy.sizes) if s <= ex.inputs.max_seqs)
    return [k for k in dict.fromkeys(keys) if k != key]


def before_first_capture(ex, key, batch, fn) -> None:
    """Before an executor's first warm-up (on CUDA, unless GMTOOL_COMPILE_AHEAD=0): the forwards of pass_shapes()
    and then this shape's run inside compiling_only(), so the kernels later shapes need are compiled too. Their
    torch ops run over the views' current contents; the warm-up and the capture's first replay then compute the
    batch properly. Sets ex.compile_ahead_s (and of it, the forwards' seconds: ex.compile_ahead_forwards_s), or
    ex.compile_ahead_note: why not."""
    from gmtool.model.attention import forward_context

    triton_prep.join_first_launch_work()
    ex.compile_ahead_note = unavailable()
    if ex.device.type != "cuda" or ex.compile_ahead_note is not None:
        return
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        ex.compile_ahead_note = "not under --tp (every rank would run collectives on skipped kernels' output)"
        return
    others = pass_shapes(ex, key, batch)
    marker = compile_marker.done_marker(ex, key, others, batch)
    if marker is not None and compile_marker.exists(marker):
        ex.compile_ahead_note = (
            f"{compile_marker.SKIPPED}: this configuration's kernels were compiled into {marker.parents[1]} before"
        )
        return
    t0 = time.perf_counter()
    try:
        with compiling_only(ex.device) as children, torch.no_grad(), leading_layers(ex.lm):
            if others:  # a zeroed arena: every index the torch ops read is 0, in range (the null block, token 0)
                ex.inputs.arena.zero_()
                for other in others:
                    views = ex.inputs.views(other)
                    with forward_context(ex._context(other, views, batch)):
                        ex.forward(views)
                ex.inputs.invalidate()
                ex.inputs.load(batch, key)
            fn()  # within the caller's forward context: this shape, this batch
            forwards_s = time.perf_counter() - t0
        ex.compile_ahead_s, ex.compile_ahead_forwards_s = time.perf_counter() - t0, forwards_s
        if children is not None and children.failed:  # the pass still compiled them, in its threads: slower
            ex.compile_ahead_note = f"{children.failed} forked compile(s) failed, compiled in threads instead"
        compile_marker.mark(marker)
    except Exception as e:  # an optimization only: kernels then compile at their first launch, as before
        ex.compile_ahead_note = f"failed ({type(e).__name__}: {str(e).strip()[:120]}); kernels compile at launch"
    if others:  # fn's torch ops ran over skipped kernels' outputs, and may have written the inputs' buffers
        ex.inputs.invalidate()  # the next load rewrites every field and padding lane
        ex.inputs.load(batch, key)
