"""Per-bucket costs a plan is chosen from: replay latency, graph memory and capture time per captured size, and
eager latency per step size, read from a results document (a compare or capture run).

A size the run did not measure is estimated linearly between its measured neighbours ("interpolated") or
above the range along the least-squares line of all measured sizes, never falling away from the largest
measured value, and below it as the smallest measured size ("extrapolated"); every estimate is
labelled so the plan can say which figures it measured and which it guessed. Latency of a replay grows about
linearly with the batch in the range where graphs pay off (weights are read once per step, activations grow
with the batch), which is what makes a straight line a fair estimate between measured buckets.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import StrEnum

import numpy as np
import pandas as pd

from gmtool.errors import GmtoolError
from gmtool.modes import GraphMode
from gmtool.records import Status


class Source(StrEnum):
    MEASURED = "measured"
    INTERPOLATED = "interpolated"
    EXTRAPOLATED = "extrapolated"


def estimate(known: pd.Series, at) -> tuple[np.ndarray, list[Source]]:
    """known (index: size, values) at the sizes `at`: measured where known, else linear in size."""
    known = known.dropna().sort_index()
    at = np.asarray(at, dtype=float)
    if known.empty:
        return np.full(len(at), np.nan), [Source.EXTRAPOLATED] * len(at)
    x, y = known.index.to_numpy(dtype=float), known.to_numpy(dtype=float)
    vals = np.interp(at, x, y)
    if len(x) > 1:  # beyond the range: the least-squares line through every measured point, one noisy
        slope, icpt = np.polyfit(x, y, 1)  # pair of neighbours cannot tilt it; never falling away from the ends
        lo, hi = at < x[0], at > x[-1]
        vals[lo] = y[0]  # below the smallest measured size the line reached 0 ms (free steps, a division by 0)
        vals[hi] = np.maximum(y[-1], y[-1] + slope * (at[hi] - x[-1]))
    measured = set(x)
    how = [
        Source.MEASURED if a in measured else Source.INTERPOLATED if x[0] < a < x[-1] else Source.EXTRAPOLATED
        for a in at
    ]
    return vals, how


@dataclass
class CostTable:
    """graph: one row per measured bucket (graph_ms, pool_bytes, overhead_bytes, capture_s); eager: ms per
    step size (num_tokens). pool_bytes is NaN where the backend measures no memory (the CPU tape)."""

    mode: str
    graph: pd.DataFrame
    eager: pd.Series
    notes: list[str] = field(default_factory=list)
    failed: list[int] = field(default_factory=list)  # buckets some replay of was not ok: never a capture size

    @property
    def buckets(self) -> list[int]:
        return [int(b) for b in self.graph.index]

    def graph_at(self, sizes) -> pd.DataFrame:
        """Costs at any sizes; `source` says how the latency was obtained."""
        sizes = sorted({int(s) for s in sizes})
        out = pd.DataFrame(index=pd.Index(sizes, name="size"))
        for col in ("graph_ms", "pool_bytes", "overhead_bytes", "capture_s"):
            out[col], how = estimate(self.graph[col], sizes)
            if col == "graph_ms":
                out["source"] = [str(h) for h in how]
        return out

    def eager_at(self, sizes) -> pd.Series:
        vals, _ = estimate(self.eager, sizes)
        return pd.Series(vals, index=pd.Index(sizes, name="num_tokens"))

    def eager_estimated(self, sizes) -> int:
        return sum(h is not Source.MEASURED for h in estimate(self.eager, sizes)[1])

    def eager_extrapolated(self, sizes) -> list[int]:
        """The sizes whose eager latency lies outside the measured eager sizes: a guess, marked ~ in a plan."""
        return [int(s) for s, h in zip(sizes, estimate(self.eager, sizes)[1]) if h is Source.EXTRAPOLATED]


PLANNED = (GraphMode.FULL, GraphMode.PIECEWISE)  # the graph modes a plan costs (auto is both, batch by batch)


def _graph_mode(df: pd.DataFrame, mode: str | None) -> str:
    present = [m for m in dict.fromkeys(df["mode"]) if m in {g.value for g in GraphMode if g.captures}]
    if mode is not None:
        if mode not in present:
            raise GmtoolError(f"the results have no {mode} rows (graph modes there: {', '.join(present) or 'none'})")
        return mode
    plannable = [m for m in present if m in PLANNED]
    if not plannable:
        raise GmtoolError(
            f"the results have no full or piecewise rows (graph modes there: {', '.join(present) or 'none'}): "
            "run compare or capture with full or piecewise"
        )
    return GraphMode.FULL if GraphMode.FULL in plannable else plannable[0]


def _flat(records: list[dict]) -> pd.DataFrame:
    """One row per record of a results document's plain form; timings become latency_ms_median, ..."""
    return pd.DataFrame(
        [
            {
                **{k: v for k, v in r.items() if not isinstance(v, dict)},
                **{f"{k}_{sk}": sv for k, v in r.items() if isinstance(v, dict) for sk, sv in v.items()},
            }
            for r in records
        ]
    )


def from_results(doc: dict, mode: str | None = None) -> CostTable:
    """The cost table of one graph mode of a results document. A bucket with any row that is not ok (UNSAFE,
    error, out of memory) is no candidate: a plan only captures sizes that replayed correctly."""
    df = _flat(doc["records"])
    if df.empty:
        raise GmtoolError("the results hold no records")
    asked, mode = mode, _graph_mode(df, mode)
    rows = df[df["mode"] == mode]
    eager_sizes = set((doc.get("config") or {}).get("eager_sizes") or ())
    rows = rows[~rows["bucket"].isin(eager_sizes)]  # auto's eager mixes: no graph of this mode, by design
    notes = []
    others = [m for m in PLANNED if m != mode and (df["mode"] == m).any()]
    if asked is None and others:
        notes.append(f"the results hold {mode} and {others[0]} rows: the plan costs {mode} (--mode picks another)")
    bad = rows.loc[rows["status"] != Status.OK, "bucket"].unique()
    if len(bad):
        notes.append(f"{mode} buckets {', '.join(map(str, sorted(bad)))} left out: some replay there was not ok")
    rows = rows[~rows["bucket"].isin(bad)]
    if rows.empty:
        other = [m for m in PLANNED if m != mode and ((df["mode"] == m) & (df["status"] == Status.OK)).any()]
        raise GmtoolError(
            f"no {mode} bucket replayed correctly in the results"
            + (f": plan --mode {other[0]} costs the {other[0]} rows, which did" if other else "")
        )
    for col in ("graph_mem_bytes", "capture_s", "outside_pool_bytes", "latency_ms_median"):
        if col not in rows:
            rows = rows.assign(**{col: np.nan})
    g = rows.groupby("bucket").agg(
        graph_ms=("latency_ms_median", "median"),
        pool_bytes=("graph_mem_bytes", "max"),
        overhead_bytes=("outside_pool_bytes", "max"),
    )
    if "key" in rows and (keys := rows.groupby("bucket")["key"].nunique()).max() > 1:
        # full prefill graphs are keyed by tokens x sequences: a size stands for every key measured in its bucket
        notes.append(
            f"{mode} buckets hold up to {int(keys.max())} graphs each (keyed by tokens and sequences): a capture size "
            "stands for all its bucket's measured graphs, their capture time summed and the largest one's memory; "
            "the graph counts count sizes"
        )
    # --tp: each rank captures its own graphs at the same time: a bucket costs its slowest rank's, not their sum
    rank = rows["rank"].fillna(0) if "rank" in rows else 0
    g["capture_s"] = rows.assign(rank=rank).groupby(["bucket", "rank"])["capture_s"].sum().groupby("bucket").max()
    g.index = g.index.astype(int)
    untimed = g.index[g["graph_ms"].isna()]
    if len(untimed):  # ok rows without a latency (a run with --num-iters 0, or a file edited): said, then estimated
        notes.append(
            f"{mode} buckets {', '.join(map(str, untimed))} have no latency in the results: their step time is "
            "estimated from the other buckets"
        )
    if g["overhead_bytes"].isna().all():
        g["overhead_bytes"] = 0.0
    g = g.astype(float)
    if "latency_ms_median" not in df:
        df = df.assign(latency_ms_median=np.nan)
    eager = df[(df["mode"] == GraphMode.EAGER) & (df["status"] == Status.OK) & df["latency_ms_median"].notna()]
    if eager.empty:
        some = (df["mode"] == GraphMode.EAGER).any()  # there, but none ok: not "absent"
        raise GmtoolError(
            ("no eager row of the results is ok and timed" if some else "the results have no eager rows")
            + ": steps above the largest graph run eager, so the plan needs them (run compare with eager among "
            "the modes)"
        )
    e = eager.groupby("num_tokens")["latency_ms_median"].median()
    e.index = e.index.astype(int)
    return CostTable(str(mode), g, e.astype(float), notes, sorted(int(b) for b in bad))
