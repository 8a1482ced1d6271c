"""The graph memory ledger: what each captured bucket costs the device, and what that means for the KV cache.

Per bucket x mode x strategy:
- pool_bytes: the allocator pool memory the capture added (pool_growth_bytes; under VMM the physical memory it
  added), so that a strategy's buckets add up to what it holds;
- outside_pool_bytes: device memory the capture took beyond the pool's growth (graph instantiation, exec
  objects), from the driver's free-memory delta (torch.cuda.mem_get_info) around the capture and instantiation,
  plus the delta around the graph's first launch (its upload); None on the CPU tape, which has no pool;
- inputs_bytes: the bucket's slice of the persistent input buffers;
- workspace_bytes: the cuBLAS workspace of the capture stream (one per run: charged to the first bucket);
- total_bytes, and kv_tokens_given_up = total / the model's KV bytes per token.

In a sweep (compare, capture) the mode's graphs share one pool, captured largest first: the first bucket's
pool_bytes is most of it, the later ones add what they could not reuse.

The predictor captures a few buckets under each strategy: the first capture's pool is taken as measured, what
each later capture added is fitted as a line in bucket size (least squares) and summed over the rest of the
list; `check_prediction` compares the prediction with a capture of every bucket.
"""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pandas as pd
import torch

from gmtool.core.inputs import StepViews
from gmtool.errors import GmtoolError

PARTS = ("pool_bytes", "outside_pool_bytes", "inputs_bytes", "workspace_bytes")


def kv_bytes_per_token(model: dict, dtype_bytes: int) -> int:
    """K and V of every layer for one token (model: results.json's model section, which also records it as
    kv_bytes_per_token from the run's KV cache)."""
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
    total_bytes (the known parts; unknown without the pool, which is most of it) and kv_tokens_given_up."""
    df = rows.copy()
    for p in PARTS:
        if p not in df:
            df[p] = np.nan
    df[list(PARTS)] = df[list(PARTS)].astype(float)
    df["total_bytes"] = df[list(PARTS)].sum(axis=1, min_count=1).where(df["pool_bytes"].notna())
    df["kv_tokens_given_up"] = df["total_bytes"] / kv_per_token if kv_per_token else np.nan
    return df


def inputs_bytes(ex, key) -> int:
    """The bucket's slice of the executor's persistent input buffers (and, piecewise, of the runners' shared q
    and output buffers and the last hidden rows the pieces hand on): what separate buffers per shape would cost.
    auto: the buffers of the part whose graph serves key."""
    from gmtool.core.auto import parts_of

    owner = next((p for p in parts_of(ex) if key in p.graphs), ex)
    views = owner.inputs.views(key)
    n = sum(getattr(views, f.name).nbytes for f in dataclasses.fields(StepViews))
    return n + sum(b.nbytes for b in owner.runner_buffers(key))


def capture_ledger(ex, entry) -> dict:
    """The ledger fields of the record whose batch captured `entry` (gmtool.records.Record). The cuBLAS
    workspace belongs to the executor's capture stream, made by its first warm-up: charged to its first graph."""
    cuda = ex.device.type == "cuda"
    first = len(ex.graphs) == 1
    parts = {
        "pool_bytes": entry.pool_growth_bytes,
        "outside_pool_bytes": entry.outside_pool_bytes,
        "inputs_bytes": inputs_bytes(ex, entry.key),
        "workspace_bytes": (cublas_workspace_bytes(torch.cuda.get_device_capability(ex.device)) if first else 0)
        if cuda
        else None,
    }
    row = ledger(pd.DataFrame([parts]), ex.cache.spec.bytes_per_token).iloc[0]
    return {
        "inputs_bytes": parts["inputs_bytes"],
        "workspace_bytes": parts["workspace_bytes"],
        "ledger_total_bytes": _int(row["total_bytes"]),
        "kv_tokens_given_up": _int(row["kv_tokens_given_up"]),
    }


def _int(x) -> int | None:
    return None if x is None or x != x else int(round(x))


LEDGER_COLUMNS = ("bucket", "key", "mode", "strategy") + PARTS + ("total_bytes", "kv_tokens_given_up")


def ledger_from_records(records: list[dict], strategy: str = "shared") -> pd.DataFrame:
    """The ledger of a sweep's captured rows (those carrying capture_s: the capture of their bucket), read
    from the fields the sweep set on them (gmtool.records.Record)."""
    rows = [r for r in records if r.get("capture_s") is not None and r["mode"] != "hf-compiled"]
    df = pd.DataFrame(
        {
            "bucket": [r["bucket"] for r in rows],
            "key": [r.get("key") for r in rows],
            "mode": [str(r["mode"]) for r in rows],
            "strategy": strategy,
            "pool_bytes": [r.get("pool_growth_bytes") for r in rows],
            "outside_pool_bytes": [r.get("outside_pool_bytes") for r in rows],
            "inputs_bytes": [r.get("inputs_bytes") for r in rows],
            "workspace_bytes": [r.get("workspace_bytes") for r in rows],
            "total_bytes": [r.get("ledger_total_bytes") for r in rows],
            "kv_tokens_given_up": [r.get("kv_tokens_given_up") for r in rows],
        },
        columns=LEDGER_COLUMNS,
    )
    df = df.astype({c: float for c in LEDGER_COLUMNS[4:]})
    df["rank"] = [int(r.get("rank") or 0) for r in rows]  # --tp: each rank captured its own graphs
    return df.sort_values(["mode", "bucket", "rank"], kind="stable").reset_index(drop=True)


def strategy_ledger(strategy: str, records: list[dict], per_key: list[dict], kv_per_token: int | None) -> pd.DataFrame:
    """memreport: one strategy's ledger. A VMM strategy's pools are virtual ranges over one physical set: the
    pool a bucket cost is the physical memory its capture added (captures in the order they ran)."""
    df = ledger_from_records(records, strategy)
    phys = [(k["key"], k["physical_after_bytes"]) for k in per_key if k.get("physical_after_bytes") is not None]
    if not phys or df.empty:
        return df
    growth = dict(zip([k for k, _ in phys], np.diff([0] + [p for _, p in phys])))
    df["pool_bytes"] = df["key"].map(growth).astype(float)
    return ledger(df.drop(columns=["total_bytes", "kv_tokens_given_up"]), kv_per_token)


# -- the predictor -------------------------------------------------------------------------------------------
def fit(sampled: pd.DataFrame, value: str = "pool_bytes") -> pd.DataFrame:
    """Per strategy: slope and intercept of value against bucket size (least squares over the sampled buckets;
    one sample gives a flat line)."""
    out = []
    for strategy, g in sampled.dropna(subset=[value]).groupby("strategy", sort=False):
        x, y = g["bucket"].to_numpy(float), g[value].to_numpy(float)
        slope, icpt = np.polyfit(x, y, 1) if len(set(x)) > 1 else (0.0, float(y.mean()))
        out.append({"strategy": strategy, "slope": float(slope), "intercept": float(icpt), "samples": len(g)})
    if not out:
        raise GmtoolError(f"no sampled bucket has {value}: nothing to fit")
    return pd.DataFrame(out).set_index("strategy")


def sample_buckets(buckets, k: int) -> list[int]:
    """k buckets of the list for the predictor: the smallest and the largest (one of them is captured first,
    whatever the order) and the rest evenly spaced between them by position."""
    buckets = sorted(set(buckets))
    if k < 2:
        raise GmtoolError(f"--sample needs at least 2 buckets (the smallest and the largest), got {k}")
    if k >= len(buckets):
        return buckets
    return sorted({buckets[round(i)] for i in np.linspace(0, len(buckets) - 1, k)})


def predict(sampled: pd.DataFrame, buckets, first: dict[str, int]) -> pd.DataFrame:
    """Each strategy's memory for the whole bucket list, from its sampled ledger (strategy, bucket, pool_bytes:
    what each capture added to the strategy's memory). first: the bucket each strategy captured first, the same
    in the sample and the whole list (the largest, or the smallest in ascending order): its pool is taken as
    measured, and every other bucket adds what the line through the other sampled buckets' additions says.
    A shared pool's line is near zero (later graphs reuse the first one's blocks); separate pools' is each
    bucket's own pool."""
    rows = []
    for strategy, g in sampled.dropna(subset=["pool_bytes"]).groupby("strategy", sort=False):
        at = g["bucket"] == first[strategy]
        if not at.any():
            raise GmtoolError(f"{strategy}: the bucket captured first ({first[strategy]}) was not sampled")
        head = float(g.loc[at, "pool_bytes"].iloc[0])
        rest = g[~at]
        f = fit(rest).iloc[0] if len(rest) else pd.Series({"slope": 0.0, "intercept": 0.0})
        others = np.asarray([b for b in buckets if b != first[strategy]], float)
        per = np.maximum(0.0, f["slope"] * others + f["intercept"])
        rows.append(
            {
                "strategy": strategy,
                "first_bucket": first[strategy],
                "first_bytes": head,
                "slope": float(f["slope"]),
                "intercept": float(f["intercept"]),
                "sample_bytes": float(g["pool_bytes"].sum()),
                "predicted_bytes": head + float(per.sum()),
            }
        )
    return pd.DataFrame(
        rows,
        columns=["strategy", "first_bucket", "first_bytes", "slope", "intercept", "sample_bytes", "predicted_bytes"],
    ).set_index("strategy")


def check_prediction(predicted: pd.DataFrame, measured: dict[str, float]) -> pd.DataFrame:
    """Prediction error per strategy against the measured total of a full capture."""
    df = predicted[["predicted_bytes"]].copy()
    df["measured_bytes"] = pd.Series(measured, dtype=float)
    df["error_pct"] = 100.0 * (df["predicted_bytes"] - df["measured_bytes"]) / df["measured_bytes"]
    return df
