"""Triton kernels compiled before the first capture, in parallel threads.

A cold start compiled each Triton variant at its first launch, one after the other: the 35 default decode
buckets spent about 3.4 of 6 s compiling (H200, 2026-12-01). A compile spends most of its time in LLVM and
ptxas, which run without the GIL: compiled side by side, four variants took 2.2 s instead of 5.2 s on two CPU
cores (Triton 3.9). `compiling_only()` runs a forward whose Triton launches compile, in a thread pool, and do
not run (Triton's AsyncCompileMode with every launch turned into a warmup); leaving it waits for every
compile. The torch ops of such a forward still run, over whatever the skipped kernels left in their outputs:
only floating values, never an index, come out of gmtool's Triton kernels, so nothing reads out of bounds.

Off unless GMTOOL_COMPILE_AHEAD=1: in the one H200 run with it on (2026-12-01, 3ad1318), a cold capture of the 35
default decode buckets took 6.29 s against 6.06 s without it, and 1.1 s of compiling still fell inside the
captures; that run did not record whether it compiled anything, so it stays an experiment until one does
(`bench --stages capture` records compile_ahead_s and compile_ahead_note now).
"""

from __future__ import annotations

import contextlib
import os
from concurrent.futures import ThreadPoolExecutor

import torch

WORKERS = 8


def unavailable() -> str | None:
    """Why kernels cannot be compiled ahead here; None when they can."""
    if os.environ.get("GMTOOL_COMPILE_AHEAD", "0") != "1":
        return "off unless GMTOOL_COMPILE_AHEAD=1 (no gain measured yet)"
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

    with ThreadPoolExecutor(workers, initializer=bind_device) as pool, mode(pool):
        JITFunction.run = compile_instead
        try:
            yield
        finally:
            JITFunction.run = launch
