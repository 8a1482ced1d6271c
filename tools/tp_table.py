"""TP=1 against TP=2 on two GPUs: `gmtool capture` of each model at --tp 1 and --tp 2 (full graphs, one mix per
bucket), then the all-reduces of one step timed alone at each bucket. Writes OUT/<model>-tp<N>/ (the runs'
results), OUT/tp_table.md and OUT/tp_table.json: per model and bucket the replay ms at TP=1 and TP=2 (each rank),
graph memory per rank, capture seconds per rank, and the all-reduces' share of the TP=2 step.

Usage (about 4 minutes on two H200s):
    PYTHONPATH=. python3 tools/tp_table.py --out gmtool-out/tp [--models qwen3-8b,llama-3.1-8b] [--buckets 1,2,...]
    [--scenario prefill --buckets 128,512,2048]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

DECODE = "1,2,4,8,16,32,64,128,256"


def capture(model: str, tp: int, buckets: list[int], scenario: str, device: str, out: Path) -> dict:
    # one mix per bucket that fills it: b decode tokens, or one prompt of b tokens
    mixes = ",".join(f"1*{b}" if scenario == "decode" else str(b) for b in buckets)
    cmd = [
        sys.executable,
        "-m",
        "gmtool.cli.main",
        "capture",
        "--model",
        model,
        "--tp",
        str(tp),
        "--mode",
        "full",
        "--device",
        device,
        "--scenario",
        scenario,
        "--buckets",
        ",".join(map(str, buckets)),
        "--compositions",
        mixes,
        "--num-iters",
        "20",
        "--out",
        str(out),
        "--force",
    ]
    p = subprocess.run(cmd, capture_output=True, text=True)
    if p.returncode not in (0, 3):
        sys.exit(f"{' '.join(cmd)} failed ({p.returncode}): {p.stderr.strip()[-2000:]}")
    return json.loads((out / "results.json").read_text())


def collectives(model: str, buckets: list[int], scenario: str, device: str) -> dict[int, float]:
    from gmtool.config import SweepConfig
    from gmtool.memory.estimate import _model_config
    from gmtool.parallel import launch
    from gmtool.parallel.profile import all_reduce_ms

    config = _model_config(model)
    cfg = SweepConfig(model=model, device=device, buckets=",".join(map(str, buckets)), scenario=scenario, tp=2)
    return launch.run(all_reduce_ms, cfg, config.hidden_size, 2 * config.num_hidden_layers)


def rows(doc: dict) -> dict[tuple[int, int], dict]:
    return {(r["rank"], r["bucket"]): r for r in doc["records"] if r["mode"] == "full" and r["status"] == "ok"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True)
    ap.add_argument("--models", default="qwen3-8b,llama-3.1-8b")
    ap.add_argument("--buckets", default=DECODE)
    ap.add_argument("--scenario", default="decode")
    ap.add_argument("--device", default="cuda", help="cpu: a smoke test of this script on tiny-qwen3")
    a = ap.parse_args()
    buckets = [int(b) for b in a.buckets.split(",")]
    a.out.mkdir(parents=True, exist_ok=True)
    md, table = [], []
    for model in a.models.split(","):
        one = rows(capture(model, 1, buckets, a.scenario, a.device, a.out / f"{model}-tp1"))
        two = rows(capture(model, 2, buckets, a.scenario, a.device, a.out / f"{model}-tp2"))
        coll = collectives(model, buckets, a.scenario, a.device)
        md += [
            f"## {model} ({a.scenario})",
            "",
            "| bucket | TP=1 ms | TP=2 ms rank 0 / 1 | speedup | all-reduce ms (share) | graph MiB TP=1 | "
            "graph MiB TP=2 rank 0 / 1 | capture s TP=1 | capture s TP=2 rank 0 / 1 |",
            "|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        for b in buckets:
            r1, r20, r21 = one.get((0, b)), two.get((0, b)), two.get((1, b))
            if not (r1 and r20 and r21):
                md.append(f"| {b} | missing: see {a.out}/{model}-tp1 and -tp2 | | | | | | | |")
                continue
            ms1, ms20, ms21 = (r["latency_ms"]["median"] for r in (r1, r20, r21))
            mib = [(r["graph_mem_bytes"] or 0) / 2**20 for r in (r1, r20, r21)]
            row = {
                "model": model,
                "bucket": b,
                "tp1_ms": ms1,
                "tp2_ms": [ms20, ms21],
                "speedup": ms1 / max(ms20, ms21),
                "all_reduce_ms": coll[b],
                "all_reduce_share": coll[b] / ms20,
                "graph_mib_tp1": mib[0],
                "graph_mib_tp2": mib[1:],
                "capture_s_tp1": r1["capture_s"],
                "capture_s_tp2": [r20["capture_s"], r21["capture_s"]],
            }
            table.append(row)
            md.append(
                f"| {b} | {ms1:.3f} | {ms20:.3f} / {ms21:.3f} | {row['speedup']:.2f}x | {coll[b]:.3f} "
                f"({100 * row['all_reduce_share']:.0f}%) | {mib[0]:.0f} | {mib[1]:.0f} / {mib[2]:.0f} | "
                f"{r1['capture_s']:.2f} | {r20['capture_s']:.2f} / {r21['capture_s']:.2f} |"
            )
        md.append("")
    (a.out / "tp_table.md").write_text("\n".join(md) + "\n")
    (a.out / "tp_table.json").write_text(json.dumps(table, indent=1) + "\n")
    print("\n".join(md))


if __name__ == "__main__":
    main()
