"""The graph memory ledger's arithmetic on the CPU: parts and totals, KV tokens given up, the cuBLAS workspace,
the per-strategy fit, its prediction and the prediction error."""

from __future__ import annotations

import dataclasses

import pandas as pd
import pytest

from gmtool.errors import GmtoolError
from gmtool.memory.ledger import (
    check_prediction,
    cublas_workspace_bytes,
    fit,
    kv_bytes_per_token,
    ledger,
    ledger_from_records,
    predict,
    sample_buckets,
    strategy_ledger,
)

QWEN3_06B = {"layers": 28, "kv_heads": 8, "head_dim": 128}
MiB = 2**20


def test_kv_bytes_per_token():
    assert kv_bytes_per_token(QWEN3_06B, 2) == 2 * 28 * 8 * 128 * 2 == 114_688


def test_ledger_totals_and_kv_tokens_given_up():
    rows = pd.DataFrame(
        {
            "bucket": [8, 16],
            "mode": "full",
            "strategy": "shared",
            "pool_bytes": [10 * MiB, 20 * MiB],
            "outside_pool_bytes": [2 * MiB, None],
            "inputs_bytes": [1024, 2048],
            "workspace_bytes": [32 * MiB, 0],
        }
    )
    df = ledger(rows, 114_688)
    assert df["total_bytes"].tolist() == [44 * MiB + 1024, 20 * MiB + 2048]  # an unknown part adds nothing
    assert df["kv_tokens_given_up"].tolist() == pytest.approx(
        [(44 * MiB + 1024) / 114_688, (20 * MiB + 2048) / 114_688]
    )


def test_ledger_needs_the_pool_for_a_total():
    # the CPU tape: no pool, nothing outside it, no workspace; the inputs alone are not the total
    df = ledger(
        pd.DataFrame(
            {"bucket": [4], "mode": "full", "strategy": "shared", "pool_bytes": [None], "inputs_bytes": [4096]}
        ),
        114_688,
    )
    assert df["total_bytes"].isna().all() and df["kv_tokens_given_up"].isna().all()


def _captured(bucket, pool, outside, inputs, workspace, kv=114_688):
    total = pool + outside + inputs + workspace
    return {
        "bucket": bucket,
        "key": f"d{bucket}",
        "mode": "full",
        "composition": f"1*{bucket}",
        "status": "ok",
        "capture_s": 0.1,
        "graph_mem_bytes": pool,
        "pool_growth_bytes": pool,
        "outside_pool_bytes": outside,
        "inputs_bytes": inputs,
        "workspace_bytes": workspace,
        "ledger_total_bytes": total,
        "kv_tokens_given_up": total // kv,
    }


def test_ledger_from_records_reads_the_capture_rows():
    recs = [_captured(4, 4 * MiB, MiB, 1024, 0), _captured(2, 2 * MiB, MiB, 512, 32 * MiB)]
    recs.append({"bucket": 2, "mode": "full", "composition": "1*1", "status": "ok", "capture_s": None})  # a replay
    recs.append({"bucket": 2, "mode": "eager", "composition": "1*2", "status": "ok"})
    df = ledger_from_records(recs)
    assert df["bucket"].tolist() == [2, 4] and set(df["strategy"]) == {"shared"}
    assert df["workspace_bytes"].tolist() == [32 * MiB, 0]
    assert df["total_bytes"].tolist() == [35 * MiB + 512, 5 * MiB + 1024]
    assert df["kv_tokens_given_up"].tolist() == [(35 * MiB + 512) // 114_688, (5 * MiB + 1024) // 114_688]
    assert ledger_from_records([]).empty


def test_vmm_ledger_charges_each_bucket_the_physical_memory_it_added():
    recs = [_captured(b, 0, 0, 100, 0) for b in (8, 4, 2)]
    per_key = [
        {"key": "d8", "bucket": 8, "physical_after_bytes": 8 * MiB},  # captured largest first
        {"key": "d4", "bucket": 4, "physical_after_bytes": 8 * MiB},
        {"key": "d2", "bucket": 2, "physical_after_bytes": 10 * MiB},
    ]  # 2 needed a new chunk
    df = strategy_ledger("vmm", recs, per_key, MiB)
    assert df["pool_bytes"].tolist() == [2 * MiB, 0, 8 * MiB]
    assert df["total_bytes"].tolist() == [2 * MiB + 100, 100, 8 * MiB + 100]
    assert df["kv_tokens_given_up"].tolist() == pytest.approx([2 + 100 / MiB, 100 / MiB, 8 + 100 / MiB])
    same = strategy_ledger("shared", recs, [], MiB)  # no VMM figures: the records' pool growth stands
    assert same["pool_bytes"].tolist() == [0, 0, 0]


def test_cublas_workspace(monkeypatch):
    monkeypatch.delenv("CUBLAS_WORKSPACE_CONFIG", raising=False)
    assert cublas_workspace_bytes((9, 0)) == 32 * MiB
    assert cublas_workspace_bytes((8, 0)) == 8 * MiB + 128 * 1024
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096:2:16:8")
    assert cublas_workspace_bytes((9, 0)) == 8 * MiB + 128 * 1024
    monkeypatch.setenv("CUBLAS_WORKSPACE_CONFIG", ":4096")
    with pytest.raises(GmtoolError, match="pairs"):
        cublas_workspace_bytes((9, 0))


def test_fit_predict_and_error_per_strategy():
    # recorded additions per capture, largest bucket first: separate pools add 1 MiB + 0.5 MiB per token each;
    # the shared pool holds the first capture's 129 MiB and each later graph keeps 16 KiB per token in it
    sampled = pd.DataFrame(
        {
            "strategy": ["shared"] * 4 + ["independent"] * 4,
            "bucket": [256, 1, 72, 168] * 2,
            "pool_bytes": [129 * MiB]
            + [16 * 1024 * b for b in (1, 72, 168)]
            + [MiB + 0.5 * MiB * b for b in (256, 1, 72, 168)],
        }
    )
    f = fit(sampled[sampled["strategy"] == "independent"])
    assert f.loc["independent", "slope"] == pytest.approx(0.5 * MiB) and f.loc[
        "independent", "intercept"
    ] == pytest.approx(MiB)
    buckets = [1, 2, 4] + list(range(8, 257, 8))
    pred = predict(sampled, buckets, {"shared": 256, "independent": 256})
    assert list(pred.index) == ["shared", "independent"]  # as given
    assert pred.loc["shared", "predicted_bytes"] == pytest.approx(129 * MiB + 16 * 1024 * (sum(buckets) - 256))
    assert pred.loc["independent", "predicted_bytes"] == pytest.approx(sum(MiB + 0.5 * MiB * b for b in buckets))
    assert pred.loc["shared", "first_bytes"] == 129 * MiB and pred.loc["shared", "sample_bytes"] == pytest.approx(
        129 * MiB + 16 * 1024 * 241
    )
    err = check_prediction(pred, {"shared": 120 * MiB, "independent": pred.loc["independent", "predicted_bytes"]})
    assert err.loc["shared", "error_pct"] == pytest.approx(
        100 * (pred.loc["shared", "predicted_bytes"] / (120 * MiB) - 1)
    )
    assert err.loc["independent", "error_pct"] == pytest.approx(0.0)
    with pytest.raises(GmtoolError, match="captured first"):
        predict(sampled, buckets, {"shared": 8, "independent": 256})


def test_fit_needs_a_measured_bucket():
    with pytest.raises(GmtoolError, match="nothing to fit"):
        fit(pd.DataFrame({"strategy": ["shared"], "bucket": [1], "pool_bytes": [None]}))


def test_sample_buckets_keep_both_ends():
    default = [1, 2, 4] + list(range(8, 257, 8))
    assert sample_buckets(default, 4) == [1, 72, 168, 256]  # positions 0, 11, 23, 34
    assert sample_buckets(default, 2) == [1, 256]
    assert sample_buckets([1, 2, 4], 8) == [1, 2, 4]
    with pytest.raises(GmtoolError, match="at least 2"):
        sample_buckets(default, 1)


# -- memreport --sample / --check through the library, on recorded measurements ------------------------------
def _recorded_strategy(cfg, name, progress=None):
    """What a strategy's run measured, as a CUDA run records it: each bucket's need grows linearly; independent
    pools hold each need in whole 2 MiB segments; the shared pool holds the largest need plus 3%, and each later
    graph keeps 8 KiB per token in it."""
    import math

    from gmtool.memory.report import derive

    need = {b: int(3 * MiB + 0.37 * MiB * b) for b in cfg.bucket_sizes}
    seg = {b: math.ceil(n / (2 * MiB)) * 2 * MiB for b, n in need.items()}
    order = sorted(need, reverse=True)
    grow = {
        b: (seg[b] if name == "independent" else int(1.03 * need[b]) if i == 0 else 8192 * b)
        for i, b in enumerate(order)
    }
    held = sum(grow.values())
    recs = [_captured(b, grow[b], MiB // 2, 4096, 32 * MiB if i == 0 else 0) for i, b in enumerate(order)]
    per_key = [{"key": f"d{b}", "bucket": b, "graph_mem_bytes": need[b], "capture_s": 0.01} for b in order]
    raw = {
        "strategy": name,
        "mode": "full",
        "per_key": per_key,
        "records": recs,
        "shuffled": [],
        "errors": [],
        "measured": {"graph_pool_bytes": held, "physical_bytes": held},
        "warnings": [],
        "kv_bytes_per_token": 114_688,
        "after_release_bytes": 0,
    }
    return derive(raw), None


def test_memreport_check_predicts_each_strategy_from_four_buckets(tmp_path, monkeypatch):
    import json

    import gmtool.memory.report as report
    from gmtool.app import run_memreport
    from gmtool.config import SweepConfig
    from gmtool.report.ledger import memreport_ledger_table, prediction_table

    seen = []
    monkeypatch.setattr(
        report,
        "run_strategy",
        lambda cfg, name, p=None, shared=None, **kw: (
            seen.append(len(cfg.bucket_sizes)) or _recorded_strategy(cfg, name)
        ),
    )
    cfg = SweepConfig(device="cpu", buckets="1,2,4,8:256:8", modes=("eager", "full"))
    out = tmp_path / "new" / "folder"  # made by run_memreport itself, as a library caller expects
    doc, paths = run_memreport(cfg, ["shared", "independent"], out, sample=4, check=True)
    assert seen == [4, 4, 35, 35]  # the sampled run of each strategy, then every bucket
    assert doc.sampled_buckets == [1, 72, 168, 256]
    pred = {p.strategy: p for p in doc.prediction}
    assert pred["shared"].first_bucket == pred["independent"].first_bucket == 256
    assert pred["shared"].measured_bytes == doc.strategies[0].physical_bytes
    for p in pred.values():
        assert abs(p.error_pct) < 5, p  # the goal, on these recorded figures
    assert pred["shared"].error_pct == pytest.approx(0.0, abs=1e-6)  # a straight line, and the first as measured
    saved = json.loads((out / "memreport.json").read_text())
    assert [p["strategy"] for p in saved["prediction"]] == ["shared", "independent"]
    assert saved["strategies"][0]["ledger"][0]["workspace_bytes"] is not None
    shared = saved["strategies"][0]
    assert shared["ledger_total_bytes"] == sum(r["total_bytes"] for r in shared["ledger"])
    assert shared["kv_tokens_given_up"] == pytest.approx(shared["ledger_total_bytes"] / 114_688, abs=35)
    text = _render(prediction_table(saved)) + _render(memreport_ledger_table(saved))
    assert "predicted from buckets 1, 72, 168, 256" in text and "shared" in text and "+0.0%" in text
    assert "cuBLAS ws" in text and "32.0 MiB" in text


def test_memreport_sample_alone_predicts_without_an_error(tmp_path, monkeypatch):
    import gmtool.memory.report as report
    from gmtool.app import run_memreport
    from gmtool.config import SweepConfig
    from gmtool.report.ledger import prediction_table

    monkeypatch.setattr(
        report, "run_strategy", lambda cfg, name, p=None, shared=None, **kw: _recorded_strategy(cfg, name)
    )
    cfg = SweepConfig(device="cpu", buckets="1,2,4,8:256:8", modes=("eager", "full"))
    doc, _ = run_memreport(cfg, ["independent"], tmp_path, sample=3)
    (p,) = doc.prediction
    assert p.measured_bytes is None and p.error_pct is None and p.predicted_bytes > 5 * p.sample_bytes
    assert len(doc.strategies[0].ledger) == 3 and "sampled buckets of 35" in doc.notes[-1]
    row = _render(prediction_table(doc.to_dict())).splitlines()[-2]  # no full capture: no measured, no error
    assert [c.strip() for c in row.split("│")[-3:-1]] == ["-", "-"]


def _render(table) -> str:
    from rich.console import Console

    c = Console(width=200, record=True)
    c.print(table)
    return c.export_text()


def test_memreport_sample_is_checked_before_anything_runs(tmp_path):
    from tests.test_compare import one_error, run_cli

    code, _, err = run_cli("memreport", "--device", "cpu", "--sample", "1", "--out", tmp_path / "m")
    assert code == 2 and "--sample needs at least 2 buckets" in one_error(err)
    code, _, err = run_cli("memreport", "--device", "cpu", "--check", "--out", tmp_path / "m")
    assert code == 2 and "memory strategies need CUDA" in one_error(err)  # no pools on the CPU tape
    assert not (tmp_path / "m").exists()


class _FakeDevice:
    """What torch.cuda reports around one capture: the allocator's reserved bytes grow by a whole virtual range
    while the driver's free memory drops by the physical growth plus the graph objects."""

    def __init__(self, monkeypatch, reserved_growth, free_drop, upload_drop):
        import torch

        self.reserved, self.free, self.phys = 100 * MiB, 1000 * MiB, 50 * MiB
        self.growth, self.drop, self.upload_drop = reserved_growth, free_drop, upload_drop
        self.free_readings = 0
        for name, fn in {
            "synchronize": lambda d=None: None,
            "reset_peak_memory_stats": lambda d=None: None,
            "memory_stats_as_nested_dict": lambda d=None: {
                "allocated_bytes": {"all": {"current": 0, "peak": 7 * MiB}},
                "reserved_bytes": {"all": {"current": self.reserved}},
            },
            "mem_get_info": self._free_and_total,
        }.items():
            monkeypatch.setattr(torch.cuda, name, fn)

    def _free_and_total(self, device=None):
        self.free_readings += 1
        return self.free, 2000 * MiB

    def capture(self, phys_growth):
        self.reserved += self.growth
        self.free -= self.drop
        self.phys += phys_growth

    def upload(self):
        self.free -= self.upload_drop


@pytest.mark.parametrize("physical", [False, True])
def test_outside_pool_is_the_free_drop_beyond_the_pool_growth(monkeypatch, physical):
    """VMM: a shape's range maps onto chunks other shapes already hold. Its reserved bytes grow by the range
    (22 MiB here) while the device gives only 2 MiB of new chunks: the pool growth is the physical one, and
    what lies outside the pool stays what the driver took beyond it (1 MiB instantiation + 1 MiB upload)."""
    import torch

    from gmtool.core.executor import CapturedGraph, _memory_of

    dev = _FakeDevice(monkeypatch, reserved_growth=22 * MiB, free_drop=3 * MiB, upload_drop=MiB)
    entry = CapturedGraph(None, None, "decode", [], None)
    held = (lambda: dev.phys) if physical else None
    with _memory_of(entry, torch.device("cuda"), upload=dev.upload, held=held):
        dev.capture(phys_growth=2 * MiB)
    assert entry.graph_mem_bytes == 7 * MiB
    if physical:
        assert (entry.pool_growth_bytes, entry.outside_pool_bytes) == (2 * MiB, 2 * MiB)
    else:  # the allocator's view: a pool that grew by more than the device gave shows as negative memory
        assert (entry.pool_growth_bytes, entry.outside_pool_bytes) == (22 * MiB, -18 * MiB)
    # the driver's free memory read before and after (capture and upload together): each reading costs ~1 ms
    assert dev.free_readings == 2


def test_what_an_upload_replay_reserves_through_torch_is_not_the_driver_s(monkeypatch):
    """A piecewise entry uploads by replaying, and its runners run: torch attention's gathers come from torch's
    allocator (reserved, 8 MiB here). Those are not the graph's driver bytes outside the pool."""
    import torch

    from gmtool.core.executor import CapturedGraph, _memory_of

    dev = _FakeDevice(monkeypatch, reserved_growth=4 * MiB, free_drop=5 * MiB, upload_drop=MiB)

    def replaying_upload():
        dev.upload()
        dev.reserved += 8 * MiB
        dev.free -= 8 * MiB

    entry = CapturedGraph(None, None, "decode", [], None)
    with _memory_of(entry, torch.device("cuda"), upload=replaying_upload):
        dev.capture(phys_growth=0)
    assert (entry.pool_growth_bytes, entry.outside_pool_bytes) == (4 * MiB, 2 * MiB)


def test_inputs_bytes_count_the_buffers_of_the_part_that_serves_the_key():
    """auto's mixed buckets are served by its piecewise part: their slice holds that part's q, attention-output
    and last-hidden buffers, as piecewise's own does; a full executor has no runner buffers at all."""
    from gmtool.core.inputs import StepViews
    from gmtool.memory.ledger import inputs_bytes
    from tests.helpers import Rig

    auto, piecewise = Rig(mode="auto"), Rig(mode="piecewise")
    batch = auto.batch("3+2")
    auto.graph(batch), piecewise.graph(piecewise.batch("3+2"))
    key = piecewise.ex.key_for(batch)
    assert auto.ex.key_for(batch) == key
    ex, t = piecewise.ex, key.num_tokens
    views = ex.inputs.views(key)
    fields = sum(getattr(views, f.name).nbytes for f in dataclasses.fields(StepViews))
    runners = ex.attn_q[:t].nbytes + ex.attn_out[:t].nbytes + ex.last_hidden[: views.logits.shape[0]].nbytes
    assert inputs_bytes(ex, key) == fields + runners
    assert inputs_bytes(auto.ex, key) == fields + runners
    assert Rig(mode="full").ex.attn_out is None
