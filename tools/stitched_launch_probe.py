"""Host time of one replay's launch, full graph against stitched piecewise (GPU): from an idle device (synchronized
before each) and the n-th of 8 back to back, with the device time per step; qwen3-0.6b prefill 128, no metadata
refresh. Prints JSON.

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
        ex.release()
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
