"""The report's plots as PNG data URIs, so report.html stays one self-contained file.

matplotlib's Figure is used without pyplot: no global state and no GUI backend, whatever MPLBACKEND says.
"""

from __future__ import annotations

import base64
import io
import math

from matplotlib.figure import Figure

from gmtool.modes import GraphMode
from gmtool.report.summary import bucket_summary, mode_order, run_tp


# one colour per mode in every plot of a report, whichever modes a plot leaves out (the speedup plot has no eager)
# (in GraphMode's order, so a new mode gets the next colour without an edit here)
_PALETTE = (
    "#7f7f7f",
    "#1f77b4",
    "#d62728",
    "#2ca02c",
    "#ff7f0e",
    "#9467bd",
    "#8c564b",
    "#e377c2",
    "#17becf",
    "#bcbd22",
)
MODE_COLOURS = dict(zip(GraphMode, _PALETTE))


def _data_uri(fig: Figure) -> str:
    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=100, bbox_inches="tight")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode("ascii")


def _series(doc: dict, field: str, skip_eager: bool = False) -> dict[str, tuple[list, list]]:
    """mode -> (buckets, values) of one bucket_summary field; buckets without a value are left out. Under --tp
    the slowest rank's (the ranks meet at every all-reduce: a step takes as long as its slowest rank), not a
    median pooled over ranks that no rank measured."""
    rows = bucket_summary(doc["records"], by_rank=run_tp(doc.get("config")) > 1)
    out = {}
    for mode in mode_order(doc):
        if skip_eager and mode == GraphMode.EAGER:
            continue
        worst: dict[int, float] = {}
        pick = min if field == "speedup" else max  # the slowest rank's: its smallest speedup, else its largest
        for s in rows:
            if s["mode"] == mode and s[field] is not None:
                worst[s["bucket"]] = pick(worst.get(s["bucket"], s[field]), s[field])
        pts = sorted(worst.items())
        if pts:
            out[mode] = ([b for b, _ in pts], [v for _, v in pts])
    return out


def ticks(buckets: list[int], log: bool) -> list[int]:
    """The bucket labels an axis has room for: the engines' lists (1, 2, 4, 8, 16, 24, ..., 256) by their powers
    of two, and no two labels closer than 1/14 of the axis (auto's eager sizes sit just above the largest
    bucket: 512 and 520 printed over each other). The largest is always labelled."""
    base = buckets if len(buckets) <= 12 else sorted({b for b in buckets if b & (b - 1) == 0} | {buckets[-1]})
    pos = math.log2 if log else float
    gap = (pos(buckets[-1]) - pos(buckets[0])) / 14
    kept: list[int] = []
    for b in reversed(base):
        if all(abs(pos(b) - pos(k)) >= gap for k in kept):
            kept.append(b)
    return sorted(kept)


def figure(
    series: dict, title: str, ylabel: str, hline: float | None = None, eager_above: int | None = None
) -> Figure | None:
    """One line per mode (in MODE_COLOURS' colour) over the buckets; None when there is nothing to plot.
    eager_above: the largest graph bucket, where auto's eager sizes follow (a dotted line marks it)."""
    if not series:
        return None
    fig = Figure(figsize=(6.4, 3.6))
    ax = fig.add_subplot()
    buckets = sorted({b for xs, _ in series.values() for b in xs})
    for mode, (xs, ys) in series.items():
        ax.plot(xs, ys, marker="o", label=mode, color=MODE_COLOURS.get(mode, "black"))
    if hline is not None:
        ax.axhline(hline, color="grey", linewidth=0.8, linestyle="--")
    if eager_above is not None and buckets[-1] > eager_above:
        ax.axvline(eager_above, color="grey", linewidth=0.8, linestyle=":", label=f"auto: eager above {eager_above}")
    log = buckets[-1] / buckets[0] >= 8
    if log:  # bucket lists are roughly geometric: spread them evenly
        ax.set_xscale("log", base=2)
        ax.minorticks_off()
    ticks_ = ticks(buckets, log)
    ax.set_xticks(ticks_)
    ax.set_xticklabels([str(b) for b in ticks_])
    ax.set_xlabel("bucket (tokens)")
    ax.set_ylabel(ylabel)
    ax.set_title(title)
    ax.grid(True, alpha=0.3)
    ax.legend()
    return fig


def _eager_above(doc: dict) -> int | None:
    """The largest graph bucket when auto ran sizes above it eagerly (config.eager_sizes), else None."""
    eager = set((doc.get("config") or {}).get("eager_sizes") or ())
    graphs = {r["bucket"] for r in doc["records"]} - eager
    return max(graphs) if eager and graphs else None


def latency_figure(doc: dict) -> Figure | None:
    title = "median step latency per mode (UNSAFE buckets not plotted)"
    return figure(_series(doc, "replay_ms"), title, "ms", eager_above=_eager_above(doc))


def speedup_figure(doc: dict) -> Figure | None:
    series = _series(doc, "speedup", skip_eager=True)
    return figure(series, "speedup over eager", "eager / mode", hline=1.0, eager_above=_eager_above(doc))


def memory_figure(doc: dict) -> Figure | None:
    mib = {m: (xs, [v / 2**20 for v in ys]) for m, (xs, ys) in _series(doc, "graph_mem_bytes").items()}
    return figure(mib, "graph memory per capture (peak allocated while capturing)", "MiB")


def floor_figure(doc: dict) -> Figure | None:
    floors = [v for _, ys in _series(doc, "floor_ms").values() for v in ys]
    span = f" (floor {min(floors):.3g} to {max(floors):.3g} ms)" if floors else ""  # the ratio's denominator
    title = f"median latency / hardware floor{span}"
    return figure(_series(doc, "replay_over_floor"), title, "x floor", hline=1.0, eager_above=_eager_above(doc))


def all_figures(doc: dict) -> list[tuple[str, Figure | None]]:
    """(caption, figure or None when nothing was measured)."""
    return [
        ("Latency vs bucket", latency_figure(doc)),
        ("Speedup vs bucket", speedup_figure(doc)),
        ("Graph memory per mode", memory_figure(doc)),
        ("Distance to the floor", floor_figure(doc)),
    ]


def all_plots(doc: dict) -> list[tuple[str, str | None]]:
    """(caption, data URI or None when nothing was measured)."""
    return [(caption, None if fig is None else _data_uri(fig)) for caption, fig in all_figures(doc)]
