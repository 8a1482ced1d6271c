"""Triton compiles in worker processes for compile-ahead's pass: opt-in, GMTOOL_COMPILE_PROCESSES=N.

In threads, a compile's Python parts (the AST walk that writes Triton's IR, the cache keys) take turns on the
GIL with every other compile and with the thread issuing them: in a cold --fuse pass the split decode kernel
compiled in 0.66-0.92 s beside six others, the pass taking about 1 s (H200, 2026-12-01). A worker is a fresh
interpreter (`python -m gmtool.kernels.compile_workers`) started at model load, its imports overlapping the
model's build. It rebuilds a job's source from the kernel's module and name, checks that it hashes as the
parent's did (the hash keys Triton's disk cache), compiles it into the shared cache and says so; the thread that
sent the job then compiles the same source, which Triton finds on disk. A worker not ready yet, a source the
worker cannot rebuild to the same hash, or any failure: the thread compiles it itself, as without workers.
Not measured on the GPU yet (written without a device): off by default until it is.
"""

from __future__ import annotations

import atexit
import importlib
import os
import pickle
import queue
import struct
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

ENV = "GMTOOL_COMPILE_PROCESSES"
_HEADER = struct.Struct("<Q")


def requested() -> int:
    """Worker processes asked for (GMTOOL_COMPILE_PROCESSES; 0, the default, for none)."""
    raw = os.environ.get(ENV, "0").strip() or "0"
    try:
        return max(0, min(int(raw), 32))
    except ValueError:
        return 0


def _write(stream, obj) -> None:
    data = pickle.dumps(obj)
    stream.write(_HEADER.pack(len(data)) + data)
    stream.flush()


def _read(stream):
    head = stream.read(_HEADER.size)
    if len(head) < _HEADER.size:
        return None  # the other side closed the pipe
    (n,) = _HEADER.unpack(head)
    return pickle.loads(stream.read(n))


def job_of(src, kwargs: dict) -> tuple | None:
    """What a worker needs to compile src as Triton's compile(src, **kwargs) would: the kernel's module and name,
    its signature, constants, attributes, the keyword arguments and the source's hash; None where src is not a
    module-level kernel's AST source."""
    fn = getattr(src, "fn", None)
    module, name = getattr(fn, "__module__", None), getattr(src, "name", None)
    if not module or not name or not hasattr(src, "hash"):
        return None
    constants = getattr(src, "constants", None)
    return (module, name, dict(src.signature), dict(constants or {}), getattr(src, "attrs", None), kwargs, src.hash())


@dataclass
class Stats:
    jobs: int = 0  # compiles handed to compile_in_worker
    in_workers: int = 0  # compiled by a worker
    fallbacks: dict[str, int] = field(default_factory=dict)  # why not, counted

    def fell_back(self, why: str) -> bool:
        self.fallbacks[why] = self.fallbacks.get(why, 0) + 1
        return False


class _Worker:
    def __init__(self, env: dict):
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "gmtool.kernels.compile_workers"],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            env=env,
        )
        self.exited = False  # its pipe broke or closed: it takes no more jobs

    def ask(self, job) -> tuple:
        try:
            _write(self.proc.stdin, job)
            reply = _read(self.proc.stdout)
        except OSError as e:  # a broken pipe: the worker is gone
            self.exited = True
            return ("error", f"the worker exited ({type(e).__name__})")
        if reply is None:
            self.exited = True
            return ("error", "the worker exited")
        return reply

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(timeout=5)
        except Exception:  # a worker stuck in a compile: it holds nothing of ours
            self.proc.kill()


class CompileWorkers:
    """n worker processes compiling into Triton's cache directory cache_dir; each is handed to a job once it has
    said it is ready."""

    def __init__(self, n: int, cache_dir: str | None):
        env = dict(os.environ)
        if cache_dir:
            env["TRITON_CACHE_DIR"] = cache_dir
        root = str(Path(__file__).resolve().parents[2])  # the tree this gmtool runs from, first on the path
        env["PYTHONPATH"] = os.pathsep.join([root, *filter(None, [env.get("PYTHONPATH")])])
        self.stats = Stats()
        self.idle: queue.Queue[_Worker] = queue.Queue()
        self.ready, self.exited, self._lock = 0, 0, threading.Lock()  # workers that said ready; of those, gone
        self.workers = [_Worker(env) for _ in range(n)]
        for w in self.workers:
            threading.Thread(target=self._await_ready, args=(w,), daemon=True).start()

    def _await_ready(self, w: _Worker) -> None:
        hello = _read(w.proc.stdout)
        if hello is not None and hello[0] == "ready":
            with self._lock:
                self.ready += 1
            self.idle.put(w)

    def _fell_back(self, why: str) -> bool:
        with self._lock:
            return self.stats.fell_back(why)

    def compile(self, src, kwargs: dict) -> bool:
        """src compiled by a worker into the cache (True); False, counted in stats, where the caller must compile
        it itself."""
        with self._lock:  # compiles come from several threads
            self.stats.jobs += 1
        if self.ready == 0:
            return self._fell_back("no worker ready yet")
        job = job_of(src, kwargs)
        if job is None:
            return self._fell_back("not a module-level kernel's source")
        deadline = time.monotonic() + 60
        while True:
            if self.exited >= self.ready:  # none left to come free: not worth waiting for
                return self._fell_back("every worker exited")
            try:
                w = self.idle.get(timeout=0.1)
                break
            except queue.Empty:
                if time.monotonic() > deadline:
                    return self._fell_back("no worker free within 60 s")
        try:
            reply = w.ask(job)
        except Exception as e:  # a job that does not pickle
            reply = ("error", f"{type(e).__name__}: {e}")
        if w.exited or w.proc.poll() is not None:  # a worker that exited takes no more jobs
            with self._lock:
                self.exited += 1
        else:
            self.idle.put(w)
        if reply[0] != "ok":
            return self._fell_back(str(reply[1]).splitlines()[0][:120] if len(reply) > 1 else reply[0])
        with self._lock:
            self.stats.in_workers += 1
        return True

    def close(self) -> None:
        for w in self.workers:
            w.close()


_running: CompileWorkers | None = None


def start() -> CompileWorkers | None:
    """Start the workers GMTOOL_COMPILE_PROCESSES asks for, once per process; None when it asks for none."""
    global _running
    n = requested()
    if _running is None and n:
        from gmtool.kernels.compile_ahead import _triton_cache_dir

        cache = _triton_cache_dir()
        try:
            _running = CompileWorkers(n, str(cache) if cache else None)
        except OSError:  # no process could start: the pass compiles in its threads, as without workers
            return None
        atexit.register(_running.close)
    return _running


def running() -> CompileWorkers | None:
    return _running


def _rebuild(job):
    from triton.compiler import ASTSource

    module, name, signature, constants, attrs, kwargs, digest = job
    fn = getattr(importlib.import_module(module), name)
    src = ASTSource(fn, signature, constants, attrs)
    return src, kwargs, digest


def serve(inp, out) -> None:
    """A worker's loop: a job in, ("ok", seconds), ("mismatch", why) or ("error", why) out, until the pipe closes."""
    import triton

    _write(out, ("ready", os.getpid()))
    while (job := _read(inp)) is not None:
        try:
            src, kwargs, digest = _rebuild(job)
            if src.hash() != digest:
                _write(out, ("mismatch", "the rebuilt source hashes otherwise"))
                continue
            t0 = time.perf_counter()
            triton.compile(src, **kwargs)
            _write(out, ("ok", time.perf_counter() - t0))
        except Exception as e:
            _write(out, ("error", f"{type(e).__name__}: {e}"))


if __name__ == "__main__":
    # frames go through a private copy of stdout; anything printed goes to stderr instead
    frames = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    serve(sys.stdin.buffer, frames)
