"""The graph memory ledger: what each captured bucket costs the device, and what that means for the KV cache.

Per bucket x mode x strategy:
- pool_bytes: the allocator pool the capture needed (graph_mem_bytes: its peak allocation);
- outside_pool_bytes: device memory the capture took beyond the pool's growth (graph instantiation, exec
  objects), from the driver's free-memory delta (torch.cuda.mem_get_info) around the capture;
- inputs_bytes: the bucket's slice of the persistent input buffers;
- workspace_bytes: the cuBLAS workspace of the capture stream (one per run: charged to the first bucket);
- total_bytes, and kv_tokens_given_up = total / the model's KV bytes per token.

The predictor captures a few buckets and fits graph memory per strategy as a line in bucket size (least
squares), then predicts every bucket of the set; `check_prediction` compares it with a full capture.
"""
from __future__ import annotations

import os

import numpy as np
import pandas as pd

from gmtool.errors import GmtoolError

PARTS = ("pool_bytes", "outside_pool_bytes", "inputs_bytes", "workspace_bytes")


def kv_bytes_per_token(model: dict, dtype_bytes: int) -> int:
    """K and V of every layer for one token (model: results.json's model section)."""
    return 2 * model["layers"] * model["kv_heads"] * model["head_dim"] * dtype_bytes


def cublas_workspace_bytes(capability: tuple[int, int] | None) -> int:
    """The workspace cuBLAS keeps per stream handle, as torch sizes it: CUBLAS_WORKSPACE_CONFIG (":SIZE_KiB:COUNT"
    pairs) when set, else torch's default (4096 KiB x 8 on Hopper and newer, 4096 KiB x 2 + 16 KiB x 8 before)."""
    text = os.environ.get("CUBLAS_WORKSPACE_CONFIG")
    if text:
        nums = [int(x) for x in text.split(":") if x.strip()]
        if len(nums) % 2:
            raise GmtoolError(f"CUBLAS_WORKSPACE_CONFIG {text!r} is not ':KiB:count' pairs")
        return sum(a * b * 1024 for a, b in zip(nums[::2], nums[1::2]))
    if capability is not None and capability[0] >= 9:
        return 4096 * 1024 * 8
    return 4096 * 1024 * 2 + 16 * 1024 * 8


def ledger(rows: pd.DataFrame, kv_per_token: int | None) -> pd.DataFrame:
    """rows: bucket, mode, strategy and any of PARTS (missing parts count as unknown, not zero). Adds
    total_bytes (the known parts) and kv_tokens_given_up."""
    df = rows.copy()
    for p in PARTS:
        if p not in df:
            df[p] = np.nan
    df["total_bytes"] = df[list(PARTS)].sum(axis=1, min_count=1)
    df["kv_tokens_given_up"] = df["total_bytes"] / kv_per_token if kv_per_token else np.nan
    return df


def ledger_from_records(records: list[dict], model: dict, dtype_bytes: int, strategy: str = "shared",
                        workspace_bytes: int | None = None) -> pd.DataFrame:
    """The ledger of a sweep's captured rows (those carrying graph_mem_bytes: the capture of their bucket)."""
    df = pd.DataFrame([r for r in records if r.get("graph_mem_bytes") is not None])
    if df.empty:
        return ledger(pd.DataFrame(columns=["bucket", "mode", "strategy"]), None)
    out = pd.DataFrame({"bucket": df["bucket"], "mode": df["mode"], "strategy": strategy,
                        "pool_bytes": df["graph_mem_bytes"],
                        "outside_pool_bytes": df.get("outside_pool_bytes", np.nan),
                        "inputs_bytes": df.get("inputs_bytes", np.nan)})
    out = out.sort_values(["mode", "bucket"]).reset_index(drop=True)
    out["workspace_bytes"] = 0.0
    if workspace_bytes:
        out.loc[out.groupby("mode").head(1).index, "workspace_bytes"] = workspace_bytes
    return ledger(out, kv_bytes_per_token(model, dtype_bytes))


# -- the predictor -------------------------------------------------------------------------------------------
def fit(sampled: pd.DataFrame, value: str = "pool_bytes") -> pd.DataFrame:
    """Per strategy: slope and intercept of value against bucket size (least squares over the sampled buckets;
    one sample gives a flat line)."""
    out = []
    for strategy, g in sampled.dropna(subset=[value]).groupby("strategy"):
        x, y = g["bucket"].to_numpy(float), g[value].to_numpy(float)
        slope, icpt = np.polyfit(x, y, 1) if len(set(x)) > 1 else (0.0, float(y.mean()))
        out.append({"strategy": strategy, "slope": float(slope), "intercept": float(icpt), "samples": len(g)})
    if not out:
        raise GmtoolError(f"no sampled bucket has {value}: nothing to fit")
    return pd.DataFrame(out).set_index("strategy")


def predict(fitted: pd.DataFrame, buckets, sharing: dict[str, str] | None = None) -> pd.DataFrame:
    """Per strategy: each bucket's predicted memory, and the set's total (max over buckets for a shared pool,
    the sum otherwise; sharing maps strategy -> "max" | "sum", default "sum" except "shared" and "vmm")."""
    buckets = np.asarray(sorted(buckets), float)
    rows = []
    for strategy, f in fitted.iterrows():
        per = np.maximum(0.0, f["slope"] * buckets + f["intercept"])
        how = (sharing or {}).get(strategy, "max" if strategy in ("shared", "vmm") else "sum")
        rows.append({"strategy": strategy, "combine": how, "predicted_bytes": float(per.max() if how == "max" else per.sum()),
                     "per_bucket": dict(zip(buckets.astype(int).tolist(), per.tolist()))})
    return pd.DataFrame(rows).set_index("strategy")


def check_prediction(predicted: pd.DataFrame, measured: dict[str, float]) -> pd.DataFrame:
    """Prediction error per strategy against the measured total of a full capture."""
    df = predicted[["predicted_bytes"]].copy()
    df["measured_bytes"] = pd.Series(measured, dtype=float)
    df["error_pct"] = 100.0 * (df["predicted_bytes"] - df["measured_bytes"]) / df["measured_bytes"]
    return df
