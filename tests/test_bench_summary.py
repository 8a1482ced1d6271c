"""make bench's table, built from stage files (the stages themselves need a GPU)."""

import io
import json

import pytest

from rich.console import Console

from gmtool.measure.bench_summary import summary


def _lat(ms):
    return {"median": ms}


def test_summary_ratios_and_goals(tmp_path):
    def row(bucket, kv, ms, host=None):
        return {
            "bucket": bucket,
            "composition": f"1*{bucket}@{kv - 1}",
            "status": "ok",
            "latency_ms": _lat(ms),
            "host_us": _lat(host) if host else None,
            "host_copy_us": _lat(10.0) if host else None,
            "host_steady_us": _lat(host / 2) if host else None,
        }

    stages = {
        "peer": {
            "rows": [
                {"bucket": 1, "kv_len": 1024, "status": "ok", "compile_s": 40.0, "latency_ms": _lat(2.4)},
                {"bucket": 32, "kv_len": 1024, "status": "error", "error": "boom"},
            ]
        },
        "decode": {"rows": [row(1, 1024, 4.0, host=80.0)]},  # steady 40 us
        "fused": {"rows": [row(1, 1024, 1.6, host=50.0)]},  # steady 25 us
        "kernel": {"kernel_GBps": 3000.0, "copy_GBps": 4000.0, "ratio": 0.75},
        "capture": {
            "cold": {"buckets": 35, "total_s": 12.0, "capture_only_s": 2.0},
            "warm": {
                "buckets": 35,
                "total_s": 0.9,
                "capture_only_s": 0.5,
                "compile_ahead_s": 0.25,
                "triton": {"compiles": 8, "untimed": 8, "compile_s": 0.0, "kernels": {}},
                "split_s": {"compile_ahead": 0.25, "warm_up": 0.1, "capture": 0.4, "measure": 0.05, "rest": 0.1},
                "second_executor": {"total_s": 0.6, "capture_only_s": 0.3, "split_s": {}},
            },
            "cold --fuse": {
                "buckets": 35,
                "total_s": 1.5,
                "capture_only_s": 0.4,
                "triton": {"compiles": 7, "compile_s": 0.75, "kernels": {}},
                "load_s": 9.5,
                "early_compile": {"launches": 105, "s": 3.25, "waited_s": 0.0, "error": None},
            },
            "warm --fuse": {
                "buckets": 35,
                "total_s": 0.8,
                "samples_s": [1.25, 0.8, 0.75],  # the median run of three processes
                "capture_only_s": 0.5,
                "compile_ahead_note": "skipped: this configuration's kernels were compiled into /tmp/t before",
                "triton": {"compiles": 7, "untimed": 0, "compile_s": 0.2, "kernels": {}},
                "host_probe_us": 1234.4,
            },
        },
        "host": {
            "numpy_write_us": 0.8,
            "full --fuse": {
                "steady_us": {"median": 29.5, "p90": 33.0},
                "step_us": {"median": 45.0, "p90": 60.0},
                "copy_in_us": _lat(12.0),
                "launch_idle_us": _lat(15.0),
                "launch_busy_us": _lat(9.0),
                "kernels_per_replay": 408,
            },
        },
    }
    for name, data in stages.items():
        (tmp_path / f"bench-{name}.json").write_text(json.dumps(data))
    rows = {r[0]: r[1:] for r in summary(tmp_path, Console(file=io.StringIO()))}
    assert rows["  gmtool full: 4.000 ms, hf-compiled / gmtool"] == ("0.60x", ">= 1.2x", "NOT met")
    assert rows["  gmtool full --fuse: 1.600 ms, hf-compiled / gmtool"] == ("1.50x", ">= 1.2x", "met")
    assert rows["hf-compiled B=32 kv=1024"] == ("error", "", "boom")
    host = {k: v for k, v in rows.items() if k.startswith("host time per replay")}
    assert [v[2] for v in host.values()] == ["NOT met", "met", "met"]
    assert rows["decode attention B=32 kv=4096: 3000 GB/s vs copy 4000 GB/s"] == ("75%", ">= 70%", "met")
    cap = {k: v for k, v in rows.items() if k.startswith("capture 35")}
    assert [(v[0], v[1], v[2]) for v in cap.values()] == [
        ("12.00 s", "<= 2 s", "NOT met"),
        ("0.90 s", "<= 1 s", "met"),
        ("1.50 s", "<= 2 s", "met"),
        ("0.80 s", "<= 1 s", "met"),
    ]
    assert any(k.endswith("Triton loaded 8 variants, 8 compiled ahead (that pass 0.25 s))") for k in cap)
    assert list(cap)[3].endswith(
        "Triton loaded 7 variants in 0.20 s; compile-ahead skipped, its marker found (this configuration was "
        "compiled ahead before))"
    )
    split = [k for k in cap if "eager warm-up" in k]
    assert split == [
        "capture 35 default decode buckets, warm Triton cache (capture alone 0.40 s, eager warm-up 0.10, "
        "compile-ahead 0.25, memory readings and uploads 0.05, the rest 0.10; a second executor in the process "
        "0.60 s; Triton loaded 8 variants, 8 compiled ahead (that pass 0.25 s))"
    ]
    assert [k for k in cap if "Triton compiled 7 variants in 0.75 s" in k] == [
        "capture 35 default decode buckets --fuse, cold Triton cache (capture alone 0.40 s; warm-up, compiling and "
        "the rest 1.10 s; Triton compiled 7 variants in 0.75 s; the decode attention's kernels compiled during the "
        "model's build (3.25 s beside it, 0.00 s waited; the build 9.50 s))"
    ]
    assert "cold Triton cache" in next(iter(cap)) and "the rest 10.00 s" in next(iter(cap))
    assert list(cap)[2].startswith("capture 35 default decode buckets --fuse, cold Triton cache")
    assert list(cap)[3].startswith(
        "capture 35 default decode buckets --fuse, warm Triton cache (median of 3 processes, 0.75-1.25 s; capture"
    )
    assert cap[list(cap)[3]][0] == "0.80 s"
    assert "; host probe 1,234 us; Triton loaded 7" in list(cap)[3]  # beside the capture it was taken with
    assert sum("host probe" in k for k in cap) == 1
    assert any(
        "408 kernels per replay" in k and "idle device 45.0 us" in k and v[0] == "29.5 us (p90 33)"
        for k, v in rows.items()
    )


def test_summary_sliding_window_row(tmp_path):
    """The window stage's row: windowed time against full attention's over the same kv, and the bytes each read."""

    def bw(ms, mib):
        return {
            "kernel_ms": ms,
            "kv_bytes": mib * 2**20,
            "kernel_GBps": mib * 2**20 / ms / 1e6,
            "copy_GBps": 4000.0,
            "ratio": 0.7,
            "num_splits": 2,
        }

    data = {"shape": {}, "window_tokens": 4096, "windowed": bw(0.25, 1024), "full": bw(0.5, 2048)}
    (tmp_path / "bench-window.json").write_text(json.dumps(data))
    rows = summary(tmp_path, Console(file=io.StringIO()))
    (row,) = [r for r in rows if r[0].startswith("sliding-window decode")]
    assert "window 4096" in row[0] and "1024 MiB read" in row[0] and "2048 MiB" in row[0]
    assert row[1:] == ("0.50x the time", "<= 0.6x", "met")


def test_summary_of_the_lean_stage(tmp_path):
    def part(mem, host, runners=0, runner_us=None):
        return {
            "graph_mem_bytes": mem,
            "pool_growth_bytes": mem,
            "host_steady_us": host,
            "pieces": runners + 1,
            "runners": runners,
            "runner_us": runner_us,
        }

    lean = {
        "128": {
            "full": part(9 << 20, 20.0),
            "piecewise": {
                **part(10 << 20, 160.0, 28, 4.0),
                "launch_paths": ["direct"],
                "launch_path": "native",
                "host_steady_python_us": 340.0,
            },
            "mem_ratio": 10 / 9,
            "host_extra_us_per_runner": 5.0,
            "host_extra_us_per_runner_python": 11.4,
        },
        "512": {
            "full": part(36 << 20, 20.0),
            "piecewise": part(72 << 20, 300.0, 28, 9.0),
            "mem_ratio": 2.0,
            "host_extra_us_per_runner": 10.0,
        },
    }
    (tmp_path / "bench-lean.json").write_text(json.dumps(lean))
    rows = {r[0]: r[1:] for r in summary(tmp_path, Console(file=io.StringIO()))}
    assert rows["prefill 128: graph memory piecewise / full (10.0 vs 9.0 MiB)"] == ("1.11x", "<= 1.1x", "NOT met")
    assert rows["prefill 512: graph memory piecewise / full (72.0 vs 36.0 MiB)"] == ("2.00x", "<= 1.1x", "NOT met")
    host = [v for k, v in rows.items() if k.startswith("prefill 128: host time per step piecewise vs full (160 vs 20")]
    assert host == [("+5.0 us per runner", "<= 5 us", "met")]
    # how the step launched, and the same step through the Python loop (A/B; an older file has neither)
    assert any("step launched native)" in k for k in rows if k.startswith("prefill 128: host time per step"))
    assert rows["prefill 128: the same through the Python loop (340 us per step)"] == ("+11.4 us per runner", "", "")
    assert not any(k.startswith("prefill 512: the same through the Python loop") for k in rows)
    # a runner alone: under 5 us, and the way its kernels launched (an older file has no paths)
    assert rows["prefill 128: host time of one attention runner (launches: direct)"] == ("4.0 us", "< 5 us", "met")
    assert rows["prefill 512: host time of one attention runner (launches: -)"] == ("9.0 us", "< 5 us", "NOT met")
    # stitched: a step launches no runner alone, so that time is shown without a goal
    lean["128"]["piecewise"]["launch_path"] = "stitched"
    (tmp_path / "bench-lean.json").write_text(json.dumps(lean))
    rows = {r[0]: r[1:] for r in summary(tmp_path, Console(file=io.StringIO()))}
    alone = [v for k, v in rows.items() if k.startswith("prefill 128: one attention runner replayed alone")]
    assert alone == [("4.0 us", "", "")] and not any(k.startswith("prefill 128: host time of one") for k in rows)


def test_summary_judges_the_small_m_gemm(tmp_path):
    """Issue 17's decode goals for --fuse with the small-M GEMM: B=1 kv 1024 within 0.8 ms, B=32 not slower than
    --fuse alone; and the GEMM stage's layer-stack sum against cuBLAS."""

    def row(bucket, ms):
        return {"bucket": bucket, "composition": f"1*{bucket}@1023", "status": "ok", "latency_ms": _lat(ms)}

    gemm = [
        {"name": n, "m": 1, "ours_us": us, "cublas_us": 2 * us, "ours_TBps": 3.0, "cublas_TBps": 1.5}
        for n, us in (("qkv", 3.0), ("down", 2.0))
    ]
    stages = {
        "fused": {"rows": [row(1, 1.21), row(32, 1.50)]},
        "fused-smallm": {"rows": [row(1, 0.79), row(32, 1.52)]},
        "gemm": {"rows": gemm, "layers": 28},
    }
    for name, data in stages.items():
        (tmp_path / f"bench-{name}.json").write_text(json.dumps(data))
    rows = {r[0]: r[1:] for r in summary(tmp_path, Console(file=io.StringIO()))}
    assert rows["decode B=1 kv=1024, --fuse with the small-M GEMM, --fuse alone 1.210 ms"] == (
        "0.790 ms",
        "<= 0.8 ms",
        "met",
    )
    assert rows["decode B=32 kv=1024: --fuse with / without the small-M GEMM (1.520 vs 1.500 ms)"] == (
        "1.01x",
        "<= 1.00x",
        "NOT met",
    )
    assert rows["decode B=1 kv=1024: --fuse with / without the small-M GEMM (0.790 vs 1.210 ms)"][0] == "0.65x"
    (stack,) = [
        v for k, v in rows.items() if k.startswith("small-M GEMM M=1, 28 layers' projections: 140 vs cuBLAS 280 us")
    ]
    assert stack[0] == "2.00x faster"


def test_summary_judges_the_goal_on_the_faster_small_m_stage(tmp_path):
    """With fused-pdl beside fused-smallm: the 0.8 ms goal on the faster of the two, B=32 against --fuse for
    each, PDL on against off; a fused-pdl stage that fell back says so."""

    def row(bucket, ms):
        return {"bucket": bucket, "composition": f"1*{bucket}@1023", "status": "ok", "latency_ms": _lat(ms)}

    stages = {
        "fused": {"rows": [row(1, 1.21), row(32, 1.50)]},
        "fused-smallm": {"rows": [row(1, 0.95), row(32, 1.45)]},
        "fused-pdl": {"rows": [row(1, 0.78), row(32, 1.55)], "notes": []},
    }
    for name, data in stages.items():
        (tmp_path / f"bench-{name}.json").write_text(json.dumps(data))
    rows = {r[0]: r[1:] for r in summary(tmp_path, Console(file=io.StringIO()))}
    what = (
        "decode B=1 kv=1024, --fuse with the small-M GEMM and PDL, --fuse alone 1.210 ms (faster of: "
        "the small-M GEMM 0.950 ms, the small-M GEMM and PDL 0.780 ms)"
    )
    assert rows[what] == ("0.780 ms", "<= 0.8 ms", "met")
    assert rows["decode B=32 kv=1024: --fuse with / without the small-M GEMM (1.450 vs 1.500 ms)"][1:] == (
        "<= 1.00x",
        "met",
    )
    assert rows["decode B=32 kv=1024: --fuse with / without the small-M GEMM and PDL (1.550 vs 1.500 ms)"][1:] == (
        "<= 1.00x",
        "NOT met",
    )
    assert rows["decode B=1 kv=1024: PDL on / off, small-M GEMM (0.780 vs 0.950 ms)"][0] == "0.82x"
    stages["fused-pdl"]["notes"] = ["--pdl: off, PDL needs sm_90 (Hopper) or later, this device is sm_8x"]
    stages["fused-pdl"]["rows"] = [row(1, 0.99)]
    (tmp_path / "bench-fused-pdl.json").write_text(json.dumps(stages["fused-pdl"]))
    rows = {r[0]: r[1:] for r in summary(tmp_path, Console(file=io.StringIO()))}
    assert any(k.startswith("decode B=1 kv=1024, --fuse with the small-M GEMM, --fuse alone") for k in rows)
    assert "fused-pdl: --pdl: off, PDL needs sm_90 (Hopper) or later, this device is sm_8x" in rows


def test_capture_stage_runs_cold_then_warm_processes_on_one_new_triton_cache(monkeypatch):
    """Pairs of fresh processes, each pair on a new Triton cache directory: the first compiles every kernel
    (cold), the second loads them from disk (warm); each label keeps its median run, with every run's total; a
    process that fails is said, not read."""
    import subprocess
    from pathlib import Path
    from types import SimpleNamespace

    from gmtool.measure import bench

    seen = []

    def fake_run(cmd, env, capture_output, text):
        out = Path(cmd[cmd.index("--out") + 1])
        cache = Path(env["TRITON_CACHE_DIR"])
        seen.append((cache, sorted(p.name for p in cache.iterdir())))
        (cache / "kernel.cubin").write_text("x")  # what the cold process leaves for the warm one
        total = [7.5, 3.3, 6.0, 3.0, 9.0, 4.0, 2.5, 0.9, 2.7, 1.2, 2.6, 1.0][len(seen) - 1]
        stage = cmd[cmd.index("--stages") + 1]
        (out / f"bench-{stage}.json").write_text(json.dumps({"buckets": 35, "total_s": total, "capture_only_s": 1.2}))
        return SimpleNamespace(returncode=0, stdout="", stderr="")

    monkeypatch.setattr(subprocess, "run", fake_run)
    got = bench.stage_capture(None)
    # each pair: a new cache, empty for the cold process, holding what it compiled for the warm one
    assert bench.CAPTURE_SAMPLES == 3 and len(seen) == 12
    assert [s[1] for s in seen] == [[], ["kernel.cubin"]] * 6
    assert all(seen[i][0] == seen[i + 1][0] != seen[i + 2][0] for i in range(0, 10, 2))
    assert {k: (v["total_s"], v["samples_s"]) for k, v in got.items()} == {
        "cold": (7.5, [7.5, 6.0, 9.0]),
        "warm": (3.3, [3.3, 3.0, 4.0]),
        "cold --fuse": (2.6, [2.5, 2.7, 2.6]),
        "warm --fuse": (1.0, [0.9, 1.2, 1.0]),
    }
    monkeypatch.setattr(subprocess, "run", lambda *a, **k: SimpleNamespace(returncode=1, stdout="", stderr="boom"))
    with pytest.raises(RuntimeError, match="cold capture process failed: boom"):
        bench.stage_capture(None)


def test_summary_judges_the_small_m_goals_on_the_variants_in_turns(tmp_path):
    """decode-ab's figures (one process, the variants in turns) decide the small-M rows where it ran, not the
    stages timed one after another; a B=32 ratio that shows as 1.00x is not slower."""
    from gmtool.measure import decode_ab

    def row(variant, bucket, ms):
        return {
            "variant": variant,
            "bucket": bucket,
            "composition": f"1*{bucket}@1023",
            "status": "ok",
            "latency_ms": _lat(ms),
            "round_medians_ms": [ms] * 3,
        }

    ab = {
        "rows": [row("fused", 1, 1.25), row("fused", 32, 2.200), row("fused-smallm", 1, 0.99)]
        + [row("fused-smallm", 32, 2.204), row("fused-pdl", 1, 0.93), row("fused-pdl", 32, 2.250)],
        "notes": [],
    }
    assert (
        set(decode_ab.as_stages(ab)) == {"fused", "fused-smallm", "fused-pdl"} == {v.name for v in decode_ab.VARIANTS}
    )
    stages = {
        "fused": {"rows": [row("", 1, 1.0), row("", 32, 1.0)]},  # a fast first stage: must not be the baseline
        "fused-smallm": {"rows": [row("", 1, 0.5), row("", 32, 0.5)]},
        "decode-ab": ab,
    }
    for name, data in stages.items():
        (tmp_path / f"bench-{name}.json").write_text(json.dumps(data))
    rows = {r[0]: r[1:] for r in summary(tmp_path, Console(file=io.StringIO()))}
    tag = " [decode-ab: one process, in turns]"
    (goal,) = [v for k, v in rows.items() if k.startswith("decode B=1 kv=1024, --fuse with the small-M GEMM and PDL")]
    assert goal == ("0.930 ms", "<= 0.8 ms", "NOT met")
    assert rows[f"decode B=32 kv=1024: --fuse with / without the small-M GEMM (2.204 vs 2.200 ms){tag}"] == (
        "1.00x",
        "<= 1.00x",
        "met",
    )
    assert rows[f"decode B=32 kv=1024: --fuse with / without the small-M GEMM and PDL (2.250 vs 2.200 ms){tag}"][2] == (
        "NOT met"
    )
    assert not any("0.500 ms" in k for k in rows)
    ab["rows"] = [r for r in ab["rows"] if r["variant"] != "fused-pdl"]
    ab["notes"] = ["--pdl: off, PDL needs sm_90 (Hopper) or later, this device is sm_8x"]
    (tmp_path / "bench-decode-ab.json").write_text(json.dumps(ab))
    rows = {r[0]: r[1:] for r in summary(tmp_path, Console(file=io.StringIO()))}
    assert "fused-pdl: --pdl: off, PDL needs sm_90 (Hopper) or later, this device is sm_8x" in rows
    assert rows[f"decode B=1 kv=1024, --fuse with the small-M GEMM, --fuse alone 1.250 ms{tag}"][0] == "0.990 ms"


def test_decode_ab_rounds_rotate_which_variant_goes_first():
    from gmtool.measure.decode_ab import rotated

    work = ["a1", "a2", "b1", "b2", "c1", "c2"]
    firsts = [rotated(work, k * 2)[0] for k in range(4)]
    assert firsts == ["a1", "b1", "c1", "a1"]
    assert sorted(rotated(work, 3)) == sorted(work)


def test_the_host_probe_times_the_keyings_it_is_asked_for():
    """The probe's figure grows with the launches it keys (40 times the work: no scheduling noise inverts it)."""
    from gmtool.measure.timing import host_probe_us

    small, large = host_probe_us(launches=50, repeats=3), host_probe_us(launches=2000, repeats=3)
    assert 0 < small < large
