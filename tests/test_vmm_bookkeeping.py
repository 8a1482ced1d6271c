"""The VMM allocator's bookkeeping on the fake driver, memreport's arithmetic and files, its CPU refusal."""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from rich.console import Console

from gmtool.errors import GmtoolError

MiB = 2**20
GRAN = 2 * MiB
REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def lib(tmp_path_factory):
    if shutil.which("g++") is None:
        pytest.skip("g++ is not installed")
    from gmtool.memory.vmm import VmmLibrary, build_library

    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GMTOOL_CACHE_DIR", str(tmp_path_factory.mktemp("gmtool-cache")))
        path = build_library(fake=True)
        assert build_library(fake=True) == path  # cached by source hash, not rebuilt
    lib = VmmLibrary(path)
    yield lib
    lib.shutdown(force=True)


def fresh(lib, range_bytes=64 * MiB, chunk=0, gran=GRAN, supported=1, fail_create_at=0, fail_map_at=0):
    lib.shutdown(force=True)
    lib.fake_configure(gran, supported, fail_create_at, fail_map_at)
    lib.init(0, range_bytes, chunk)
    return lib


def malloc(lib, n, device=0):
    return lib.lib.gmtool_vmm_malloc(n, device, None)


def calls(lib, op):
    """The fake driver's log lines for one operation, as dicts of their fields."""
    out = []
    for line in lib.fake_log().decode().splitlines():
        if line.split()[0] == op:
            out.append({k: int(v, 0) for k, v in re.findall(r"(\w+)=(0x[0-9a-f]+|\d+)", line)})
    return out


def test_offsets_are_bumped_and_aligned(lib):
    fresh(lib)
    assert lib.begin_range() == 0
    p1, p2, p3 = malloc(lib, 100), malloc(lib, 1000), malloc(lib, 512)
    assert p1 == lib.range_base(0)
    assert (p2 - p1, p3 - p1) == (512, 1536)  # 512-byte alignment
    assert lib.current_used() == 2048 and lib.range_used(0) == 2048
    assert lib.physical_bytes() == GRAN  # one chunk covers all three


def test_granularity_rounding(lib):
    fresh(lib, range_bytes=10 * MiB, chunk=3 * MiB)
    assert lib.granularity() == GRAN
    assert lib.chunk_bytes() == 4 * MiB  # rounded up to the granularity
    assert lib.range_bytes() == 12 * MiB  # rounded up to the chunk
    fresh(lib, range_bytes=10 * MiB, chunk=0)
    assert lib.chunk_bytes() == GRAN
    lib.begin_range()
    assert calls(lib, "reserve")[0]["size"] == 10 * MiB  # the whole range, rounded to the chunk


def test_chunks_grow_only_past_the_previous_max_and_every_range_maps_them_all(lib):
    fresh(lib)
    r0 = lib.begin_range()
    assert malloc(lib, 5 * MiB)  # shape 0 needs 3 chunks
    handles = [c["h"] for c in calls(lib, "create")]
    assert len(handles) == 3 and lib.physical_bytes() == 6 * MiB

    r1 = lib.begin_range()
    base1 = lib.range_base(r1)
    assert base1 != lib.range_base(r0)
    maps = calls(lib, "map")[-3:]  # every existing chunk mapped into the new range at its own offset
    assert [(m["va"] - base1, m["h"]) for m in maps] == [(i * GRAN, h) for i, h in enumerate(handles)]
    assert {a["va"] for a in calls(lib, "access")} >= {m["va"] for m in maps}

    assert malloc(lib, 3 * MiB) and malloc(lib, 2 * MiB)  # 5 MiB: within what shape 0 already made
    assert len(calls(lib, "create")) == 3
    assert malloc(lib, 3 * MiB)  # past the previous max: one more chunk, mapped into this range only
    creates = calls(lib, "create")
    assert len(creates) == 4 and lib.physical_bytes() == 8 * MiB
    new = creates[-1]["h"]
    assert [m["va"] - base1 for m in calls(lib, "map") if m["h"] == new] == [3 * GRAN]
    assert lib.range_mapped(r0) == 6 * MiB and lib.range_mapped(r1) == 8 * MiB

    r2 = lib.begin_range()
    base2 = lib.range_base(r2)
    assert sorted((m["va"] - base2, m["h"]) for m in calls(lib, "map") if base2 <= m["va"]) == [
        (i * GRAN, h) for i, h in enumerate(handles + [new])
    ]
    assert len(calls(lib, "create")) == 4  # a new range alone creates nothing


def test_one_range_per_begin(lib):
    fresh(lib, range_bytes=16 * MiB)
    for i in range(4):
        assert lib.begin_range() == i
        assert malloc(lib, (i + 1) * MiB)
    st = lib.stats()
    assert lib.num_ranges() == 4 and len(calls(lib, "reserve")) == 4
    assert len({r.base for r in st.ranges}) == 4
    assert st.virtual_reserved_bytes == 4 * 16 * MiB
    assert st.virtual_mapped_bytes == sum(r.mapped_bytes for r in st.ranges)
    assert [r.used_bytes for r in st.ranges] == [(i + 1) * MiB for i in range(4)]
    assert st.physical_bytes == 4 * MiB  # max(shape), not 1+2+3+4 MiB


def test_growth_runs_with_stream_capture_relaxed(lib):
    """torch mallocs during capture: new chunks are made and mapped in the relaxed capture mode, then the
    thread's mode is put back; a malloc that needs no new chunk leaves the mode alone."""
    fresh(lib)
    lib.begin_range()
    assert malloc(lib, 3 * MiB)
    ops = [
        line.split()[0] + (line.split()[1] if line.startswith("capture_mode") else "")
        for line in lib.fake_log().decode().splitlines()
    ]
    grow = ops[ops.index("capture_modeset=2") :]
    assert grow[0] == "capture_modeset=2" and grow[-1] == "capture_modeset=0"
    assert {"create", "map", "access"} <= set(grow[1:-1])
    n = len(ops)
    assert malloc(lib, 1000) and len(lib.fake_log().decode().splitlines()) == n


def test_malloc_begins_a_range_when_none_was(lib):
    fresh(lib)
    assert malloc(lib, 10) and lib.num_ranges() == 1


def test_failed_create_returns_null_with_the_reason(lib):
    fresh(lib, fail_create_at=2)
    lib.begin_range()
    assert malloc(lib, 3 * MiB) is None  # needs 2 chunks: the second cuMemCreate fails
    err = lib.error()
    assert "cuMemCreate" in err and "OUT_OF_MEMORY" in err
    assert lib.physical_bytes() == GRAN and lib.current_used() == 0  # nothing handed out
    assert malloc(lib, 1 * MiB)  # what fits the chunk that was made still works


def test_failed_map_releases_the_new_chunk(lib):
    fresh(lib, fail_map_at=1)
    assert malloc(lib, MiB) is None
    assert "cuMemMap" in lib.error()
    assert lib.physical_bytes() == 0 and len(calls(lib, "release")) == 1 and lib.fake_live_handles() == 0


def test_a_shape_larger_than_its_range_fails(lib):
    fresh(lib, range_bytes=4 * MiB)
    assert malloc(lib, 5 * MiB) is None
    assert "virtual range" in lib.error()


def test_wrong_device_and_uninitialised(lib):
    fresh(lib)
    assert malloc(lib, 10, device=1) is None and "device" in lib.error()
    lib.shutdown(force=True)
    assert malloc(lib, 10) is None and "init" in lib.error()


def test_unsupported_device_is_a_clear_error(lib):
    lib.shutdown(force=True)
    lib.fake_configure(GRAN, 0, 0, 0)
    with pytest.raises(GmtoolError, match="does not support CUDA virtual memory management"):
        lib.init(0, 64 * MiB, 0)


def test_shutdown_waits_for_torch_then_releases_everything(lib):
    fresh(lib)
    lib.begin_range()
    p = malloc(lib, 3 * MiB)
    lib.begin_range()
    q = malloc(lib, MiB)
    with pytest.raises(GmtoolError, match="already initialised"):
        lib.init(0, 64 * MiB, 0)
    assert "still held" in lib.shutdown()  # torch still holds segments: nothing unmapped
    assert lib.fake_live_mappings() > 0
    lib.lib.gmtool_vmm_free(p, 3 * MiB, 0, None)
    lib.lib.gmtool_vmm_free(q, MiB, 0, None)
    assert lib.shutdown() is None
    assert (lib.fake_live_mappings(), lib.fake_live_handles(), lib.fake_live_reservations()) == (0, 0, 0)
    assert len(calls(lib, "unmap")) == 4 and len(calls(lib, "release")) == 2


def test_check_flags_live_blocks_and_foreign_segments_in_the_shared_ranges(lib, monkeypatch):
    """Vmm.check against a synthetic allocator snapshot, with ranges from the fake-driver allocator."""
    from types import SimpleNamespace

    from gmtool.memory.strategies import Vmm

    fresh(lib)
    lib.begin_range()
    seg = malloc(lib, 4 * MiB)
    lib.begin_range()
    other = lib.range_base(1) + 8 * MiB  # inside range 1, never handed to our pools
    snapshot = [
        {
            "address": seg,
            "total_size": 4 * MiB,
            "segment_pool_id": (0, 7),
            "blocks": [
                {"address": seg, "size": MiB, "state": "active_allocated"},  # a graph step holds it
                {"address": seg + MiB, "size": MiB, "state": "active_allocated"},  # nobody should
                {"address": seg + 2 * MiB, "size": 2 * MiB, "state": "inactive"},
            ],
        },
        {"address": other, "total_size": 2 * MiB, "segment_pool_id": (0, 0), "blocks": []},
        {"address": 0x1000, "total_size": 2 * MiB, "segment_pool_id": (0, 0), "blocks": []},  # elsewhere
    ]
    monkeypatch.setattr(torch.cuda, "memory_snapshot", lambda *a, **k: snapshot)
    s = object.__new__(Vmm)
    s.vmm, s.pool_ids, s.warnings = SimpleNamespace(lib=lib), {"d8": (0, 7)}, []
    warnings = s.check(held=[(seg, 4096)])
    assert len(warnings) == 2, warnings
    assert f"{seg + MiB:#x} (range 0) outlives its capture" in warnings[0]
    assert "not a graph pool" in warnings[1] and "range 1" in warnings[1]
    assert s.warnings == warnings


# -- strategies and memreport without CUDA ------------------------------------------------------------
def test_strategy_names():
    from gmtool.memory.strategies import make_strategy, parse_strategies

    assert parse_strategies("vmm, shared,vmm") == ["vmm", "shared"]
    with pytest.raises(GmtoolError, match="unknown strategy 'bogus'"):
        parse_strategies("shared,bogus")
    with pytest.raises(GmtoolError, match="unknown strategy"):
        make_strategy("bogus", torch.device("cpu"))
    with pytest.raises(GmtoolError, match="needs a CUDA device"):
        make_strategy("vmm", torch.device("cpu"))


def _key(bucket, need, dev=None):
    return {
        "key": f"d{bucket}",
        "bucket": bucket,
        "capture_s": 0.01,
        "graph_mem_bytes": need,
        "device_delta_bytes": dev,
        "nvml_delta_bytes": None,
    }


def _rec(mode, bucket, status="ok", err=0.0, lat=1.0, error=None):
    return {
        "mode": mode,
        "bucket": bucket,
        "key": f"d{bucket}",
        "status": status,
        "max_rel_err": err,
        "latency_ms": {"median": lat} if status == "ok" else None,
        "error": error,
    }


def _raw(name, physical, needs=(32, 64, 128, 256), shuffled_status="ok", records=None, **kw):
    raw = {
        "strategy": name,
        "mode": "full",
        "per_key": [_key(2**i, n * MiB, dev=physical // len(needs)) for i, n in enumerate(needs)],
        "records": records
        if records is not None
        else [_rec("eager", b["bucket"], lat=4.0) for b in [{"bucket": 1}]] + [_rec("full", 2**i) for i in range(4)],
        "shuffled": [
            {
                "mode": "full",
                "order": i,
                "key": f"d{2**i}",
                "composition": "1*1",
                "status": shuffled_status,
                "max_rel_err": 1e-6,
                "error": None,
            }
            for i in range(4)
        ],
        "measured": {"graph_pool_bytes": physical, "physical_bytes": physical},
        "inputs": {"input_arena_bytes": 1000, "input_per_shape_bytes": 1500},
        "warnings": [],
        "errors": [],
    }
    raw.update(kw)
    return raw


def exit_code(rows) -> int:
    from gmtool.memory.document import MemDocument

    return MemDocument(machine={}, model={}, config={}, mode="full", scenario="decode", strategies=rows).exit_code()


def test_sum_and_max_arithmetic():
    from gmtool.memory.report import derive, shape_totals

    assert shape_totals([_key(1, 3), _key(2, 5), _key(4, None)]) == (8, 5)
    assert shape_totals([]) == (None, None)
    row = derive(_raw("vmm", 256 * MiB))
    assert (row.sum_shape_bytes, row.max_shape_bytes) == (480 * MiB, 256 * MiB)
    assert row.physical_over_max == 1.0 and row.physical_over_sum == pytest.approx(256 / 480)
    assert row.status == "ok" and row.captures == 4 and row.device_used_bytes == 256 * MiB
    assert row.replay_ms_median == 1.0 and row.eager_ms_median == 4.0
    assert (row.shuffled_replays, row.shuffled_ok) == (4, 4)


def test_status_names_the_failure():
    from gmtool.memory.report import derive

    unsafe = derive(_raw("vmm", MiB, shuffled_status="UNSAFE"))
    assert unsafe.status == "UNSAFE"
    failed = _rec("full", 4, "oom", error="out of memory while capturing bucket d4")
    oom = derive(_raw("shared", MiB, records=[_rec("full", 8), failed]))
    assert oom.status == "oom" and "d4" in oom.reason
    na = derive({"strategy": "vmm", "mode": "full", "status": "unavailable", "reason": "no g++"})
    ok = derive(_raw("independent", 480 * MiB))
    assert exit_code([ok, na]) == 0
    assert exit_code([na]) == 1
    assert exit_code([ok, oom]) == 1
    assert exit_code([ok, unsafe]) == 3


def test_report_files_and_table(tmp_path):
    from gmtool.config import SweepConfig
    from gmtool.memory.report import ROW_FIELDS, build_document, derive, memreport_table, write_report

    cfg = SweepConfig(device="cpu", buckets="1,2,4,8", modes=("eager", "full"))
    rows = [
        derive(_raw("independent", 480 * MiB)),
        derive(_raw("shared", 272 * MiB)),
        derive({"strategy": "vmm", "mode": "full", "status": "unavailable", "reason": "no cuda.h"}),
        derive(_raw("shared-ascending", 400 * MiB, order="ascending")),
    ]
    doc = build_document(cfg, rows)
    assert (doc.sum_shape_bytes, doc.max_shape_bytes) == (480 * MiB, 256 * MiB)
    paths = write_report(tmp_path, doc)
    assert [p.name for p in paths] == ["memreport.json", "memreport.csv", "memreport.png"]
    back = json.loads(paths[0].read_text())
    assert [r["strategy"] for r in back["strategies"]] == ["independent", "shared", "vmm", "shared-ascending"]
    assert back["strategies"][2]["status"] == "unavailable"
    with paths[1].open() as f:
        table = list(csv.DictReader(f))
    assert list(table[0]) == list(ROW_FIELDS) and len(table) == 4
    assert float(table[1]["physical_over_max"]) == pytest.approx(272 / 256)
    assert paths[2].read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and paths[2].stat().st_size > 5000
    console = Console(record=True, width=250)
    console.print(memreport_table(doc))
    text = console.export_text()
    for needle in ("independent", "shared-ascending", "unavailable", "480.0 MiB", "1.06", "4/4"):
        assert needle in text


class _Recorder:
    """A stand-in strategy for the CPU backend (which has no pools): records the hooks' calls."""

    def __init__(self, order="descending"):
        self.order, self.keys, self.per_key, self.warnings, self.released = order, [], {}, [], False

    def pool_for(self, key):
        self.keys.append(key)

    def captured(self, key, entry):
        self.per_key[str(key)] = {
            "key": str(key),
            "bucket": key.num_tokens,
            "graph_mem_bytes": None,
            "capture_s": entry.capture_s,
        }

    def measure(self):
        return {"graph_pool_bytes": 0, "physical_bytes": 0}

    def check(self, held=()):
        self.held = list(held)
        return []

    def failure_detail(self):
        return None

    def release(self):
        self.released = True


@pytest.mark.parametrize("mode,order", [("full", "ascending"), ("piecewise", "descending")])
def test_memsweep_on_the_cpu_backend(mode, order):
    """The sweep honours the strategy's order; shuffled replays match eager; input costs add up."""
    from gmtool.config import SweepConfig
    from gmtool.measure.sweep import Sweep
    from gmtool.memory.report import ShuffledReplayProbe, derive

    cfg = SweepConfig(
        device="cpu",
        model="tiny-qwen3",
        buckets="1,2,4",
        modes=("eager", mode),
        num_iters=1,
        num_iters_warmup=0,
        max_kv_len=64,
    )
    rec = _Recorder(order)
    sweep = ShuffledReplayProbe(rec, cfg.seed)
    res = Sweep(cfg, None, lambda mode: rec, probes=(sweep,)).run()
    sizes = [k.num_tokens for k in rec.keys]
    assert sizes == sorted(sizes, reverse=(order == "descending")) and len(sizes) == 3
    assert rec.released
    assert len(sweep.shuffled) == sum(len(c) for c in cfg.compositions_by_bucket.values())
    assert all(s["status"] == "ok" for s in sweep.shuffled), sweep.shuffled
    assert [s["composition"] for s in sweep.shuffled] != [
        c.label for b in sorted(cfg.compositions_by_bucket) for c in cfg.compositions_by_bucket[b]
    ]
    inputs = sweep.inputs[mode]
    assert 0 < inputs["input_per_shape_bytes"] and inputs["input_arena_bytes"] > 0
    assert bool(rec.held) == (mode == "piecewise")  # piecewise graphs own the tensors between pieces
    row = derive(
        {
            "strategy": "cpu",
            "mode": mode,
            "per_key": list(rec.per_key.values()),
            "shuffled": sweep.shuffled,
            "records": [r.to_dict() for r in res.records],
            "errors": res.errors,
            "measured": sweep.measured,
            "inputs": inputs,
        }
    )
    assert row.status == "ok" and row.replays == row.replays_ok > 0


def test_memsweep_shuffled_check_flags_a_broken_graph():
    """Bucket 2's graph stops working once the sweep has measured it (its steps replay nothing): every shuffled
    replay of bucket 2 is UNSAFE, with an error far over the tolerance (or NaN), while bucket 1's stay ok; the
    strategy's row is UNSAFE, exit code 3."""
    import math

    from gmtool.config import SweepConfig
    from gmtool.memory.report import ShuffledReplayProbe, derive
    from gmtool.measure.sweep import Sweep
    from gmtool.measure.timing import tolerances_for

    class BreaksBucket2(ShuffledReplayProbe):
        def after_sweep(self, bench, executors, res):
            ex = executors["full"]
            self.broken = str(next(k for k in ex.graphs if k.num_tokens == 2))
            for step in next(e for k, e in ex.graphs.items() if k.num_tokens == 2).steps:
                step.replay = lambda: None
            super().after_sweep(bench, executors, res)

    cfg = SweepConfig(
        device="cpu",
        model="tiny-qwen3",
        buckets="1,2",
        modes=("eager", "full"),
        num_iters=1,
        num_iters_warmup=0,
        max_kv_len=64,
    )
    rec = _Recorder()
    sweep = BreaksBucket2(rec, cfg.seed)
    res = Sweep(cfg, None, lambda mode: rec, probes=(sweep,)).run()
    assert [r.status for r in res.records if r.mode == "full"] == ["ok"] * 6  # measured before the break
    tol_same, tol = tolerances_for(torch.float32)
    shuffled = {b: [s for s in sweep.shuffled if s["key"] == b] for b in ("d1", sweep.broken)}
    assert sweep.broken == "d2" and [len(v) for v in shuffled.values()] == [3, 3]
    for s in shuffled["d2"]:
        assert s["status"] == "UNSAFE", s
        for err, limit in ((s["max_rel_err"], tol), (s["max_rel_err_same_shape"], tol_same)):
            assert math.isnan(err) or err > 100 * limit, s
    for s in shuffled["d1"]:
        assert s["status"] == "ok" and s["max_rel_err_same_shape"] <= tol_same and s["max_rel_err"] <= tol, s
    row = derive(
        {
            "strategy": "cpu",
            "mode": "full",
            "per_key": list(rec.per_key.values()),
            "shuffled": sweep.shuffled,
            "records": [r.to_dict() for r in res.records],
            "errors": res.errors,
            "measured": sweep.measured,
            "inputs": sweep.inputs["full"],
        }
    )
    assert (row.status, row.shuffled_replays, row.shuffled_ok) == ("UNSAFE", 6, 3)
    assert "d2" in row.reason and exit_code([row]) == 3


def test_memreport_cli_keeps_results_and_fails_on_oom(monkeypatch, tmp_path):
    """The command's own flow with the measuring stubbed out (it needs CUDA): files, table, exit code."""
    from types import SimpleNamespace

    from typer.testing import CliRunner

    import gmtool.cli.memreport as cli
    from gmtool.cli.main import app
    import gmtool.memory.report as report
    from gmtool.memory.report import derive

    real_build = cli.build_config

    def build_on_cuda(*a, **kw):
        cfg = real_build(*a, **kw)
        cfg.torch_device = torch.device("cuda")  # pretend: only the device check reads it before the stubs
        return cfg

    rows = {
        "independent": derive(_raw("independent", 480 * MiB)),
        "vmm": derive({"strategy": "vmm", "mode": "full", "status": "unavailable", "reason": "no cuda.h"}),
        "shared": derive(
            _raw(
                "shared",
                272 * MiB,
                records=[_rec("full", 8), _rec("full", 4, "oom", error="out of memory while capturing bucket d4")],
            )
        ),
    }
    result = SimpleNamespace(machine={"device": "cuda", "gpu": "stub"}, model={"name": "tiny-qwen3"})
    monkeypatch.setattr(cli, "build_config", build_on_cuda)
    monkeypatch.setattr(report, "run_strategy", lambda cfg, name, progress=None, shared=None: (rows[name], result))
    out = tmp_path / "mem"
    r = CliRunner().invoke(
        app,
        ["memreport", "-m", "tiny-qwen3", "-b", "1,2,4,8", "--strategies", "independent,vmm,shared", "--out", str(out)],
    )
    assert r.exit_code == 1, r.output
    assert "unavailable: no cuda.h" in r.output and "bucket d4" in r.output
    doc = json.loads((out / "memreport.json").read_text())
    assert [s["status"] for s in doc["strategies"]] == ["ok", "unavailable", "oom"]
    with (out / "memreport.csv").open() as f:
        table = list(csv.DictReader(f))
    assert [(t["strategy"], t["status"]) for t in table] == [
        ("independent", "ok"),
        ("vmm", "unavailable"),
        ("shared", "oom"),
    ]
    assert float(table[0]["physical_bytes"]) == 480 * MiB and "bucket d4" in table[2]["reason"]
    assert (out / "memreport.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    r = CliRunner().invoke(app, ["memreport", "-m", "tiny-qwen3", "--strategies", "independent", "--out", str(out)])
    assert isinstance(r.exception, GmtoolError) and "--force" in str(r.exception)  # never overwrites silently
    r = CliRunner().invoke(
        app, ["memreport", "-m", "tiny-qwen3", "--strategies", "independent,vmm", "--out", str(out), "--force"]
    )
    assert r.exit_code == 0, r.output


def test_memreport_on_cpu_exits_with_one_clear_line():
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    p = subprocess.run(
        [sys.executable, "-m", "gmtool.cli.main", "memreport", "--device", "cpu", "-b", "1,2"],
        capture_output=True,
        text=True,
        env=env,
        cwd=REPO,
        timeout=300,
    )
    assert p.returncode != 0
    assert "memory strategies need CUDA" in p.stderr and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1


def test_memreport_rejects_an_unknown_strategy():
    from typer.testing import CliRunner

    from gmtool.cli.main import app

    result = CliRunner().invoke(app, ["memreport", "--strategies", "shared,nope"])
    assert result.exit_code != 0
    assert isinstance(result.exception, GmtoolError) and "unknown strategy 'nope'" in str(result.exception)
