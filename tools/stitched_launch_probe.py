"""Host time of one replay's launch, full graph against stitched piecewise (GPU): from an idle device (synchronized
before each) and the n-th of 8 back to back, with the device time per step; qwen3-0.6b prefill 128, no metadata
refresh. Then the stitched graph's parts apart, each instantiated on its own and launched back to back through
cuGraphLaunch: the pieces alone as child graph nodes, the runners' kernels alone as kernel nodes, and one
piece's own graph (torch's exec). Prints JSON.

    PYTHONPATH=. python3 tools/stitched_launch_probe.py
"""

from __future__ import annotations

import json
import statistics
import time


def main() -> int:
    import torch

    from gmtool.config import SweepConfig
    from gmtool.core.compositions import parse_composition
    from gmtool.measure.workbench import Workbench
    from gmtool.modes import GraphMode

    cfg = SweepConfig(
        model="qwen3-0.6b",
        device="cuda",
        scenario="prefill",
        buckets="128",
        modes=("eager", "full", "piecewise"),
        kv_cache_gb=4,
    )
    bench = Workbench.build(cfg)
    batch = bench.batch(parse_composition("64+32*2", seed=0))
    out = {}
    for mode in (GraphMode.FULL, GraphMode.PIECEWISE):
        ex = bench.executor(mode)
        entry = ex.prepare(batch)
        for _ in range(3):
            ex.step(batch)
        torch.cuda.synchronize()
        idle = []
        for _ in range(30):
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            entry.replay(batch, refresh_metadata=False)
            idle.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        seq = [[] for _ in range(8)]
        for _ in range(20):
            torch.cuda.synchronize()
            for i in range(8):
                t0 = time.perf_counter()
                entry.replay(batch, refresh_metadata=False)
                seq[i].append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        ev0, ev1 = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        ev0.record()
        for _ in range(20):
            entry.replay(batch, refresh_metadata=False)
        ev1.record()
        torch.cuda.synchronize()
        out[mode.value] = dict(
            launch_path=entry.launch_path,
            idle_us=statistics.median(idle),
            nth_of_8_us=[round(statistics.median(s), 1) for s in seq],
            device_ms_per_step=ev0.elapsed_time(ev1) / 20,
        )
        if mode is GraphMode.PIECEWISE:
            out["parts"] = _parts(entry)
        ex.release()
    print(json.dumps(out, indent=1))
    return 0


def _parts(entry) -> dict:
    """Back-to-back launch host time (median of the 2nd-8th of 8, 20 rounds) of graphs built from parts of the
    stitched program: which part makes its launch dear."""
    import ctypes

    import torch

    from gmtool.kernels.native_loop import GraphOp, NodeParams, NativeSegment, cuda_driver, default_stream

    driver = cuda_driver()
    cu, builder = driver.keep[0], driver.graphs
    stream = default_stream()()
    (seg,) = [p for p in entry.loop.parts if isinstance(p, NativeSegment)]
    ops = seg.program.ops

    def build(kinds) -> int:
        graph, prev = builder.create(), []
        for op in ops:
            if isinstance(op, GraphOp) and "graph" in kinds:
                prev = [builder.add_child(graph, prev, op.graph)]
            elif not isinstance(op, GraphOp) and "kernel" in kinds:
                grid = [c if v < 0 else 1 for c, v in zip(op.grid_const, op.grid_value)]
                params = NodeParams(op.function, (ctypes.c_uint * 3)(*grid), (ctypes.c_uint * 3)(op.block, 1, 1))
                params.shared, params.params = op.shared, ctypes.addressof(op.params)
                prev = [builder.add_kernel(graph, prev, params)]
        exec_handle = builder.instantiate(graph)
        made.append((graph, exec_handle))
        return exec_handle

    def launch_us(exec_handle) -> float:
        samples = []
        for _ in range(20):
            torch.cuda.synchronize()
            for i in range(8):
                t0 = time.perf_counter()
                rc = cu.cuGraphLaunch(ctypes.c_void_p(exec_handle), ctypes.c_void_p(stream))
                dt = (time.perf_counter() - t0) * 1e6
                assert rc == 0, rc
                if i:
                    samples.append(dt)
        torch.cuda.synchronize()
        return round(statistics.median(samples), 1)

    made: list = []
    first_piece = next(op for op in ops if isinstance(op, GraphOp))
    out = {
        "pieces_as_children_us": launch_us(build({"graph"})),
        "kernels_as_nodes_us": launch_us(build({"kernel"})),
        "both_us": launch_us(build({"graph", "kernel"})),
        "one_piece_torch_exec_us": launch_us(first_piece.handle),
        "pieces": sum(isinstance(op, GraphOp) for op in ops),
        "kernels": sum(not isinstance(op, GraphOp) for op in ops),
    }
    for graph, exec_handle in made:
        builder.destroy(graph, exec_handle)
    return out


if __name__ == "__main__":
    raise SystemExit(main())
