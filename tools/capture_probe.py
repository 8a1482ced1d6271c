"""Where a capture of the 35 default decode buckets spends its host time, on the GPU (issue 17), one process:

- instantiate: the bench's full-graph executor (qwen3-0.6b, --fuse and the HF layers) captures every bucket; torch's
  capture_end and instantiate are timed apart for each graph, its nodes counted and named, and the kept graphs
  instantiated again through the driver: per flag (0, auto-free on launch, node priority), and 35 at once on 1, 2,
  4 and 8 threads;
- eager: an eager --fuse forward at buckets 8 and 256, its host time per forward with FastLaunch's direct
  launches (gmtool.kernels.launcher) against Triton's own path, alternating three times.

JSON to --out (default $OUT/capture_probe.json), a summary on stdout.

    PYTHONPATH=. python3 tools/capture_probe.py [--parts instantiate,eager]
"""

from __future__ import annotations

import argparse
import collections
import ctypes
import json
import os
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gmtool.core.batch import make_batch  # noqa: E402
from gmtool.core.buckets import DEFAULT_DECODE_BUCKETS  # noqa: E402
from gmtool.core.compositions import parse_composition  # noqa: E402
from gmtool.measure import bench  # noqa: E402

P, VP = ctypes.POINTER(ctypes.c_void_p), ctypes.c_void_p


class Driver:
    """The few driver calls this probe makes, through ctypes (they release the GIL)."""

    def __init__(self):
        lib = ctypes.CDLL("libcuda.so.1")

        def fn(name, *args):
            f = getattr(lib, name)
            f.restype, f.argtypes = ctypes.c_int, list(args)
            return f

        self.instantiate = fn("cuGraphInstantiateWithFlags", P, VP, ctypes.c_ulonglong)
        self.upload = fn("cuGraphUpload", VP, VP)
        self.destroy = fn("cuGraphExecDestroy", VP)
        self.get_ctx, self.set_ctx = fn("cuCtxGetCurrent", P), fn("cuCtxSetCurrent", VP)

    def timed_instantiate(self, graph: int, flags: int) -> tuple[float, int]:
        h = ctypes.c_void_p()
        t = time.perf_counter()
        rc = self.instantiate(ctypes.byref(h), graph, flags)
        dt = time.perf_counter() - t
        if rc:
            raise RuntimeError(f"cuGraphInstantiateWithFlags: CUDA error {rc}")
        return dt, h.value


def _capture_all(fuse: bool):
    ex = bench._executor(DEFAULT_DECODE_BUCKETS, 1024, 256 * 64 + 1, fuse=fuse)
    t0 = time.perf_counter()
    for b in sorted(DEFAULT_DECODE_BUCKETS, reverse=True):
        batch = make_batch(parse_composition(f"1*{b}", seed=b), ex.cache, ex.lm.vocab_size, 256)
        ex.capture(ex.key_for(batch), batch)
    torch.cuda.synchronize()
    return ex, time.perf_counter() - t0


def instantiate_part() -> dict:
    from gmtool.verify.graphnodes import NodeReader, load_driver

    drv, ends = Driver(), []
    real_end, real_instantiate = torch.cuda.CUDAGraph.capture_end, torch.cuda.CUDAGraph.instantiate

    def capture_end(g):  # torch's own, timed: [capture_end s, instantiate s] per graph
        t = time.perf_counter()
        real_end(g)
        ends.append([time.perf_counter() - t, 0.0])

    def instantiate(g):
        t = time.perf_counter()
        real_instantiate(g)
        ends[-1][1] = time.perf_counter() - t

    torch.cuda.CUDAGraph.capture_end, torch.cuda.CUDAGraph.instantiate = capture_end, instantiate
    out = {}
    try:
        for label, fuse in (("fuse", True), ("hf", False)):
            ends.clear()
            ex, total = _capture_all(fuse)
            raws = [int(g.raw_cuda_graph()) for g in ex.backend.graphs]
            nodes = NodeReader(load_driver()).graph_nodes(raws[0])
            r = {
                "capture_s": round(total, 3),
                "graphs": len(raws),
                "nodes": len(nodes),
                "kinds": collections.Counter(n.kind for n in nodes),
                "kernels": collections.Counter(n.name[:60] for n in nodes).most_common(12),
                "capture_end_s": round(sum(e[0] for e in ends), 4),
                "torch_instantiate_s": round(sum(e[1] for e in ends), 4),
                "torch_instantiate_ms": [round(e[1] * 1e3, 2) for e in ends],
            }
            stream = torch.cuda.current_stream().cuda_stream
            for flags in (0, 1, 8):  # none, cudaGraphInstantiateFlagAutoFreeOnLaunch, ...UseNodePriority
                times = []
                for raw in raws[:10]:
                    dt, exe = drv.timed_instantiate(raw, flags)
                    times.append(dt)
                    drv.upload(exe, stream)
                    torch.cuda.synchronize()
                    drv.destroy(exe)
                r.setdefault("driver_instantiate_ms_by_flags", {})[flags] = round(1e3 * sum(times) / len(times), 3)
            ctx = ctypes.c_void_p()
            drv.get_ctx(ctypes.byref(ctx))
            for n in (1, 2, 4, 8):  # a worker thread has no current context until given one
                t = time.perf_counter()
                with ThreadPoolExecutor(n) as pool:
                    res = list(pool.map(lambda raw: (drv.set_ctx(ctx), drv.timed_instantiate(raw, 0))[1], raws))
                r.setdefault("threads_s", {})[n] = round(time.perf_counter() - t, 4)
                for _, exe in res:
                    drv.destroy(exe)
            out[label] = r
            ex.release()
    finally:
        torch.cuda.CUDAGraph.capture_end, torch.cuda.CUDAGraph.instantiate = real_end, real_instantiate
    return out


def eager_part() -> dict:
    from gmtool.kernels import launcher
    from gmtool.model.attention import forward_context

    ex = bench._executor(DEFAULT_DECODE_BUCKETS, 1024, 256 * 64 + 1, fuse=True)
    direct = launcher.FastLaunch._direct_allowed
    out = {}
    try:
        for b in (8, 256):
            batch = make_batch(parse_composition(f"1*{b}", seed=b), ex.cache, ex.lm.vocab_size, 256)
            key = ex.key_for(batch)
            views = ex.inputs.load(batch, key)
            with forward_context(ex._context(key, views, batch)), torch.no_grad():
                for _ in range(3):
                    ex.forward(views)
                for _ in range(3):
                    for label, allowed in (("direct", direct), ("triton", lambda self: False)):
                        launcher.FastLaunch._direct_allowed = allowed
                        ex.forward(views)
                        torch.cuda.synchronize()
                        t = time.perf_counter()
                        for _ in range(20):
                            ex.forward(views)
                        out.setdefault(f"bucket {b} {label} ms", []).append(
                            round((time.perf_counter() - t) / 20 * 1e3, 3)
                        )
                        torch.cuda.synchronize()
    finally:
        launcher.FastLaunch._direct_allowed = direct
    return out


PARTS = {"instantiate": instantiate_part, "eager": eager_part}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--parts", default=",".join(PARTS))
    ap.add_argument("--out", default=str(Path(os.environ.get("OUT", ".")) / "capture_probe.json"))
    args = ap.parse_args()
    if not torch.cuda.is_available():
        print("capture_probe: needs CUDA", file=sys.stderr)
        return 2
    res = {}
    for part in args.parts.split(","):
        if part not in PARTS:
            print(f"capture_probe: unknown part {part!r}: {', '.join(PARTS)}", file=sys.stderr)
            return 2
        res[part] = PARTS[part]()
        print(json.dumps({part: res[part]}, default=str))
    Path(args.out).write_text(json.dumps(res, indent=1, default=str))
    return 0


if __name__ == "__main__":
    sys.exit(main())
