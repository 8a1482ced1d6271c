"""Piecewise against full (wide key) graph memory and host time, per model and prefill size: one workbench per
model, one prefill step of N tokens (three sequences) captured each way (gmtool.measure.bench.piecewise_vs_full).
Writes OUT/lean_table.json and OUT/lean_table.md. GPU only.

    PYTHONPATH=. python3 tools/lean_table.py --out gmtool-out/lean [--models qwen3-0.6b,llama-3.1-8b,qwen3-8b]
    [--tokens 128,512,2048] [--iters 30]
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

MiB = 2**20


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--models", default="qwen3-0.6b,llama-3.1-8b,qwen3-8b")
    ap.add_argument("--tokens", default="128,512,2048")
    ap.add_argument("--iters", type=int, default=30)
    ap.add_argument("--out", type=Path, default=Path("gmtool-out/lean"))
    args = ap.parse_args()

    import torch

    from gmtool.config import SweepConfig
    from gmtool.measure.bench import piecewise_vs_full
    from gmtool.measure.workbench import Workbench

    tokens = [int(t) for t in args.tokens.split(",")]
    rows = []
    for model in args.models.split(","):
        cfg = SweepConfig(
            model=model,
            device="cuda",
            scenario="prefill",
            buckets=args.tokens,
            modes=("eager", "full", "piecewise"),
            kv_cache_gb=4,
            num_iters=args.iters,
        )
        bench = Workbench.build(cfg)
        for t in tokens:
            x = piecewise_vs_full(model, t, args.iters, bench=bench)
            full, pw = x["full"], x["piecewise"]
            rows.append(
                {
                    "model": model,
                    "tokens": t,
                    "full_mib": full["graph_mem_bytes"] / MiB,
                    "piecewise_mib": pw["graph_mem_bytes"] / MiB,
                    "mem_ratio": x["mem_ratio"],
                    "full_host_us": full["host_steady_us"],
                    "piecewise_host_us": pw["host_steady_us"],
                    "piecewise_python_host_us": pw["host_steady_python_us"],
                    "launch_path": pw["launch_path"],
                    "runners": pw["runners"],
                    "runner_us": pw["runner_us"],
                    "host_extra_us_per_runner": x["host_extra_us_per_runner"],
                    "host_extra_us_per_runner_python": x["host_extra_us_per_runner_python"],
                }
            )
            print(json.dumps(rows[-1]), flush=True)
        del bench
        torch.cuda.empty_cache()
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "lean_table.json").write_text(json.dumps(rows, indent=2))
    head = (
        "| model | tokens | full MiB | piecewise MiB | ratio | host us full | host us piecewise | python loop "
        "| runners | us/runner | launch |"
    )
    lines = [head, "|" + "---|" * 11]
    for r in rows:
        lines.append(
            f"| {r['model']} | {r['tokens']} | {r['full_mib']:.1f} | {r['piecewise_mib']:.1f} | {r['mem_ratio']:.2f} "
            f"| {r['full_host_us']:.0f} | {r['piecewise_host_us']:.0f} | {r['piecewise_python_host_us']:.0f} "
            f"| {r['runners']} | {r['runner_us']:.1f} | {r['launch_path']} |"
        )
    (args.out / "lean_table.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
