"""Compile-ahead's forked compiles: each Triton variant compiled in a process of its own (ChildCompiles), so that
compiles run side by side where in threads they took turns on the GIL; fork_to_run and reap are the fork and
the wait those use."""

from __future__ import annotations

import os
import threading
import time

from gmtool.kernels import compile_marker
from gmtool.switches import switched_off

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
    return compile_marker.triton_cache_dir() is not None


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
        ok = reap(pid, self._forked.get(pid, time.monotonic()) + self.CHILD_TIMEOUT_S)
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


def reap(pid: int, deadline: float) -> bool:
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
