"""Timing: CUDA events after warm-up on the GPU (host clock on the CPU backend), medians and spread."""

from __future__ import annotations

import time

import numpy as np
import torch

from gmtool.records import Timing

NOISY_IQR_FRACTION = 0.10  # spread above 10% of the median earns a noise warning


def time_ms(fn, iters: int, warmup: int, device: torch.device) -> list[float]:
    for _ in range(warmup):
        fn()
    if device.type != "cuda":
        out = []
        for _ in range(iters):
            t0 = time.perf_counter()
            fn()
            out.append((time.perf_counter() - t0) * 1e3)
        return out
    torch.cuda.synchronize(device)
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    for s, e in zip(starts, ends):
        s.record()
        fn()
        e.record()
    torch.cuda.synchronize(device)
    return [s.elapsed_time(e) for s, e in zip(starts, ends)]


def host_us(prepare_and_launch, iters: int, device: torch.device) -> list[float]:
    """Host time of copy-in plus dispatch, with the device idle before each call, apart from device time."""
    out = []
    for _ in range(iters):
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        t0 = time.perf_counter()
        prepare_and_launch()
        out.append((time.perf_counter() - t0) * 1e6)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
    return out


STEADY_WAIT_S = 10.0  # a replay that never signals its start costs that sample its accuracy, never a hang


def host_us_steady(prepare_and_launch, started, iters: int) -> list[float]:
    """Host time of copy-in plus dispatch while the device still runs the previous replay, as in an engine
    whose host prepares step n+1 during step n. After each timed call, an untimed wait until the device has
    begun that replay (`started`), so the next call neither waits for the staging arena nor finds the
    device idle."""
    out = []
    for i in range(iters + 1):  # the first call, from an idle device, only starts the pipeline
        t0 = time.perf_counter()
        prepare_and_launch()
        t1 = time.perf_counter()
        if i:
            out.append((t1 - t0) * 1e6)
        while not started() and time.perf_counter() - t1 < STEADY_WAIT_S:
            pass
    return out


def summarize(samples: list[float]) -> Timing | None:
    a = np.asarray(samples, dtype=float)
    if a.size == 0:
        return None
    q1, med, q3 = np.percentile(a, [25, 50, 75])
    return Timing(
        **{
            "median": float(med),
            "p90": float(np.percentile(a, 90)),
            "p99": float(np.percentile(a, 99)),
            "min": float(a.min()),
            "iqr": float(q3 - q1),
            "n": int(a.size),
            "noisy": bool(med > 0 and (q3 - q1) / med > NOISY_IQR_FRACTION),
        }
    )


def rel_err_per_seq(out: torch.Tensor, ref: torch.Tensor) -> float:
    """max over sequences of ||out - ref|| / ||ref|| (float64): one wrong sequence cannot hide in a batch.
    Non-finite values or another shape: inf."""
    o, r = out.double(), ref.double()
    if o.shape != r.shape or not torch.isfinite(o).all():
        return float("inf")
    num = (o - r).norm(dim=-1)
    den = r.norm(dim=-1).clamp_min(1e-30)
    return float((num / den).max())


# (same shapes and kernels without a graph, the exact batch without padding). The first catches stale
# metadata: replay and its own eager pass run identical kernels, so anything above rounding noise is a bug.
# The second is looser: GEMMs of another shape round differently (bf16 through 28 layers: a few %).
TOLERANCES = {torch.float32: (1e-5, 1e-3), torch.float16: (2e-3, 5e-2), torch.bfloat16: (5e-3, 1e-1)}


def tolerances_for(dtype: torch.dtype) -> tuple[float, float]:
    return TOLERANCES.get(dtype, TOLERANCES[torch.bfloat16])


def host_probe_us(launches: int = 1000, repeats: int = 5) -> float:
    """The host's Python speed as a capture spends it, in microseconds: `launches` keyings of 24 launch arguments
    the way FastLaunch keys them (a type test and a key entry each, a tuple, a dict lookup), median of repeats.
    A capture is Python launching kernels, so its seconds follow the host: the same tree's warm --fuse capture of
    the 35 default decode buckets took 0.69 s in one call and 1.20 s in another (H200, 2026-12-02). The probe,
    taken beside a capture, tells a slow host from a slow capture: on the H200 machine (a KVM guest) each CPU ran
    it at about 1,500-1,900 or 2,500-4,200 us, switching within a second, and captures followed it (2026-12-02,
    docs/measurements.md, nineteenth session)."""
    args = tuple(range(16)) + tuple(float(i) for i in range(8))
    seen = {}
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(launches):
            key = []
            for a in args:
                t = type(a)
                key.append((t, a % 16 == 0) if t is int else t)
            seen.get(tuple(key))
        times.append((time.perf_counter() - t0) * 1e6)
    return float(np.median(times))
