"""Instantiation overlapped with the next capture, as an engine's start-up captures every bucket at once.

A captured graph is instantiated (the driver builds its executable form: about 10 ms for the 1,563 nodes of
qwen3-0.6b's HF layers, 0.35 s for the 35 default decode buckets; H200, 2026-12-01) and uploaded before its
first replay. Both release the GIL, so a worker thread does them for graph k while the main thread's Python
issues graph k+1's forward under capture. Captures are then thread_local: the worker's driver calls would
otherwise invalidate the capture under way.

The memory the driver takes for graph k (its exec object and upload: outside the pool) can no longer be read
around it alone; free device memory is read where the worker has finished graph k and the main thread has
captured graph k+1, and what torch's allocator reserved over that interval (graph k+1's pool growth, and a
warm-up's if a capture had to be retried) is taken out: `attribute()`. A capture's own driver allocations, if
any, fall to the graph before it.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from gmtool.errors import CaptureError, OutOfMemory, first_line


def attribute(free_before: int, free_after: int, reserved_growth: int) -> int:
    """The driver's bytes outside the pool over an interval: the free memory lost, less what torch reserved."""
    return (free_before - free_after) - reserved_growth


class OverlappedInstantiation:
    """Used by GraphExecutor.capture_all: `submit(entry)` after each capture (its graphs not instantiated);
    `finish()` after the last. Sets each entry's outside_pool_bytes and instantiate_s (the worker's
    instantiation and upload: in no capture_s). The main thread's wait for the worker, and its readings, go into
    the measure_s of the entry it waited for. `refused_uploads`: graphs that could not upload alone (no bindings,
    or the driver refused), left to their first replay (the one-by-one path does the same)."""

    def __init__(self, backend, device: torch.device, free_bytes=None, reserved_bytes=None, stream=None):
        """free_bytes(): the device's free memory (default: cudaMemGetInfo); reserved_bytes(): what torch's
        allocator holds (default: its statistics); stream: where uploads go (default: a side stream of its own,
        the capture stream being busy capturing). All three given: no CUDA call of its own."""
        self.backend, self.device = backend, device
        self.free_bytes = free_bytes or (lambda: torch.cuda.mem_get_info(device)[0])
        self.reserved_bytes = reserved_bytes or (
            lambda: torch.cuda.memory_stats_as_nested_dict(device)["reserved_bytes"]["all"]["current"]
        )
        if stream is None:
            index = device.index if device.index is not None else torch.cuda.current_device()
            self.worker = ThreadPoolExecutor(1, initializer=torch.cuda.set_device, initargs=(index,))
            # high priority: torch hands out default-priority streams round robin from a pool of 32, one of which
            # is the capture stream; an upload there would land in the capture under way
            stream = torch.cuda.Stream(device, priority=-1)
            torch.cuda.synchronize(device)
        else:
            self.worker = ThreadPoolExecutor(1)
        self.side = stream
        self.pending: tuple | None = None  # (entry, future) of the graph the worker is on
        self.refused_uploads = 0
        self.free, self.reserved = self.free_bytes(), self.reserved_bytes()

    def __enter__(self) -> "OverlappedInstantiation":
        self.backend.defer_instantiation = True
        return self

    def __exit__(self, *exc) -> None:
        try:
            self.drain()  # finish() has run unless something failed: leave nothing running in the worker
        finally:
            self.backend.defer_instantiation = False
            self.worker.shutdown(wait=True)

    def submit(self, entry) -> None:
        self._settle(entry)
        self.pending = (entry, self.worker.submit(self._instantiate, entry))

    def finish(self) -> None:
        if self.pending is not None:
            self._settle(None)

    def drain(self) -> None:
        """Wait for the worker's graph, whatever became of it (after a failure elsewhere)."""
        if self.pending is not None:
            self.pending[1].exception()
            self.pending = None

    def _settle(self, captured) -> None:
        """The worker's graph done, one reading: its driver bytes (or, before any, the first capture's own)."""
        t0 = time.perf_counter()
        owner = captured
        if self.pending is not None:
            owner, done = self.pending
            done.result()  # its failure (an instantiation the driver refused) ends capture_all
            self.pending = None  # only now: interrupted in the wait, drain() must still wait for the worker
        free, reserved = self.free_bytes(), self.reserved_bytes()
        outside = attribute(self.free, free, reserved - self.reserved)
        owner.outside_pool_bytes = (owner.outside_pool_bytes or 0) + outside
        self.free, self.reserved = free, reserved
        owner.measure_s += time.perf_counter() - t0

    def _instantiate(self, entry) -> None:
        t0 = time.perf_counter()
        try:
            for step in entry.steps:
                step.instantiate()
            # each step alone, not entry.upload(): its fallback replays, and the arena holds the next batch by now
            on_side = (
                torch.cuda.stream(self.side) if isinstance(self.side, torch.cuda.Stream) else contextlib.nullcontext()
            )
            with on_side:
                uploaded = all(step.upload() for step in entry.steps)
            self.side.synchronize()
        except torch.OutOfMemoryError:
            raise OutOfMemory(f"out of memory while instantiating bucket {entry.key}'s graph") from None
        except RuntimeError as e:
            raise CaptureError(f"instantiation of bucket {entry.key} failed: {first_line(e)}") from None
        if not uploaded:  # as on the one-by-one path: the first replay uploads it, outside this accounting
            self.refused_uploads += 1
        entry.instantiate_s = time.perf_counter() - t0


def refusal(ex) -> str | None:
    """Why ex's captures cannot overlap their instantiation; None when they can: whole graphs on CUDA (a
    piecewise step's upload is a replay that runs its runners), one shared pool (a memory strategy's pool_for
    and captured() expect a graph finished), a forward that does not trace per shape."""
    if ex.device.type != "cuda":
        return "not on CUDA: nothing to instantiate"
    if ex.mode.piecewise:
        return "piecewise: a step's upload replays its runners"
    if ex.memory is not None:
        return f"memory strategy {type(ex.memory).__name__}: it reads each graph finished"
    if ex.forward_impl.compiles or not getattr(ex.backend, "keep_graph", False):
        return "a forward that traces per shape, or graphs instantiated at capture_end"
    return None
