"""The figures issue 15 asks of `gmtool verify` on a GPU, in one process (the model is built once):

1. the dynamic-dimension table for full vs full-narrow (and the soak modes): one bucket, two compositions, the
   ATen ops and, on CUDA, the graphs' nodes diffed;
2. a soak per mode under the memory strategy (vmm): steps, checks, steps/min (goal: 1,000 a minute on
   qwen3-0.6b with --check-every 10), no mismatch;
3. each injected fault (--inject): the step at which the soak found it and where it was localized (goal: within
   50 steps). Last, because a fault that reads out of bounds on a GPU may break the device context.

The soaks share what is left of --budget-s once --fault-reserve-s is set aside, so the whole run fits a device
session; a soak stopped by its share says how many of --steps it ran (the issue's figure is 10,000 steps: give
--steps 10000 and the budget it needs). Writes verify_figures.json and verify_figures.md under --out ($OUT on
the GPU machine). Exit 3 when a soak mismatched or a fault was not found within 50 steps.

    PYTHONPATH=. python3 tools/verify_gpu_figures.py --steps 2000 --budget-s 200 --out $OUT
    PYTHONPATH=. python3 tools/verify_gpu_figures.py --device cpu --model tiny-qwen3 --strategy default --steps 40
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))


def md(df) -> str:
    """A DataFrame as a Markdown table (no tabulate needed)."""
    cell = lambda v: str(v).replace("|", "\\|").replace("\n", " ")  # noqa: E731
    lines = ["| " + " | ".join(map(cell, df.columns)) + " |", "|" + "---|" * len(df.columns)]
    return "\n".join(lines + ["| " + " | ".join(map(cell, row)) + " |" for row in df.itertuples(index=False)])


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="qwen3-0.6b")
    p.add_argument("--device", default="cuda")
    p.add_argument("--modes", default="full,piecewise,auto", help="soak modes")
    p.add_argument("--strategy", default="vmm")
    p.add_argument("--steps", type=int, default=2000, help="steps per soak (the issue's figure: 10000)")
    p.add_argument("--check-every", type=int, default=10)
    p.add_argument(
        "--fault-steps", type=int, default=100, help="steps a faulty soak may run before it counts as missed"
    )
    p.add_argument("--fault-check-every", type=int, default=None, help="default: --check-every")
    p.add_argument("--faults", default="all", help="comma list of faults to inject, all, or none")
    p.add_argument("--budget-s", type=float, default=200.0, help="wall time for the whole run, model build included")
    p.add_argument("--fault-reserve-s", type=float, default=60.0, help="of the budget, kept for the fault runs")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.environ.get("OUT", "gmtool-out/verify-figures"))
    a = p.parse_args()
    t_start = time.perf_counter()
    from gmtool.errors import GmtoolError

    try:
        run(a, t_start)
    except GmtoolError as e:
        print(f"error: {e}", file=sys.stderr)
        sys.exit(2)


def run(a, t_start: float) -> None:
    from gmtool.memory.strategies import make_strategy
    from gmtool.verify.dyndims import dynamic_dims
    from gmtool.verify.faults import FAULTS, parse_fault
    from gmtool.verify.report import dyndims_frame, runs_frame
    from gmtool.verify.run import VerifyConfig, build_bench, dyn_dim_work
    from gmtool.verify.soak import Soak, SoakOptions
    from gmtool.verify.taps import LayerTaps

    cfg = VerifyConfig(
        model=a.model,
        device=a.device,
        modes=a.modes,
        strategy=a.strategy,
        steps=a.steps,
        check_every=a.check_every,
        seed=a.seed,
    )
    bench = build_bench(cfg)
    taps = LayerTaps(bench.lm, bench.cfg.policy().largest, bench.device)
    memory = (lambda: None) if a.strategy == "default" else (lambda: make_strategy(a.strategy, bench.device))
    out = {"config": cfg.to_dict(), "build_s": time.perf_counter() - t_start}
    print(f"{cfg.model} on {bench.device}: built in {out['build_s']:.1f} s", flush=True)

    # 1. dynamic dimensions: full vs full-narrow, and the soak modes (auto: through its parts)
    t0, dd = time.perf_counter(), []
    for mode, kind, x, y in dyn_dim_work(bench, cfg, ["full", "full-narrow", *cfg.graph_modes]):
        dd.append(dynamic_dims(bench, mode, x, y).to_dict() | {"kind": kind, "expected_unsafe": mode.expected_unsafe})
    out["dynamic_dims"], out["dynamic_dims_s"] = dd, time.perf_counter() - t0
    print(md(dyndims_frame({"dynamic_dims": dd})), flush=True)

    # 2. the soaks, sharing what is left of the budget once the faults' reserve is set aside
    runs = []
    for i, mode in enumerate(cfg.graph_modes):
        left = a.budget_s - a.fault_reserve_s - (time.perf_counter() - t_start)
        share = max(left, 0) / (len(cfg.graph_modes) - i) * 0.9  # the rest: capture and release around each
        r = Soak(
            bench, taps, mode, memory(), a.strategy, SoakOptions(a.steps, a.check_every, a.seed, time_limit_s=share)
        ).run()
        runs.append(r.to_dict())
        print(
            f"soak {mode} under {a.strategy}: {r.steps} steps, {r.checks} checks, {r.steps_per_min:.0f} "
            f"steps/min, {'no mismatch' if r.mismatch is None else f'MISMATCH at step {r.mismatch.step}'}"
            + (f" ({r.notes[0]})" if r.notes else "")
            + f"; served by {r.served_by}",
            flush=True,
        )
    out["runs"] = runs

    # 3. each fault, in the first mode, until found; last, because a fault may break the device context
    faults, every = [], a.fault_check_every or a.check_every
    chosen = FAULTS if a.faults == "all" else [] if a.faults == "none" else a.faults.split(",")
    for name in chosen:
        fault = parse_fault(name, bench.lm.num_layers)
        try:
            r = Soak(
                bench, taps, cfg.graph_modes[0], memory(), a.strategy, SoakOptions(a.fault_steps, every, a.seed, fault)
            ).run()
        except Exception as e:  # a device-side fault the soak could not survive: said, and the next one tried
            faults.append(
                {
                    "fault": str(fault),
                    "found_at_step": None,
                    "within_50": False,
                    "suspect": f"the soak raised {type(e).__name__}: {str(e).strip().splitlines()[0][:200]}",
                }
            )
            print(f"fault {fault}: {faults[-1]['suspect']}", flush=True)
            continue
        m = r.mismatch
        row = {
            "fault": str(fault),
            "mode": r.mode,
            "check_every": every,
            "found_at_step": m.step + 1 if m else None,
            "within_50": bool(m and m.step < 50),
            "wall_s": round(r.wall_s, 1),
            "layer output": (m.first_divergence or {}).get("module") if m else None,
            "suspect": m.suspects[0] if m else f"not found in {r.steps} steps",
            "buffers read": ", ".join(m.buffers_read) if m else "",
            "all suspects": " | ".join(m.suspects) if m else "",
        }
        faults.append(row)
        print(
            f"fault {row['fault']}: "
            + (
                f"found at step {row['found_at_step']}, {row['layer output']}: {row['suspect']}"
                if m
                else row["suspect"]
            ),
            flush=True,
        )
    out["faults"], out["wall_s"] = faults, time.perf_counter() - t_start
    taps.remove()

    d = Path(a.out)
    d.mkdir(parents=True, exist_ok=True)
    (d / "verify_figures.json").write_text(json.dumps(out, indent=1, default=str) + "\n")
    import pandas as pd

    text = [
        f"# gmtool verify figures: {cfg.model} on {bench.device}, {out['wall_s']:.0f} s\n",
        "## Dynamic dimensions\n",
        md(dyndims_frame({"dynamic_dims": dd})),
        f"\n## Soak under {a.strategy}, --check-every {a.check_every}\n",
        md(runs_frame({"runs": runs})),
        "\n## Injected faults\n",
        md(pd.DataFrame(faults)),
    ]
    (d / "verify_figures.md").write_text("\n".join(text) + "\n")
    print(f"\n{md(pd.DataFrame(faults))}\nwritten: {d}/verify_figures.md, verify_figures.json ({out['wall_s']:.0f} s)")
    missed = [f["fault"] for f in faults if not f["within_50"]]
    bad = [r["mode"] for r in runs if r["mismatch"] is not None]
    if missed or bad:
        print(f"NOT MET: faults not found within 50 steps: {missed or 'none'}; soaks with a mismatch: {bad or 'none'}")
        sys.exit(3)


if __name__ == "__main__":
    main()
