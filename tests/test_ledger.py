"""The graph memory ledger's arithmetic on the CPU: parts and totals, KV tokens given up, the cuBLAS workspace,
the per-strategy fit, its prediction and the prediction error."""
from __future__ import annotations

import pandas as pd
import pytest

from gmtool.errors import GmtoolError
from gmtool.memory.ledger import (check_prediction, cublas_workspace_bytes, fit, kv_bytes_per_token, ledger,
                                  ledger_from_records, predict)

QWEN3_06B = {"layers": 28, "kv_heads": 8, "head_dim": 128}
MiB = 2**20


def test_kv_bytes_per_token():
    assert kv_bytes_per_token(QWEN3_06B, 2) == 2 * 28 * 8 * 128 * 2 == 114_688


def test_ledger_totals_and_kv_tokens_given_up():
    rows = pd.DataFrame({"bucket": [8, 16], "mode": "full", "strategy": "shared", "pool_bytes": [10 * MiB, 20 * MiB],
                         "outside_pool_bytes": [2 * MiB, None], "inputs_bytes": [1024, 2048],
                         "workspace_bytes": [32 * MiB, 0]})
    df = ledger(rows, 114_688)
    assert df["total_bytes"].tolist() == [44 * MiB + 1024, 20 * MiB + 2048]  # an unknown part adds nothing
    assert df["kv_tokens_given_up"].tolist() == pytest.approx([(44 * MiB + 1024) / 114_688, (20 * MiB + 2048) / 114_688])


def test_ledger_from_records_charges_the_workspace_once_per_mode():
    recs = [{"bucket": b, "mode": "full", "graph_mem_bytes": b * MiB, "outside_pool_bytes": MiB} for b in (4, 2)]
    recs.append({"bucket": 2, "mode": "full", "graph_mem_bytes": None})  # a replay of a captured bucket
    df = ledger_from_records(recs, QWEN3_06B, 2, workspace_bytes=32 * MiB)
    assert df["bucket"].tolist() == [2, 4]
    assert df["workspace_bytes"].tolist() == [32 * MiB, 0]
    assert df["total_bytes"].tolist() == [35 * MiB, 5 * MiB]


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
    # recorded shape: pool = 1 MiB + 0.5 MiB per token (shared pool: the total is the largest)
    sampled = pd.DataFrame({"strategy": ["shared"] * 3 + ["independent"] * 2, "bucket": [1, 64, 256, 1, 256],
                            "pool_bytes": [1.5 * MiB, 33 * MiB, 129 * MiB, 1.5 * MiB, 129 * MiB]})
    f = fit(sampled)
    assert f.loc["shared", "slope"] == pytest.approx(0.5 * MiB) and f.loc["shared", "intercept"] == pytest.approx(MiB)
    buckets = [1, 2, 4] + list(range(8, 257, 8))
    pred = predict(f, buckets)
    assert pred.loc["shared", "predicted_bytes"] == pytest.approx(129 * MiB)  # max over buckets
    assert pred.loc["independent", "predicted_bytes"] == pytest.approx(sum(MiB + 0.5 * MiB * b for b in buckets))
    err = check_prediction(pred, {"shared": 120 * MiB, "independent": pred.loc["independent", "predicted_bytes"]})
    assert err.loc["shared", "error_pct"] == pytest.approx(100 * 9 / 120)
    assert err.loc["independent", "error_pct"] == pytest.approx(0.0)


def test_fit_needs_a_measured_bucket():
    with pytest.raises(GmtoolError, match="nothing to fit"):
        fit(pd.DataFrame({"strategy": ["shared"], "bucket": [1], "pool_bytes": [None]}))
