"""Host time of a piecewise prefill step through the native step loop (stitched: one graph launch; by_op: each
piece and kernel launched on its own), the Python loop over its steps, and a full graph (wide key) of the same
bucket (GPU). Two batches of the bucket with other grids (3 and 4 sequences) take turns: each step of a stitched
graph sets its kernel nodes (`same` rows: one batch, nothing set). Two figures per way, medians:
- launch: entry.replay alone, back to back while the device still runs earlier steps (a sync every 8 replays keeps
  the launch queue short; it is not timed);
- step: copy-in plus launch issued while the device runs the previous step (gmtool.measure.timing.host_us_steady,
  as `gmtool bench --stages lean`).
Per runner: (piecewise - full) / runners, against issue 17's goal (<= 5 us). Writes OUT/native_loop_timing.json.

    PYTHONPATH=. python3 tools/native_loop_timing.py --out "$OUT" [--model qwen3-0.6b] [--tokens 128,512] [--iters 200]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import json
import statistics
import time
from pathlib import Path


def launch_us(entry, batches, iters: int) -> list[float]:
    import itertools

    import torch

    out = []
    turn = itertools.cycle(batches)
    torch.cuda.synchronize()
    for i in range(iters):
        b = next(turn)
        t0 = time.perf_counter()
        entry.replay(b)
        out.append((time.perf_counter() - t0) * 1e6)
        if i % 8 == 7:
            torch.cuda.synchronize()
    torch.cuda.synchronize()
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--tokens", default="128,512")
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--out", type=Path, default=Path("gmtool-out/native-loop"))
    args = ap.parse_args()

    import torch
    import triton

    from gmtool.config import SweepConfig
    from gmtool.core.compositions import parse_composition
    from gmtool.kernels.native_loop import cuda_driver, node_sets, python_path, unstitched
    from gmtool.measure.timing import host_us_steady
    from gmtool.measure.workbench import Workbench
    from gmtool.modes import GraphMode

    med = statistics.median
    driver = cuda_driver()
    doc = {
        "model": args.model,
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "layout_checked": not isinstance(driver, str) and driver.param_info is not None,
        "rows": [],
    }
    cfg = SweepConfig(
        model=args.model,
        device="cuda",
        scenario="prefill",
        buckets=args.tokens,
        modes=("eager", "full", "piecewise"),
        kv_cache_gb=4,
    )
    bench = Workbench.build(cfg)
    for tokens in (int(t) for t in args.tokens.split(",")):
        batch = bench.batch(parse_composition(f"{tokens // 2}+{tokens // 4}*2", seed=0))
        other = bench.batch(parse_composition(f"{tokens // 4}*4", seed=1))
        row = {"tokens": tokens}
        for mode in (GraphMode.FULL, GraphMode.PIECEWISE):
            ex = bench.executor(mode)
            entry = ex.prepare(batch)
            ex.step(batch)
            ex.step(other)
            ways = {"full": contextlib.nullcontext}
            if mode is GraphMode.PIECEWISE:
                ways = {
                    "stitched": contextlib.nullcontext,
                    "by_op": lambda e=entry: unstitched(e),
                    "python": lambda e=entry: python_path(e),
                }
                row["runners"], row["launch_path"] = entry.runners, entry.launch_path
            for way, switch in ways.items():
                with switch():
                    sets = node_sets(entry)
                    row[f"{way}_launch_us"] = med(launch_us(entry, (batch, other), args.iters))
                    turn = itertools.cycle((batch, other))
                    steady = host_us_steady(lambda: ex.step(next(turn)), ex.inputs.copied_in, args.iters)
                    row[f"{way}_step_us"] = med(steady)
                    row[f"{way}_same_launch_us"] = med(launch_us(entry, (batch,), args.iters))
                    row[f"{way}_node_sets"] = node_sets(entry) - sets
            ex.release()
        for way in ("stitched", "by_op", "python"):
            for what in ("launch", "step", "same_launch"):
                base = row[f"full_{what}_us"]
                row[f"{way}_{what}_extra_us_per_runner"] = (row[f"{way}_{what}_us"] - base) / max(1, row["runners"])
        row["goal_met"] = row["stitched_step_extra_us_per_runner"] <= 5
        doc["rows"].append(row)
        print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "native_loop_timing.json").write_text(json.dumps(doc, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
