"""make bench: the peer and every gmtool mode on the same model and work, in one process, as ratios.

Stages (each writes bench-<stage>.json into --out; the table is built from whatever stages ran):
  kernel   decode attention K/V bandwidth against a device copy (batch 32, kv 4096)
  window   sliding-window decode attention at gemma-2-2b's shapes (window 4096) at kv 8192, against full
           attention over the same kv: time and K/V bytes read
  decode   gmtool full graphs, batch 1 and 32 at kv 1024 and 4096 (host time per replay too)
  fused    the same with --fuse (gmtool's fused layers: fewer kernels per step)
  fused-smallm  --fuse --small-m-gemm: the projections of decode batches (<= 32 tokens) on gmtool's small-M GEMM
           instead of cuBLAS; the summary judges it: B=1 kv 1024 at most 0.8 ms, B=32 not slower than --fuse alone
  fused-pdl  --fuse --small-m-gemm --pdl: the same, the fused kernels launched with Programmatic Dependent Launch
           (each GEMM prefetches its weight into L2 while the kernel before runs); the 0.8 ms goal is judged on
           the faster of fused-smallm and fused-pdl
  decode-ab  --fuse, --fuse --small-m-gemm and --fuse --small-m-gemm --pdl on one model, each captured once and
           timed in turns, round after round (gmtool.measure.decode_ab): the GPU's speed drifts within a run, so
           stages timed one after another favour the first; where it ran, the summary judges the small-M goals on it
  compile  the same with --compile (Inductor, then captured)
  compile-fused  --compile --fuse
  gemm     the small-M GEMM against cuBLAS at qwen3-0.6b's projection shapes (M = 1, 8, 32): weight TB/s
  peer     hf-compiled (HF static cache + torch.compile reduce-overhead) on the same decode work
  prefill  eager vs piecewise vs full (wide key) at 512 and 2048 tokens
  capture  total capture time of the default decode bucket list (no compile), in fresh processes sharing a new
           Triton cache per forward (the HF layers, and --fuse): cold (kernels compiled) and warm (loaded from
           disk), each the median of CAPTURE_SAMPLES such pairs, split into compile-ahead's pass, the eager
           warm-up, capture itself, memory readings and uploads, and the rest, with Triton's compiles per
           kernel; captured as an engine starts up (GraphExecutor.capture_all: each graph instantiated in a
           worker beside the next capture, that time shown apart); capture-once and capture-once-fused are one
           of them
  lean     piecewise against full (wide key) on one prefill step of 128 and 512 tokens: graph memory, host
           time per step, per runner
  host     where the host time of a B=1 replay goes: copy-in, graph launch on an idle and on a busy device,
           and the kernels one replay runs (with and without --fuse)
The benchmark reports; it asserts nothing. GPU only. The table: gmtool.measure.bench_summary.
"""

from __future__ import annotations

import argparse
import dataclasses
import itertools
import json
import statistics
import time
from pathlib import Path

import torch
from rich.console import Console

from gmtool import json_text
from gmtool.errors import first_line


STAGES = (
    "kernel",
    "window",
    "decode",
    "fused",
    "fused-smallm",
    "fused-pdl",
    "decode-ab",
    "compile",
    "compile-fused",
    "gemm",
    "peer",
    "prefill",
    "capture",
    "lean",
    "host",
)
LEAN_TOKENS = (128, 512)
# decode stages: (stage, label, --compile, --fuse, small-M GEMM, --pdl, goal against hf-compiled)
DECODE_VARIANTS = (
    ("decode", "full", False, False, False, False, 1.2),
    ("fused", "full --fuse", False, True, False, False, 1.2),
    ("fused-smallm", "full --fuse --small-m-gemm", False, True, True, False, 1.2),  # next to fused: one machine state
    ("fused-pdl", "full --fuse --small-m-gemm --pdl", False, True, True, True, 1.2),
    ("compile", "full --compile", True, False, False, False, 1.5),
    ("compile-fused", "full --compile --fuse", True, True, False, False, 1.5),
)
SMALL_M_GOAL_MS = 0.8  # --fuse with the small-M GEMM at B=1 kv 1024 (issue 17: decode closer to the floor)
MODEL = "qwen3-0.6b"
KV_LENS = (1024, 4096)
BATCHES = (1, 32)


def _decode_cfg(compile_: bool, iters: int, fuse: bool = False, small_m: bool = False, pdl: bool = False):
    from gmtool.config import SweepConfig

    comps = ",".join(f"{b}=1*{b}@{kv - 1}" for b in BATCHES for kv in KV_LENS)
    return SweepConfig(
        model=MODEL,
        device="cuda",
        buckets=",".join(map(str, BATCHES)),
        compositions=comps,
        modes=("eager", "full"),
        compile=compile_,
        fuse=fuse,
        small_m_gemm=small_m,
        pdl=pdl,
        max_kv_len=max(KV_LENS) + 128,
        kv_cache_gb=24,
        num_iters=iters,
        num_iters_warmup=10,
    )


def _jsonable(o):
    """Timings (dataclasses) as their fields; anything else as text."""
    return dataclasses.asdict(o) if dataclasses.is_dataclass(o) else str(o)


def _rows(records, mode):
    return [
        {
            k: getattr(r, k)
            for k in (
                "mode",
                "bucket",
                "composition",
                "status",
                "max_rel_err",
                "capture_s",
                "compile_s",
                "latency_ms",
                "eager_latency_ms",
                "host_us",
                "host_copy_us",
                "host_steady_us",
                "pieces",
                "runners",
                "error",
            )
        }
        for r in records
        if r.mode == mode
    ]


def stage_kernel(args) -> dict:
    from gmtool.kernels.bench import decode_bandwidth

    bw = decode_bandwidth(B=32, kv_len=4096)
    return {
        "kernel_ms": bw.kernel_ms,
        "kv_bytes": bw.kv_bytes,
        "kernel_GBps": bw.kernel_bytes_per_s / 1e9,
        "copy_GBps": bw.copy_bytes_per_s / 1e9,
        "ratio": bw.ratio,
        "num_splits": bw.num_splits,
    }


WINDOW_SHAPE = dict(B=32, kv_len=8192, Hkv=4, G=2, D=256)  # gemma-2-2b: 8 heads over 4 kv heads of dim 256
GEMMA2_WINDOW = 4096


def stage_window(args) -> dict:
    from gmtool.kernels.bench import decode_bandwidth

    out = {"shape": WINDOW_SHAPE, "window_tokens": GEMMA2_WINDOW}
    for name, window in (("windowed", GEMMA2_WINDOW), ("full", None)):
        bw = decode_bandwidth(**WINDOW_SHAPE, window=window)
        out[name] = {
            "kernel_ms": bw.kernel_ms,
            "kv_bytes": bw.kv_bytes,
            "kernel_GBps": bw.kernel_bytes_per_s / 1e9,
            "copy_GBps": bw.copy_bytes_per_s / 1e9,
            "ratio": bw.ratio,
            "num_splits": bw.num_splits,
        }
    return out


def stage_decode(args, compile_: bool = False, fuse: bool = False, small_m: bool = False, pdl: bool = False) -> dict:
    from gmtool.measure.sweep import Sweep

    res = Sweep(_decode_cfg(compile_, args.iters, fuse, small_m, pdl)).run()
    out = {"rows": _rows(res.records, "full"), "eager": _rows(res.records, "eager"), "errors": res.errors}
    return out | ({"notes": [n for n in res.notes if n.startswith("--pdl")]} if pdl else {})


def stage_decode_ab(args) -> dict:
    from gmtool.measure import decode_ab

    return decode_ab.run(args.iters)


def stage_gemm(args) -> dict:
    from gmtool.kernels.gemm_bench import model_timings
    from gmtool.profiles import load_model_profile

    rows = [
        dataclasses.asdict(t) | {"ours_TBps": t.ours_tbps, "cublas_TBps": t.cublas_tbps}
        for t in model_timings(MODEL, (1, 8, 32))
    ]
    return {"rows": rows, "layers": load_model_profile(MODEL)["config"]["num_hidden_layers"]}


def stage_peer(args) -> dict:
    from gmtool.config import SweepConfig
    from gmtool.measure.hf_compiled import HfCompiled
    from gmtool.measure.workbench import Workbench

    rows = []
    for kv in KV_LENS:
        # the workbench holds the model and the paged cache the peer copies its K/V from
        cfg = SweepConfig(
            model=MODEL,
            device="cuda",
            buckets=",".join(map(str, BATCHES)),
            modes=("eager",),
            max_kv_len=kv + 128,
            kv_cache_gb=24,
            num_iters=args.iters,
            num_iters_warmup=10,
            compositions=",".join(f"{b}=1*{b}@{kv - 1}" for b in BATCHES),
        )
        bench = Workbench.build(cfg)
        peer = HfCompiled(bench, compile_how="per-bucket")  # the peer at its fastest
        peer.context = kv  # every sequence at context kv, as gmtool's decode rows
        rows += [{**r.to_dict(), "kv_len": kv} for r in peer.run()]
        del bench, peer
        torch.cuda.empty_cache()
    return {
        "rows": [
            {
                k: r.get(k)
                for k in ("bucket", "kv_len", "status", "max_rel_err", "compile_s", "latency_ms", "host_us", "error")
            }
            for r in rows
        ]
    }


def stage_prefill(args) -> dict:
    from gmtool.config import SweepConfig
    from gmtool.measure.sweep import Sweep

    cfg = SweepConfig(
        model=MODEL,
        device="cuda",
        scenario="prefill",
        buckets="512,2048",
        modes=("eager", "full", "piecewise"),
        kv_cache_gb=24,
        num_iters=args.iters,
        num_iters_warmup=5,
    )
    res = Sweep(cfg).run()
    return {m: _rows(res.records, m) for m in ("eager", "full", "piecewise")} | {"errors": res.errors}


def _executor(buckets: list[int], max_kv_len: int, num_blocks: int, fuse: bool = False):
    """A full-graph executor on the bench model (Triton attention when it can run), outside any sweep."""
    from gmtool.config import SweepConfig
    from gmtool.modes import GraphMode
    from gmtool.measure.workbench import Workbench

    cfg = SweepConfig(
        model=MODEL,
        device="cuda",
        buckets=",".join(map(str, buckets)),
        modes=("full",),
        max_kv_len=max_kv_len,
        fuse=fuse,
    )
    return Workbench.build(cfg, num_blocks=num_blocks).executor(GraphMode.FULL)


CAPTURE_GOALS_S = {"cold": 2.0, "warm": 1.0}  # issue 17: the 35 default decode buckets, Triton cache empty / full


CAPTURE_FORWARDS = {"": "capture-once", " --fuse": "capture-once-fused"}  # label suffix -> the stage timing it
# cold-then-warm process pairs per forward, each on its own new Triton cache: one process's total spread by about
# 30% from the next for the same tree (H200, 2026-12-01: --fuse warm 1.31-1.86 s over three processes)
CAPTURE_SAMPLES = 3


def stage_capture(args) -> dict:
    """The default decode buckets captured in fresh processes, each forward (the HF layers; --fuse, gmtool's
    fused layers: 352 kernels a step instead of 1,619) with its own new Triton cache directory: cold (every
    kernel compiled) then warm (kernels loaded from disk), each timed as capture-once times it. CAPTURE_SAMPLES
    such pairs; each label keeps the median run (median_run)."""
    import os
    import subprocess
    import sys
    import tempfile

    runs: dict[str, list[dict]] = {}
    for suffix, stage in CAPTURE_FORWARDS.items():
        for _ in range(CAPTURE_SAMPLES):
            with tempfile.TemporaryDirectory(prefix="gmtool-triton-") as cache, tempfile.TemporaryDirectory() as tmp:
                env = {**os.environ, "TRITON_CACHE_DIR": cache}
                for label in CAPTURE_GOALS_S:
                    cmd = [sys.executable, "-m", "gmtool.measure.bench", "--stages", stage, "--out", tmp]
                    run = subprocess.run(cmd, env=env, capture_output=True, text=True)
                    path = Path(tmp) / f"bench-{stage}.json"
                    if run.returncode != 0 or not path.exists():
                        tail = (run.stderr or run.stdout).strip().splitlines()[-1:] or ["no output"]
                        raise RuntimeError(f"the {label}{suffix} capture process failed: {tail[0]}")
                    runs.setdefault(label + suffix, []).append(json.loads(path.read_text()))
                    path.unlink()
    return {label: median_run(docs) for label, docs in runs.items()}


def median_run(docs: list[dict]) -> dict:
    """The run of median total time (the lower of the two middle ones), with every run's total in samples_s."""
    ordered = sorted(docs, key=lambda d: d["total_s"])
    return {**ordered[(len(ordered) - 1) // 2], "samples_s": [d["total_s"] for d in docs]}


def capture_split(entries, compile_ahead_s: float | None, total_s: float) -> dict:
    """Where a list of captures' time went: compile-ahead's pass, the eager warm-up(s), capture itself
    (instantiation and the wait included, but under capture_all, whose worker instantiates beside the next
    capture), the memory readings and uploads (capture_all: the waits for its worker), and the rest (each batch
    loaded into the buffers, the copy-in, Triton's first launches outside those)."""
    split = {
        "compile_ahead": compile_ahead_s or 0.0,
        "warm_up": sum(e.warmup_s for e in entries),
        "capture": sum(e.capture_s for e in entries),
        "measure": sum(e.measure_s for e in entries),
    }
    split["rest"] = total_s - sum(split.values())
    return split


def stage_capture_once(args, fuse: bool = False) -> dict:
    """Capture every default decode bucket, largest first: warm-up and capture, timed together and apart; then
    the same with a second executor (and model) in the same process, which pays no per-process first use
    (H200, 2026-12-01: 0.86 s against 2.42 s for the first, its forwards under capture 15.6 against 38 ms a
    bucket): what a long-running engine pays to capture again, and how much of the first is first use."""
    first = _capture_once(fuse)
    try:
        again = _capture_once(fuse)
        first["second_executor"] = {k: again[k] for k in ("total_s", "capture_only_s", "split_s")}
    except Exception as e:  # the first run's figures stand
        first["second_executor"] = {"error": first_line(e, typed=True)}
    return first


def _capture_once(fuse: bool) -> dict:
    from gmtool.core.batch import make_batch
    from gmtool.core.buckets import DEFAULT_DECODE_BUCKETS
    from gmtool.core.compositions import parse_composition
    from gmtool.kernels import compile_ahead
    from gmtool.measure.timing import host_probe_us

    t_load = time.perf_counter()
    ex = _executor(DEFAULT_DECODE_BUCKETS, 1024, 256 * 64 + 1, fuse=fuse)
    load_s = time.perf_counter() - t_load
    cache, lm = ex.cache, ex.lm
    # the batches are the bench's own inputs (random block tables, for the checks), made before the window: an
    # engine captures over its buffers as they are (35 made in 0.03-0.06 s, inside the window before 2026-12-04)
    batches = [
        make_batch(parse_composition(f"1*{b}", seed=b), cache, lm.vocab_size, 256)
        for b in sorted(DEFAULT_DECODE_BUCKETS, reverse=True)
    ]
    probe = host_probe_us()
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    with compile_ahead.compile_log() as compiled:
        entries = ex.capture_all(batches)  # as an engine's start-up: instantiations overlap the next capture
        torch.cuda.synchronize()
    total = time.perf_counter() - t0
    ex.release()
    return {
        "triton": compiled.summary(),  # cold: compiles; warm: loads from the disk cache
        "buckets": len(DEFAULT_DECODE_BUCKETS),
        "total_s": total,
        "capture_only_s": sum(e.capture_s for e in entries),
        "split_s": capture_split(entries, ex.compile_ahead_s, total),
        # the graphs' instantiation and upload in capture_all's worker thread (not in the split: what of it the
        # main thread waited for is in the split's "measure")
        "instantiate_overlapped_s": sum(e.instantiate_s or 0.0 for e in entries),
        "overlap_note": ex.overlap_note,
        # per bucket, largest first: bucket, warm-up, capture, memory and upload (s): where first-use costs fall
        "per_bucket_s": [
            [e.key.num_tokens, round(e.warmup_s, 4), round(e.capture_s, 4), round(e.measure_s, 4)] for e in entries
        ],
        "fuse": fuse,
        "warmed_up": sum(e.warmed_up for e in entries),
        "compile_ahead_s": ex.compile_ahead_s,
        "compile_ahead_forwards_s": ex.compile_ahead_forwards_s,  # of it: the pass's forwards (the compiles go on)
        "compile_ahead_note": ex.compile_ahead_note,
        "host_probe_us": probe,  # the host's Python speed beside the captures (gmtool.measure.timing.host_probe_us)
        "load_s": load_s,  # the model's build and the executor's, before the window: what overlaps it is not free
        # the decode attention's kernels compiled in a thread during the build (gmtool.kernels.early_compile)
        "early_compile": None
        if (c := lm.early_compile) is None
        else {"launches": c.launches, "s": c.seconds, "waited_s": c.waited_s, "error": c.error},
        # cuBLAS's first uses made in a thread during the build (gmtool.model.gemm_warmup)
        "gemm_warmup": None
        if (w := lm.gemm_warmup) is None
        else {"gemms": len(w.made), "s": w.seconds, "waited_s": w.waited, "error": w.error},
    }


def stage_capture_once_fused(args) -> dict:
    return stage_capture_once(args, fuse=True)


def piecewise_vs_full(model: str, tokens: int, iters: int, device: str = "cuda", bench=None) -> dict:
    """One prefill step of `tokens` tokens (three sequences) captured full (wide key) and piecewise, one after
    the other on the same workbench: the capture's peak allocation and pool growth (on the CPU tape, the pool
    its live-tensor accounting needs), the host time of a step issued while the device runs the previous one,
    and the runners alone (all of a step's, back to back)."""
    from gmtool.core.backends.cpu import pool_bytes
    from gmtool.config import SweepConfig
    from gmtool.core.compositions import parse_composition
    from gmtool.kernels.native_loop import python_path, unstitched
    from gmtool.measure.timing import host_us_steady, summarize
    from gmtool.measure.workbench import Workbench
    from gmtool.modes import GraphMode

    if bench is None:  # one given: a workbench whose buckets include `tokens` (tools/lean_table.py reuses one)
        cfg = SweepConfig(
            model=model,
            device=device,
            scenario="prefill",
            buckets=str(tokens),
            modes=("eager", "full", "piecewise"),
            kv_cache_gb=4,
            num_iters=iters,
        )
        bench = Workbench.build(cfg)
    batch = bench.batch(parse_composition(f"{tokens // 2}+{tokens // 4}*2", seed=0))
    # the same bucket with another grid (4 sequences, not 3): taking turns, a stitched graph sets its kernel
    # nodes every step; a run of one batch sets none
    other = bench.batch(parse_composition(f"{tokens // 4}*4", seed=1))
    out = {}
    for mode in (GraphMode.FULL, GraphMode.PIECEWISE):
        ex = bench.executor(mode)
        entry = ex.prepare(batch)  # the capture
        ex.step(batch)
        ex.step(other)
        steady = host_us_steady(lambda: ex.step(batch), ex.inputs.copied_in, iters)
        turn = itertools.cycle((batch, other))
        alternating = host_us_steady(lambda: ex.step(next(turn)), ex.inputs.copied_in, iters)
        with unstitched(entry):  # native, each op its own launch (A/B)
            steady_by_op = host_us_steady(lambda: ex.step(next(turn)), ex.inputs.copied_in, iters)
        with python_path(entry):  # the same step through the Python loop over its steps (A/B)
            steady_python = host_us_steady(lambda: ex.step(batch), ex.inputs.copied_in, iters)
        runners = [s for s in entry.steps if getattr(s, "is_runner", False)]
        per_runner = []
        for _ in range(iters):
            t0 = time.perf_counter()
            for r in runners:
                r.replay()
            per_runner.append((time.perf_counter() - t0) * 1e6 / max(1, len(runners)))
        ex.backend.synchronize()
        mem = entry.graph_mem_bytes if bench.device.type == "cuda" else pool_bytes(entry.steps)
        out[mode.value] = {
            "graph_mem_bytes": mem,
            "pool_growth_bytes": entry.pool_growth_bytes,
            "host_steady_us": summarize(steady).median,
            "host_steady_alternating_us": summarize(alternating).median,  # two grids taking turns
            "host_steady_by_op_us": summarize(steady_by_op).median,  # the same, native op by op
            # how a step launched (gmtool.kernels.native_loop): "native", or "python: why"; the Python loop's time
            "launch_path": entry.launch_path,
            "host_steady_python_us": summarize(steady_python).median,
            "pieces": entry.pieces,
            "runners": len(runners),
            "runner_us": statistics.median(per_runner) if runners else None,
            # how the runners' Triton kernels launched (gmtool.kernels.launcher); none with torch attention
            "launch_paths": sorted({p for r in runners for p in r.launch_paths}),
        }
        ex.release()
    full, pw = out["full"], out["piecewise"]
    out["mem_ratio"] = pw["graph_mem_bytes"] / full["graph_mem_bytes"] if full["graph_mem_bytes"] else None
    out["host_extra_us_per_runner"] = (pw["host_steady_us"] - full["host_steady_us"]) / max(1, pw["runners"])
    for key in ("alternating", "by_op"):
        out[f"host_extra_us_per_runner_{key}"] = (
            pw[f"host_steady_{key}_us"] - full["host_steady_alternating_us"]
        ) / max(1, pw["runners"])
    out["host_extra_us_per_runner_python"] = (pw["host_steady_python_us"] - full["host_steady_us"]) / max(
        1, pw["runners"]
    )
    return out


def stage_lean(args) -> dict:
    return {str(t): piecewise_vs_full(MODEL, t, args.iters) for t in LEAN_TOKENS}


def _numpy_write_us() -> float:
    """This host's cost of one small numpy slice write, the unit copy-in is made of (4 to 9 per copy-in)."""
    import numpy as np

    dst, src = np.zeros((4, 64), dtype=np.int64), np.ones((4, 1), dtype=np.int64)
    t0 = time.perf_counter()
    for _ in range(10000):
        dst[:, :1] = src
    return (time.perf_counter() - t0) * 1e6 / 10000


def stage_host(args) -> dict:
    """Bucket 1, two requests taking turns (kv 1023 and 700: other tokens, slots and block-table widths each
    step), 200 times each way: on an idle device (synchronized before each call, as the sweep's host_us) the
    whole step (copy-in, launch, output view), then copy-in and launch timed apart; the whole step issued
    while the device still runs the previous one (the steady state of an engine); launch alone back to back.
    The kernel count comes last: the profiler slows every later CUDA call of the process."""
    from gmtool.core.batch import make_batch
    from gmtool.core.compositions import parse_composition
    from gmtool.measure.floor import kernels_per_replay
    from gmtool.measure.timing import host_us, host_us_steady, summarize

    out, replays = {"numpy_write_us": _numpy_write_us()}, {}
    for fuse in (False, True):
        name = "full --fuse" if fuse else "full"
        ex = _executor([1], 1152, 1024, fuse)
        cache, lm = ex.cache, ex.lm
        batches = [
            make_batch(parse_composition(c, seed), cache, lm.vocab_size, 256)
            for seed, c in enumerate(("1*1@1023", "1*1@700"))
        ]
        entry = ex.prepare(batches[0])
        turn = itertools.cycle(batches)
        step = host_us(lambda: ex.step(next(turn)), 200, ex.device)
        copy, idle = [], []
        for batch in itertools.islice(turn, 200):  # the same from an idle device, copy-in and launch apart
            torch.cuda.synchronize()
            t0 = time.perf_counter()
            ex.prepare(batch)
            t1 = time.perf_counter()
            entry.replay(batch)
            t2 = time.perf_counter()
            copy.append((t1 - t0) * 1e6)
            idle.append((t2 - t1) * 1e6)
        steady = host_us_steady(lambda: ex.step(next(turn)), ex.inputs.copied_in, 200)
        busy = []
        torch.cuda.synchronize()
        for _ in range(200):
            t0 = time.perf_counter()
            entry.replay(batch)
            busy.append((time.perf_counter() - t0) * 1e6)
        torch.cuda.synchronize()
        out[name] = {
            "steady_us": summarize(steady),
            "step_us": summarize(step),
            "copy_in_us": summarize(copy),
            "launch_idle_us": summarize(idle),
            "launch_busy_us": summarize(busy),
        }
        replays[name] = (ex, entry, batch)
    for name, (ex, entry, batch) in replays.items():
        out[name]["kernels_per_replay"] = kernels_per_replay(lambda e=entry, b=batch: e.replay(b), ex.device)
        ex.release()
    return out


def _stage_fns() -> dict:
    fns = {
        "kernel": stage_kernel,
        "window": stage_window,
        "peer": stage_peer,
        "prefill": stage_prefill,
        "capture": stage_capture,
        "decode-ab": stage_decode_ab,
        "capture-once": stage_capture_once,
        "capture-once-fused": stage_capture_once_fused,
        "lean": stage_lean,
        "host": stage_host,
    }
    for stage, _, compile_, fuse, small_m, pdl, _ in DECODE_VARIANTS:
        fns[stage] = lambda a, c=compile_, f=fuse, s=small_m, p=pdl: stage_decode(a, c, f, s, p)
    fns["gemm"] = stage_gemm
    return fns


def unknown_stages(stages: str) -> list[str]:
    """The names in a --stages list that are no stage (checked before any stage runs)."""
    fns = _stage_fns()
    return [s for s in stages.split(",") if s not in fns]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--out", type=Path, default=Path("gmtool-out/bench"))
    ap.add_argument("--stages", default=",".join(STAGES))
    ap.add_argument("--iters", type=int, default=50)
    args = ap.parse_args(argv)
    console = Console(width=150)
    unknown = unknown_stages(args.stages)
    if unknown:  # before anything runs: a typo at the end of the list must not cost the stages before it
        console.print(f"[red]error:[/] unknown stage {unknown[0]!r}: {', '.join(STAGES)}")
        return 2
    if not torch.cuda.is_available():
        console.print("[red]error:[/] make bench needs CUDA (run it on the GPU machine)")
        return 2
    args.out.mkdir(parents=True, exist_ok=True)
    fns = _stage_fns()
    # host counts kernels with the profiler, which slows every later CUDA call of the process: it goes last
    for stage in sorted(args.stages.split(","), key=lambda st: st == "host"):
        t0 = time.perf_counter()
        try:
            data = fns[stage](args)
        except Exception as e:  # a failing stage is reported; the others still run
            data = {"error": first_line(e, typed=True)}
        data["wall_s"] = time.perf_counter() - t0
        (args.out / f"bench-{stage}.json").write_text(json_text.dumps(data, indent=1, default=_jsonable))
        console.print(
            f"stage {stage}: {data['wall_s']:.1f} s" + (f" [red]{data['error']}[/]" if "error" in data else "")
        )
        torch.cuda.empty_cache()
    from gmtool.measure.bench_summary import summary  # it reads this module's goals and stage names

    summary(args.out, console)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
