"""--trace: one Chrome trace per mode (torch.profiler over a few replays of its largest bucket), each replay in
an NVTX range on CUDA so that Nsight Systems shows it by name.

The replays are re-run outside the sweep's timed loop, through the executors while their graphs are still
alive (a sweep probe): profiling never perturbs the figures the sweep reports.
"""

from __future__ import annotations

import contextlib
from pathlib import Path

import torch

from gmtool.errors import GmtoolError
from gmtool.modes import GraphMode

TRACE_REPLAYS = 3


@contextlib.contextmanager
def nvtx_range(name: str, device: torch.device):
    if device.type != "cuda":
        yield
        return
    torch.cuda.nvtx.range_push(name)
    try:
        yield
    finally:
        torch.cuda.nvtx.range_pop()


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def profile_steps(fn, path: Path, label: str, device: torch.device, before=None, replays: int = TRACE_REPLAYS) -> Path:
    """before(): untraced set-up run ahead of every replay (a cache position to rewind, say)."""
    from torch.profiler import ProfilerActivity, profile, record_function

    if before:
        before()
    fn()  # the trace shows steady-state replays, not first-call set-up
    _sync(device)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    with profile(activities=activities) as prof:
        for i in range(replays):
            if before:
                before()
            name = f"{label} replay {i}"
            with nvtx_range(name, device), record_function(name):
                fn()
        _sync(device)
    prof.export_chrome_trace(str(path))
    return Path(path)


def trace_path(out_dir: Path, mode: str) -> Path:
    return Path(out_dir) / f"trace-{mode}.json"


class TraceProbe:
    """Once every bucket is measured, traces each mode's largest captured bucket (and eager's largest)."""

    def __init__(self, out_dir: Path):
        self.out_dir, self.trace_files = Path(out_dir), []

    def after_sweep(self, bench, executors, res) -> None:
        cfg, device = bench.cfg, bench.device
        if GraphMode.EAGER in cfg.modes:
            bucket = cfg.largest_graph_bucket  # as the graph modes' traces: not an eager size above it
            try:
                comp = cfg.compositions_by_bucket[bucket][0]
                fn, _ = bench.eager_fn(bench.batch(comp))
                self.trace_files.append(
                    profile_steps(fn, trace_path(self.out_dir, GraphMode.EAGER), f"eager bucket {bucket}", device)
                )
                _split(self.trace_files[-1], res, GraphMode.EAGER, bucket, comp.label)
            except GmtoolError as e:
                res.notes.append(f"--trace: no eager trace: {e}")
        for mode, ex in executors.items():
            if not ex.graphs:
                res.notes.append(f"--trace: {mode} captured no graph to trace")
                continue
            key = max(ex.graphs, key=lambda k: k.num_tokens)
            try:
                # the bucket's first mix this graph serves (it was captured from a sibling of one of them)
                batch = next((b for b in _batches(bench, key.num_tokens) if ex.key_for(b) == key), None)
                if batch is None:
                    res.notes.append(f"--trace: no {mode} trace: no mix of bucket {key.num_tokens} is served by {key}")
                    continue
                label = batch.composition.label
                entry = ex.prepare(batch)  # copy-in only: the graph for this key already exists
                self.trace_files.append(
                    profile_steps(
                        lambda: entry.replay(batch),
                        trace_path(self.out_dir, mode),
                        f"{mode} bucket {key.num_tokens}",
                        device,
                    )
                )
                _split(self.trace_files[-1], res, mode, key.num_tokens, label)
            except GmtoolError as e:
                res.notes.append(f"--trace: no {mode} trace: {e}")


def _batches(bench, bucket: int):
    """The batches of bucket's mixes that the KV cache can hold (a mix it cannot is no row either)."""
    for comp in bench.cfg.compositions_by_bucket.get(bucket, ()):
        try:
            yield bench.batch(comp)
        except GmtoolError:
            continue


def _split(trace: Path, res, mode, bucket: int, composition: str) -> None:
    """The traced row (mode, bucket, the composition replayed) gets the traced step's time by kernel class; the
    bucket's other mixes ran other steps (under auto, another executor's graph) and get none."""
    from gmtool.measure.floor import time_by_class

    split = time_by_class(trace, TRACE_REPLAYS)
    for rec in res.records:
        if rec.mode == mode and rec.bucket == bucket and rec.composition == composition:
            rec.time_by_class_ms = split
