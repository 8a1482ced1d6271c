"""Instantiation overlapped with the next capture, as an engine's start-up captures every bucket at once.

A captured graph is instantiated (the driver builds its executable form: about 10 ms for the 1,563 nodes of
qwen3-0.6b's HF layers, 0.35 s for the 35 default decode buckets; H200, 2026-12-01) and uploaded before its
first replay. Both release the GIL, so a worker thread does them for graph k while the main thread's Python
issues graph k+1's forward under capture. Captures are then thread_local: the worker's driver calls would
otherwise invalidate the capture under way.

The memory the driver takes for graph k (its exec object and upload: outside the pool) can no longer be read
around it alone; free device memory is read where the worker has finished graph k and the main thread has
captured graph k+1, and the pool's own growth over that interval (graph k+1's capture: allocator statistics,
exact) is taken out: `attribute()`. A capture's own driver allocations, if any, fall to the graph before it.
"""

from __future__ import annotations

import contextlib
import time
from concurrent.futures import ThreadPoolExecutor

import torch

from gmtool.errors import CaptureError


def attribute(free_before: int, free_after: int, pool_growth_between: int) -> int:
    """The driver's bytes outside the pool over an interval: the free memory it lost, less what the pool grew."""
    return (free_before - free_after) - pool_growth_between


class OverlappedInstantiation:
    """Used by GraphExecutor.capture_all: `submit(entry)` after each capture (its pool statistics taken,
    its graphs not instantiated); `finish()` after the last. Sets each entry's outside_pool_bytes and
    instantiate_s (the worker's instantiation and upload: not in its capture_s, nor anyone's)."""

    def __init__(self, backend, device: torch.device, free_bytes=None, stream=None):
        """free_bytes(): the device's free memory (default: cudaMemGetInfo); stream: where uploads go (default:
        a new side stream, the capture stream being busy capturing). Both given: no CUDA call of its own."""
        self.backend, self.device = backend, device
        self.free_bytes = free_bytes or (lambda: torch.cuda.mem_get_info(device)[0])
        if stream is None:
            index = device.index if device.index is not None else torch.cuda.current_device()
            self.worker = ThreadPoolExecutor(1, initializer=torch.cuda.set_device, initargs=(index,))
            stream = torch.cuda.Stream(device)
            torch.cuda.synchronize(device)
        else:
            self.worker = ThreadPoolExecutor(1)
        self.side = stream
        self.pending: tuple | None = None  # (entry, future) of the graph the worker is on
        self.free = self.free_bytes()

    def __enter__(self) -> "OverlappedInstantiation":
        self.backend.defer_instantiation = True
        return self

    def __exit__(self, *exc) -> None:
        try:
            if exc[0] is None:
                self.finish()
            else:  # a failed capture: leave nothing running in the worker
                self.drain()
        finally:
            self.backend.defer_instantiation = False
            self.worker.shutdown(wait=True)

    def drain(self) -> None:
        """Wait for the worker's graph, whatever became of it (after a failure elsewhere)."""
        if self.pending is not None:
            self.pending[1].exception()
            self.pending = None

    def submit(self, entry) -> None:
        self._settle(entry, entry.pool_growth_bytes or 0)
        self.pending = (entry, self.worker.submit(self._instantiate, entry))

    def finish(self) -> None:
        if self.pending is not None:
            self._settle(None, 0)

    def _settle(self, captured, growth: int) -> None:
        """The worker's graph done, one reading: its driver bytes (or, before any, the first capture's own)."""
        t0 = time.perf_counter()
        owner = captured
        if self.pending is not None:
            owner, done = self.pending
            done.result()  # its failure (an instantiation the driver refused) is the capture's
            self.pending = None
        free = self.free_bytes()
        owner.outside_pool_bytes = (owner.outside_pool_bytes or 0) + attribute(self.free, free, growth)
        self.free = free
        if captured is not None:
            captured.measure_s += time.perf_counter() - t0

    def _instantiate(self, entry) -> None:
        t0 = time.perf_counter()
        for step in entry.steps:
            step.instantiate()
        # each step alone, not entry.upload(): its fallback replays, and the arena holds the next batch by now
        on_side = torch.cuda.stream(self.side) if isinstance(self.side, torch.cuda.Stream) else contextlib.nullcontext()
        with on_side:
            uploaded = all(step.upload() for step in entry.steps)
        self.side.synchronize()
        if not uploaded:
            raise CaptureError(f"bucket {entry.key}: the driver refused the graph's upload (cuGraphUpload)")
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
    from gmtool.verify.graphnodes import load_driver

    if load_driver() is None:
        return "no CUDA driver bindings (cuda-python): a graph uploads at its first replay"
    return None
