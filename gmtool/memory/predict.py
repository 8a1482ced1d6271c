"""memreport's predictor: a run over a few sampled buckets in, each strategy's memory for the whole bucket list
out, and with --check its error against a run over every bucket (the arithmetic: gmtool.memory.ledger).

What is predicted is the memory a strategy holds for its graphs (StrategyRow.physical_bytes: the pools'
segments, or VMM's physical chunks). Each bucket's need (the capture's peak allocation, which is the same
under every strategy) is fitted as a line in bucket size; a shared pool or VMM holds the largest need, separate
pools the sum; the sample's held/need ratio carries the allocator's rounding over to the whole list.
"""
from __future__ import annotations

import dataclasses

import pandas as pd

from gmtool.errors import GmtoolError
from gmtool.memory.document import MemDocument, Prediction
from gmtool.memory.ledger import check_prediction, fit, predict, sample_buckets

DEFAULT_SAMPLE = 4  # smallest, largest and two between: a line needs two, the rest check it


def sampled_config(cfg, k: int | None):
    """The config with only k of its buckets (compositions given for other buckets are refused by it)."""
    chosen = sample_buckets(cfg.bucket_sizes, k or DEFAULT_SAMPLE)
    return dataclasses.replace(cfg, buckets=",".join(map(str, chosen)))


def predict_document(sampled: MemDocument, buckets: list[int]) -> list[Prediction]:
    """Per strategy measured on the sample: its predicted memory over `buckets`."""
    needs = pd.DataFrame([{"strategy": r.strategy, "bucket": k["bucket"], "pool_bytes": k.get("graph_mem_bytes")}
                          for r in sampled.strategies if r.status == "ok" for k in r.per_key],
                         columns=["strategy", "bucket", "pool_bytes"])
    if needs["pool_bytes"].isna().all():
        raise GmtoolError("no strategy captured a sampled bucket cleanly: nothing to predict from")
    fitted = fit(needs)
    held = {r.strategy: (sorted({k["bucket"] for k in r.per_key}), r.physical_bytes) for r in sampled.strategies}
    pred = predict(fitted, buckets, sampled=held)
    return [Prediction(strategy=s, combine=pred.at[s, "combine"], sample_bytes=held[s][1],
                       scale=float(pred.at[s, "scale"]), predicted_bytes=float(pred.at[s, "predicted_bytes"]))
            for s in held if s in pred.index]


def check_document(predicted: list[Prediction], full: MemDocument) -> list[Prediction]:
    """The predictions with the memory each strategy held over every bucket, and the error in percent."""
    if not predicted:
        return []
    measured = {r.strategy: r.physical_bytes for r in full.strategies if r.physical_bytes is not None}
    df = check_prediction(pd.DataFrame([dataclasses.asdict(p) for p in predicted]).set_index("strategy"), measured)
    out = []
    for p in predicted:
        m, e = df.loc[p.strategy, "measured_bytes"], df.loc[p.strategy, "error_pct"]
        out.append(dataclasses.replace(p, measured_bytes=None if m != m else float(m),
                                       error_pct=None if e != e else float(e)))
    return out
