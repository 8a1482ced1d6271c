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
off. A warm cache is why a finished pass leaves a marker for its configuration (done_marker): the next run of
the same configuration skips the pass and loads each kernel at its first launch.

Threads were not enough: Triton holds the GIL through most of a compile, so nine variants in eight threads ran
nearly one after the other (a one-line kernel 0.8-1.0 s beside the others). Each variant now compiles in a
forked process first (ChildCompiles), its launcher in a grandchild beside it, and the thread loads it from the
disk cache; the longest compile is forked first (by_compile_cost). Cold, the 35 default decode buckets with
--fuse: 1.83, 1.87 and 1.84 s against 2.47 and 2.32 s in threads (H200, 2026-12-02, fresh processes alternated,
.diag/ctime.py; the pass 0.96-1.05 s against 1.26-1.51). GMTOOL_COMPILE_FORK=0 compiles in the threads.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import importlib
import json
import os
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

from gmtool.switches import switched_off
from gmtool.kernels.launcher import HELD

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

    children = ChildCompiles() if forks() else None

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
            builder = fork_to_run(functools.partial(_build_launcher, src))
            kernel = compile_kernel(src, *args, **kwargs)
            if builder is None or not _reap(builder, time.monotonic() + ChildCompiles.CHILD_TIMEOUT_S):
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


IN_CHILD = "in a compile child"  # compile_and_build_its_launcher's mode there


def forks() -> bool:
    """Whether compile-ahead compiles in forked processes (ChildCompiles): where os.fork exists and the worker
    can find a child's compile in Triton's disk cache (a cache directory, TRITON_ALWAYS_COMPILE off: else each
    variant would compile twice), unless GMTOOL_COMPILE_FORK=0."""
    if not hasattr(os, "fork") or switched_off("GMTOOL_COMPILE_FORK"):
        return False
    try:
        from triton import knobs

        if knobs.compilation.always_compile:
            return False
    except Exception:  # a Triton without knobs: its environment variable
        if os.environ.get("TRITON_ALWAYS_COMPILE", "0") not in ("", "0"):
            return False
    return _triton_cache_dir() is not None


class ChildCompiles:
    """Each variant compiled in a forked process, into Triton's disk cache; the pass's worker thread then finds
    it there and loads it. Triton's compiles hold the GIL through most of their stages (Python code generation
    and the MLIR passes), so in threads they ran nearly one after the other: a one-line kernel took 0.8-1.0 s
    to compile beside 8 others, and the pass 1.6-2.0 s for 9 variants (H200, 2026-12-02, .diag/ctime.py;
    alone, such kernels compile in 0.07-0.24 s on a 2-core CPU machine). A forked process has its own GIL.

    Every child is forked from the thread in compiling_only() (the main one, or gmtool.kernels.early_compile's
    after import_for_compiles) before any compile starts in this process: the workers wait (all_started) until
    the last one is, and once a worker stops waiting no child is forked any more (closed).
    A fork copies whatever locks other threads hold; a child only compiles (no CUDA call: the target is given,
    and loading is the worker's), with the GC off and its output to /dev/null, and leaves with os._exit,
    running no exit handler of the parent's. At most MAX_CHILDREN in a pass (the rest compile in the threads).
    A child that fails or outlives CHILD_TIMEOUT_S from its fork (killed with its process group: its launcher
    build and ptxas) leaves nothing in the cache, and the worker compiles the variant itself (failed counts)."""

    CHILD_TIMEOUT_S = 120.0
    STARTED_TIMEOUT_S = 60.0  # a mode that compiled at submit would otherwise wait here for ever
    MAX_CHILDREN = max(2, os.cpu_count() or 2)

    def __init__(self):
        self._started = threading.Event()
        self._keys: set = set()
        self._forked: dict[int, float] = {}  # pid: when
        self.closed = False
        self.failed = 0

    def start(self, key, compile_fn, prebuilding: list) -> int | None:
        """Fork a child that runs compile_fn (Triton's compile of one variant) unless key had one, the workers
        stopped waiting or MAX_CHILDREN were forked; its pid, or None."""
        if key in self._keys or self.closed or len(self._forked) >= self.MAX_CHILDREN:
            return None
        self._keys.add(key)

        def compile_here():
            prebuilding[0] = IN_CHILD
            compile_fn()

        pid = fork_to_run(compile_here, isolated=True)
        if pid is not None:
            self._forked[pid] = time.monotonic()
        return pid

    def all_started(self) -> None:
        self._started.set()

    def wait(self, pid: int) -> bool:
        """Wait for the child (after the last fork); whether it compiled."""
        if not self._started.wait(self.STARTED_TIMEOUT_S):
            self.closed = True  # this worker compiles next: no fork may follow
        ok = _reap(pid, self._forked.get(pid, time.monotonic()) + self.CHILD_TIMEOUT_S)
        self.failed += not ok
        return ok


def fork_to_run(fn, isolated: bool = False) -> int | None:
    """A forked child that runs fn and leaves with os._exit (0 if fn returned, 1 if it raised), never unwinding
    into the parent's code; its pid, or None where the fork failed. isolated (a child of this process's, which
    has threads): the child leads a process group of its own, which its children join (so a kill takes them
    too), its GC is off and its output goes to /dev/null (a thread of the parent's may have held the stream's
    lock at the fork)."""
    import warnings

    with warnings.catch_warnings():  # Python 3.12 warns of fork() in a process with threads: see ChildCompiles
        warnings.simplefilter("ignore", DeprecationWarning)
        try:
            pid = os.fork()
        except OSError:
            return None
    if pid == 0:
        code = 1
        try:
            if isolated:
                import gc
                import sys

                os.setpgid(0, 0)
                gc.disable()  # the parent's garbage (CUDA tensors among it) is not this process's to free
                null = os.open(os.devnull, os.O_WRONLY)
                os.dup2(null, 1)
                os.dup2(null, 2)
                sys.stdout = sys.stderr = open(null, "w")
            fn()
            code = 0
        finally:
            os._exit(code)
    return pid


def _reap(pid: int, deadline: float) -> bool:
    """Wait for a forked child until deadline (time.monotonic()), then kill its process group; whether it exited
    with 0. A child already reaped elsewhere (SIGCHLD ignored) counts as failed."""
    try:
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                return os.waitstatus_to_exitcode(status) == 0
            if time.monotonic() > deadline:
                break
            time.sleep(0.002)
        try:
            os.killpg(pid, 9)
        except OSError:
            os.kill(pid, 9)
        os.waitpid(pid, 0)
    except (ChildProcessError, ProcessLookupError):
        pass
    return False


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
    root = _triton_cache_dir()
    if root is None:
        return None
    try:
        digest = hashlib.sha256(json.dumps(configuration(ex, key, others, batch), sort_keys=True).encode())
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


_first_launch_work: list[threading.Thread] = []  # started at model load; joined before the first capture

# Triton 3.6's first argument specialization imports its Gluon package (to know its tensor descriptor type):
# 0.12 s inside the first warm-up on the H200's host (cProfile, 2026-12-01), where no .pyc was cached
FIRST_LAUNCH_IMPORTS = ("triton.experimental.gluon",)
# what a compile imports at its first use (Triton 3.9 imports its code generator, and through it Gluon, inside
# its first compile): imported before a compile child is forked from a thread other than the main one, else the
# child could inherit the lock of a module another thread was importing and wait on it until it is killed
COMPILE_IMPORTS = ("triton.compiler.code_generator",) + FIRST_LAUNCH_IMPORTS


def import_compile_modules() -> None:
    """COMPILE_IMPORTS imported (0.04 s once Triton is). Called on the main thread before another thread starts
    compiling: imported in that thread while the main one imports transformers (whose torch._dynamo imports
    Triton's modules too), two imports in a cycle would leave one thread a partly initialized module."""
    for name in COMPILE_IMPORTS:
        try:
            importlib.import_module(name)
        except Exception:  # another Triton: its compile imports what it needs
            pass


def import_for_compiles() -> None:
    """Triton's first-launch work (prepare_triton_in_background) done and COMPILE_IMPORTS imported, here."""
    prepare_triton_in_background()
    for work in _first_launch_work:
        work.join()
    import_compile_modules()


def prepare_triton_in_background() -> None:
    """Start, in two threads, what Triton's first kernel launch in a process would do, so that it overlaps the
    model's build; before_first_capture waits for both, so nothing is done twice.
    - Triton's hash of its own installation (libtriton.so and its sources): 0.4-0.7 s on the H200's host
      (profiled, 2026-12-01), inside the first warm-up. hashlib releases the GIL over large buffers.
    - The imports of FIRST_LAUNCH_IMPORTS, then the driver, whose C helpers (cuda_utils) an empty cache compiles
      with cc. With both in the first launch, 0.45 s passed in a cold process's pass before its first compile
      began; with them here, 0.19 s (H200, 2026-12-01, one process each)."""
    if _first_launch_work or os.environ.get("TRITON_INTERPRET") == "1":
        return
    try:
        from triton.runtime.cache import triton_key
    except ImportError:
        return

    def key():
        try:
            triton_key()
        except Exception:  # the first kernel computes it then, and says what is wrong
            pass

    def imports_and_driver():
        for name in FIRST_LAUNCH_IMPORTS:
            try:
                importlib.import_module(name)
            except Exception:  # another Triton: its first launch imports what it needs
                pass
        try:
            from triton.runtime import driver

            driver.active
        except Exception:  # the first launch creates it, and says what is wrong
            pass

    for name, fn in (("key", key), ("driver", imports_and_driver)):
        _first_launch_work.append(threading.Thread(target=fn, name=f"gmtool-triton-{name}", daemon=True))
        _first_launch_work[-1].start()


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

    for work in _first_launch_work:
        work.join()
    ex.compile_ahead_note = unavailable()
    if ex.device.type != "cuda" or ex.compile_ahead_note is not None:
        return
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        ex.compile_ahead_note = "not under --tp (every rank would run collectives on skipped kernels' output)"
        return
    others = pass_shapes(ex, key, batch)
    marker = done_marker(ex, key, others, batch)
    if marker is not None and _exists(marker):
        ex.compile_ahead_note = f"{SKIPPED}: this configuration's kernels were compiled into {marker.parents[1]} before"
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
        _mark(marker)
    except Exception as e:  # an optimization only: kernels then compile at their first launch, as before
        ex.compile_ahead_note = f"failed ({type(e).__name__}: {str(e).strip()[:120]}); kernels compile at launch"
    if others:  # fn's torch ops ran over skipped kernels' outputs, and may have written the inputs' buffers
        ex.inputs.invalidate()  # the next load rewrites every field and padding lane
        ex.inputs.load(batch, key)
