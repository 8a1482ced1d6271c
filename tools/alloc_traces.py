#!/usr/bin/env python3
"""GPU: allocator traces of qwen3-0.6b's 35 default decode captures (full graphs) under the independent, shared
and shared-ascending memory strategies, and gmtool.memory.allocsim's prediction against what they held.

    PYTHONPATH=. python3 tools/alloc_traces.py            # writes $OUT/traces/*.json (or gmtool-out/traces)
    PYTHONPATH=. python3 tools/alloc_traces.py --memreport    # then memreport --sample 4 --check: $OUT/memreport

Per strategy, $OUT/traces/STRATEGY.json: torch and device, the capture order, per capture its pool ordinal,
its allocator events ([code, addr, size, pool]: gmtool.memory.alloctrace), the events after it, its pool's
segments and reserved bytes, and the strategy's measured graph-pool bytes. Then it prints, per strategy, the
simulator's total on the full replay of the traces (its exactness) and from 4 sampled buckets (the predictor)
against the measured total, and writes $OUT/traces/summary.json. Each strategy's failure is caught and written;
the others still run. The captures go straight through the executor (no eager reference, no timing): the
pools see the same requests as in memreport, where eager runs use the default pool.
"""

from __future__ import annotations

import gc
import json
import os
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

BUCKETS = [1, 2, 4] + list(range(8, 257, 8))
STRATEGIES = ("independent", "shared", "shared-ascending")
MiB = 2**20


def capture_strategy(bench, cfg, name: str) -> dict:
    from gmtool.memory.strategies import make_strategy
    from gmtool.modes import GraphMode

    strategy = make_strategy(name, cfg.torch_device)
    strategy.record_traces()
    ex = bench.executor(GraphMode.FULL, strategy)
    order = sorted(BUCKETS, reverse=strategy.order != "ascending")
    out = {"strategy": name, "order": order, "status": "ok"}
    t0 = time.perf_counter()
    try:
        for b in order:
            ex.prepare(bench.batch(cfg.compositions_by_bucket[b][0]))  # a miss: the bucket's capture
        torch.cuda.synchronize()
        strategy.traces.finish()  # the last capture's tail, while its graphs live
        m = strategy.measure()
        out["graph_pool_bytes"] = m["graph_pool_bytes"]
        out["pools"] = m["pools"]
    except Exception as e:  # what was captured so far is still written
        out["status"] = f"error: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        out["traceback"] = traceback.format_exc()
        if strategy.traces is not None:
            strategy.traces.recorder.stop()
    finally:
        out["capture_wall_s"] = time.perf_counter() - t0
        out.update(strategy.traces.to_dict() if strategy.traces is not None else {})
        out["per_key"] = list(strategy.per_key.values())
        ex.release()
        gc.collect()
        torch.cuda.empty_cache()
    return out


def simulate(data: dict) -> dict:
    """allocsim on one strategy's traces: the full replay (every capture's own events) and the prediction from
    4 sampled buckets, against the measured graph-pool bytes."""
    from gmtool.memory import allocsim
    from gmtool.memory.ledger import sample_buckets

    measured = data.get("graph_pool_bytes")
    res = {"measured_bytes": measured}
    full = allocsim.replay_recorded(data)
    res["full_replay_bytes"] = full.total_bytes
    # consecutive segment addresses, as the predictor assumes them: what the real ones' order changes
    res["full_replay_consecutive_addresses_bytes"] = allocsim.replay_recorded(data, real_addresses=False).total_bytes
    res["full_replay_check"] = allocsim.check_replay(data)
    sampled = sample_buckets(BUCKETS, 4)
    pred = allocsim.predict_strategy(data["strategy"], allocsim.captures_of(data, sampled), BUCKETS)
    res["sampled"] = sampled
    res["predicted_bytes"] = pred.total_bytes
    res["predict_notes"] = pred.notes
    for k in ("full_replay", "predicted"):
        v = res[f"{k}_bytes"]
        res[f"{k}_error_pct"] = 100.0 * (v - measured) / measured if measured else None
    return res


def write_json(path: Path, data: dict) -> None:
    """Compact JSON; gzipped (path + .gz) when over 15 MiB, the most a file the device run returns may hold."""
    text = json.dumps(data, separators=(",", ":"))
    if len(text) > 15 * MiB:
        import gzip

        Path(str(path) + ".gz").write_bytes(gzip.compress(text.encode()))
    else:
        path.write_text(text)


def memreport_check(model: str, root: Path) -> dict:
    """memreport --sample 4 --check through the library on the pool strategies: the sampled run records traces,
    the prediction says its method (allocsim), the full run gives the error. Writes root/memreport/."""
    from gmtool.app import run_memreport
    from gmtool.config import SweepConfig

    cfg = SweepConfig(
        model=model,
        device="cuda",
        buckets=",".join(map(str, BUCKETS)),
        compositions=",".join(f"1*{b}" for b in BUCKETS),
        modes=("eager", "full"),
        max_kv_len=256,
        kv_cache_gb=10,
        num_iters=2,
        num_iters_warmup=1,
    )
    t0 = time.perf_counter()
    (root / "memreport").mkdir(parents=True, exist_ok=True)  # run_memreport writes into an existing folder
    doc, _ = run_memreport(cfg, list(STRATEGIES), root / "memreport", sample=4, check=True)
    out = {"wall_s": time.perf_counter() - t0, "sampled": doc.sampled_buckets, "prediction": []}
    print(f"memreport --sample 4 --check ({out['wall_s']:.0f} s), sampled {doc.sampled_buckets}:")
    for p in doc.prediction:
        out["prediction"].append(
            {
                k: getattr(p, k)
                for k in ("strategy", "method", "predicted_bytes", "measured_bytes", "error_pct", "notes")
            }
        )
        err = "-" if p.error_pct is None else f"{p.error_pct:+.2f}%"
        meas = (p.measured_bytes or 0) / MiB
        print(
            f"  {p.strategy:17s} {p.method:8s} predicted {p.predicted_bytes / MiB:9.1f} MiB, measured {meas:9.1f} ({err})"
        )
    for r in doc.strategies:
        if r.status != "ok":
            print(f"  {r.strategy}: {r.status}: {r.reason}")
    return out


def main() -> int:
    import argparse

    from gmtool.config import SweepConfig
    from gmtool.measure.workbench import Workbench

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="qwen3-0.6b")
    ap.add_argument("--memreport", action="store_true", help="then memreport --sample 4 --check (its prediction)")
    ap.add_argument("--no-traces", action="store_true", help="skip the traces of every bucket")
    args = ap.parse_args()
    root = Path(os.environ.get("OUT") or "gmtool-out")
    out = root / "traces"
    out.mkdir(parents=True, exist_ok=True)
    if not torch.cuda.is_available():
        print("needs CUDA")
        return 2
    if args.no_traces:
        return 0 if not args.memreport else _memreport(args.model, root, out)
    t0 = time.perf_counter()
    cfg = SweepConfig(
        model=args.model,
        device="cuda",
        buckets=",".join(map(str, BUCKETS)),
        compositions=",".join(f"1*{b}" for b in BUCKETS),
        modes=("full",),
        max_kv_len=256,
        kv_cache_gb=10,
    )
    bench = Workbench.build(cfg)
    print(f"built {cfg.model} in {time.perf_counter() - t0:.1f} s; torch {torch.__version__}", flush=True)
    meta = {"torch": torch.__version__, "device": torch.cuda.get_device_name(), "model": cfg.model}
    summary = {"meta": meta, "strategies": {}}
    datas = {}
    for name in STRATEGIES:
        try:
            data = {**meta, **capture_strategy(bench, cfg, name)}
        except Exception as e:
            data = {**meta, "strategy": name, "status": f"error: {type(e).__name__}: {e}"}
            data["traceback"] = traceback.format_exc()
        datas[name] = data
        write_json(out / f"{name}.json", data)
        n = sum(len(c["events"]) + len(c["after"]) for c in data.get("captures", []))
        print(
            f"{name}: {data['status']}; {len(data.get('captures', []))} captures, {n} events, "
            f"graph pools {(data.get('graph_pool_bytes') or 0) / MiB:.1f} MiB "
            f"({data.get('capture_wall_s', 0):.1f} s)",
            flush=True,
        )
    for name, data in datas.items():
        try:
            r = simulate(data)
        except Exception as e:
            r = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
            print(f"{name}: simulation failed: {r['error']}\n{r['traceback']}")
        summary["strategies"][name] = r
        if "error" not in r:
            print(
                f"{name:17s} measured {r['measured_bytes'] / MiB:9.1f} MiB | full replay "
                f"{r['full_replay_bytes'] / MiB:9.1f} MiB ({r['full_replay_error_pct']:+.2f}%) | from "
                f"{r['sampled']}: {r['predicted_bytes'] / MiB:9.1f} MiB ({r['predicted_error_pct']:+.2f}%)"
            )
            chk = r["full_replay_check"]
            if not chk.get("exact"):
                print(f"  full replay differs: {json.dumps(chk)[:1500]}")
            for note in r["predict_notes"]:
                print(f"  note: {note}")
    (out / "summary.json").write_text(json.dumps(summary, indent=1, default=str))
    print(f"total {time.perf_counter() - t0:.1f} s; files in {out}", flush=True)
    if args.memreport:
        del bench, datas
        gc.collect()
        torch.cuda.empty_cache()
        return _memreport(args.model, root, out)
    return 0


def _memreport(model: str, root: Path, out: Path) -> int:
    try:
        res = memreport_check(model, root)
    except Exception as e:
        res = {"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()}
        print(f"memreport failed: {res['error']}\n{res['traceback']}")
    (out / "memreport_check.json").write_text(json.dumps(res, indent=1, default=str))
    return 0 if "error" not in res else 1


if __name__ == "__main__":
    sys.exit(main())
