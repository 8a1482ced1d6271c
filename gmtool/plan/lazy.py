"""Lazy capture: a server that captures a size on its first miss instead of at start-up. Over the workload's
trace, each captured size that some step reaches is captured when the first such step arrives: that step pays
a warm-up forward (an eager step of the size), the capture and the replay (the first-hit spike), and the
captures together are the time spent capturing inside serving. Sizes no step reaches are never captured."""

from __future__ import annotations

import numpy as np
import pandas as pd


def lazy_capture(steps: pd.DataFrame, sizes, costs: pd.DataFrame, eager_ms: pd.Series) -> dict:
    """steps: the workload (num_tokens, count, and first_step: where the shape first appears in the trace; the
    size order without it); sizes: the captured sizes; costs: per size graph_ms, capture_s and source (how its
    figures were obtained); eager_ms: eager latency per size."""
    sizes = sorted(int(s) for s in sizes)
    first = steps["first_step"] if "first_step" in steps else pd.Series(np.arange(len(steps)), index=steps.index)
    at = np.searchsorted(sizes, steps["num_tokens"].to_numpy())  # the smallest captured size that holds it
    hits: dict[int, int] = {}
    for i, pos in enumerate(at):
        if pos < len(sizes):
            s = sizes[pos]
            hits[s] = min(hits.get(s, np.iinfo(np.int64).max), int(first.iloc[i]))
    first_hits = []
    for s, step in sorted(hits.items(), key=lambda kv: kv[1]):
        c = costs.loc[s]
        spike = 1000.0 * c["capture_s"] + eager_ms.loc[s] + c["graph_ms"]
        first_hits.append(
            {
                "size": s,
                "at_step": step,
                "capture_s": float(c["capture_s"]),
                "spike_ms": float(spike),
                "source": str(c["source"]),
            }
        )
    return {
        "captures": len(first_hits),
        "capture_s_in_serving": float(sum(h["capture_s"] for h in first_hits)),
        "max_spike_ms": max((h["spike_ms"] for h in first_hits), default=None),
        "never_captured": [s for s in sizes if s not in hits],
        "first_hits": first_hits,
    }
