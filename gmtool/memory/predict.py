"""memreport's predictor: a run over a few sampled buckets in, each strategy's memory for the whole bucket list
out, and with --check its error against a run over every bucket (the arithmetic: gmtool.memory.ledger.predict).

What is predicted is the memory a strategy holds for its graphs (StrategyRow.physical_bytes: the pools'
segments, or VMM's physical chunks). Two methods (Prediction.method):
- allocsim, where the sampled run recorded each capture's allocator events (StrategyRow.traces, CUDA): every
  bucket's events (the sampled ones as recorded, the others interpolated) run through a simulation of the
  caching allocator in the strategy's order and pools (gmtool.memory.allocsim); it models what a shared pool
  reuses and fragments (shared-ascending);
- line, otherwise and for VMM: the sum of the ledger's pool column, what each capture added in the order they
  ran: the first capture's as measured on the sample, each other bucket's from the line through the other
  sampled buckets' additions.
"""

from __future__ import annotations

import dataclasses

import pandas as pd

from gmtool.errors import GmtoolError
from gmtool.memory.document import MemDocument, Prediction
from gmtool.memory.ledger import check_prediction, predict, sample_buckets
from gmtool.records import Status

DEFAULT_SAMPLE = 4  # the first captured, and three for a line through the later ones' additions


def sampled_config(cfg, k: int | None):
    """The config with only k of its buckets (compositions given for other buckets are refused by it)."""
    chosen = sample_buckets(cfg.bucket_sizes, k or DEFAULT_SAMPLE)
    return dataclasses.replace(cfg, buckets=",".join(map(str, chosen)))


def predict_document(sampled: MemDocument, buckets: list[int]) -> list[Prediction]:
    """Per strategy measured on the sample: its predicted memory over `buckets`."""
    ok = [r for r in sampled.strategies if r.status == Status.OK and r.ledger and r.per_key]
    rows = pd.DataFrame(
        [{"strategy": r.strategy, "bucket": x["bucket"], "pool_bytes": x["pool_bytes"]} for r in ok for x in r.ledger],
        columns=["strategy", "bucket", "pool_bytes"],
    )
    if rows["pool_bytes"].isna().all():
        raise GmtoolError("no strategy captured the sampled buckets cleanly: nothing to predict from")
    pred = predict(rows, buckets, {r.strategy: r.per_key[0]["bucket"] for r in ok})  # per_key: capture order
    out = [
        Prediction(strategy=s, **{k: float(v) if k != "first_bucket" else int(v) for k, v in p.items()})
        for s, p in pred.iterrows()
    ]
    rows_by = {r.strategy: r for r in ok}
    return [_simulated(rows_by[p.strategy], p, buckets) for p in out]


def _simulated(row, line: Prediction, buckets) -> Prediction:
    """The allocator simulator's prediction where the row carries its sampled captures' traces and the simulator
    models the strategy's pools (not VMM's, whose line is exact: physical = max of the shapes' needs); else the
    line. A simulation that fails keeps the line, and says why."""
    from gmtool.memory import allocsim

    caps = (row.traces or {}).get("captures") or []
    if not caps or row.strategy not in allocsim.ORDERS:
        return line
    if unmodeled := allocsim.unmodeled_settings():
        return dataclasses.replace(line, notes=[f"allocator settings the simulator does not model ({unmodeled[0]})"])
    try:
        sim = allocsim.predict_strategy(row.strategy, caps, buckets, order=row.order)
    except (ValueError, KeyError, AssertionError) as e:
        return dataclasses.replace(line, notes=[f"allocator simulation failed ({e}): the line predicts"])
    return dataclasses.replace(
        line,
        first_bucket=sim.order[0],
        first_bytes=float(sim.per_bucket_pool_bytes[0]),
        slope=None,
        intercept=None,
        predicted_bytes=float(sim.total_bytes),
        method="allocsim",
        notes=sim.notes,
    )


def check_document(predicted: list[Prediction], full: MemDocument) -> list[Prediction]:
    """The predictions with the memory each strategy held over every bucket, and the error in percent."""
    if not predicted:
        return []
    measured = {r.strategy: r.physical_bytes for r in full.strategies if r.physical_bytes is not None}
    df = check_prediction(pd.DataFrame([dataclasses.asdict(p) for p in predicted]).set_index("strategy"), measured)
    out = []
    for p in predicted:
        m, e = df.loc[p.strategy, "measured_bytes"], df.loc[p.strategy, "error_pct"]
        out.append(
            dataclasses.replace(p, measured_bytes=None if m != m else float(m), error_pct=None if e != e else float(e))
        )
    return out
