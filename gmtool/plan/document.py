"""plan.json, plan.md, plan.png and the terminal table of a plan."""

from __future__ import annotations

import datetime as _dt
from pathlib import Path

from rich.markup import escape
from rich.table import Table

from gmtool.plan.engines import flags
from gmtool.plan.optimizer import Choice
from gmtool.report.markdown import md_text
from gmtool.report.tables import _f, fmt_bytes
from gmtool import json_text

PLAN_JSON, PLAN_MD, PLAN_PNG = "plan.json", "plan.md", "plan.png"


def _gain(plan: Choice, other: Choice) -> float:
    """How much faster per step the plan is than `other`, in percent of other's time."""
    return 100.0 * (other.total_ms - plan.total_ms) / other.total_ms if other.total_ms else 0.0


def build_document(res, inp, source: dict, model: dict, machine: dict) -> dict:
    p, b = res.plan, inp.budgets
    steps = inp.steps
    return {
        "schema_version": 1,
        "tool": "gmtool",
        "command": "plan",
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "model": model,
        "machine": machine,
        "source": source,
        "mode": inp.costs.mode,
        "workload": {
            "path": str(inp.workload_path),
            "steps": int(steps["count"].sum()),
            "shapes": len(steps),
            "sizes": int(steps["num_tokens"].nunique()),
            "largest_step": int(steps["num_tokens"].max()),
        },
        "budgets": {"memory_bytes": b.memory_bytes, "capture_s": b.capture_s, "max_graphs": b.max_graphs},
        "memory_sharing": str(inp.sharing),
        "capture_sizes": list(p.sizes),
        "extrapolated_sizes": res.extrapolated.get("plan", 0),  # of capture_sizes, beyond the measured buckets
        "num_graphs": len(p.sizes),
        "expected_ms_per_step": p.ms_per_step,
        "eager_ms_per_step": res.all_eager.ms_per_step,
        "graph_memory_bytes": p.graph_memory_bytes,
        "capture_s": p.capture_s,
        "eager_steps": p.eager_steps,
        "eager_extrapolated_steps": p.eager_extrapolated_steps,  # run eager at sizes beyond the measured eager rows
        "all_eager_extrapolated_steps": res.all_eager.eager_extrapolated_steps,
        "flags": flags(p.sizes),
        "lazy_capture": res.lazy,
        "defaults": [
            {
                "engine": d.name,
                "setting": d.setting,
                "padding": d.padding,
                "num_graphs": len(c.sizes),
                "expected_ms_per_step": c.ms_per_step,
                "graph_memory_bytes": c.graph_memory_bytes,
                "capture_s": c.capture_s,
                "eager_steps": c.eager_steps,
                "eager_extrapolated_steps": c.eager_extrapolated_steps,
                # against the plan as this engine would run it (decode-only graphs: its mixed steps eager too)
                "plan_gain_pct": _gain(res.plan_decode_only if d.decode_only else p, c),
                "plan_uses_less_memory": None
                if c.graph_memory_bytes is None or p.graph_memory_bytes is None
                else p.graph_memory_bytes <= c.graph_memory_bytes,
                "capture_sizes": list(c.sizes),
                "extrapolated_sizes": res.extrapolated.get(d.name, 0),
            }
            for d, c in res.defaults
        ],
        "curve": [
            {
                "capture_sizes": list(c.sizes),
                "expected_ms_per_step": c.ms_per_step,
                "graph_memory_bytes": c.graph_memory_bytes,
                "num_graphs": len(c.sizes),
            }
            for c in res.curve
        ],
        "candidates": [
            {"size": int(s), **{k: (None if v != v else v) for k, v in row.items()}}
            for s, row in res.costs.to_dict("index").items()
        ],
        "notes": res.notes,
    }


def _rows(doc: dict) -> list[dict]:
    plan = {
        "engine": "plan",
        "num_graphs": doc["num_graphs"],
        "expected_ms_per_step": doc["expected_ms_per_step"],
        "graph_memory_bytes": doc["graph_memory_bytes"],
        "capture_s": doc["capture_s"],
        "eager_steps": doc["eager_steps"],
        "plan_gain_pct": None,
        "extrapolated_sizes": doc.get("extrapolated_sizes", 0),
        "eager_extrapolated_steps": doc.get("eager_extrapolated_steps", 0),
    }
    eager = {
        "engine": "all eager",
        "num_graphs": 0,
        "expected_ms_per_step": doc["eager_ms_per_step"],
        "graph_memory_bytes": None if doc["graph_memory_bytes"] is None else 0,  # no memory measured: "-"
        "capture_s": 0.0,
        "eager_steps": doc["workload"]["steps"],
        "plan_gain_pct": 100.0 * (doc["eager_ms_per_step"] - doc["expected_ms_per_step"]) / doc["eager_ms_per_step"]
        if doc["eager_ms_per_step"]
        else None,
        "eager_extrapolated_steps": doc.get("all_eager_extrapolated_steps", 0),
    }
    # a gain against the plan is as much a guess as the plan's own figures
    guess = {"plan_extrapolated": _guessed(plan)}
    return [plan] + [r | guess for r in doc["defaults"]] + [eager | guess]


HEAD = ("capture list", "graphs", "ms / step", "plan faster by", "graph memory", "capture s", "eager steps")


EXTRAPOLATED_LEGEND = (
    "~: the row's figures are partly extrapolated beyond what was measured (graph sizes outside the measured "
    "buckets, or steps run eager at sizes outside the measured eager rows)"
)


def _guessed(r: dict) -> bool:
    """A list reaching past the measured buckets, or steps it runs eager past the measured eager sizes."""
    return bool(r.get("extrapolated_sizes") or r.get("eager_extrapolated_steps"))


def _cells(r: dict, steps: int) -> list[str]:
    guess = "~" if _guessed(r) else ""
    gain_guess = "~" if guess or r.get("plan_extrapolated") else ""  # the plan's, or this list's
    return [
        r["engine"],
        str(r["num_graphs"]),
        guess + _f(r["expected_ms_per_step"], ".4f"),
        "-" if r["plan_gain_pct"] is None else f"{gain_guess}{r['plan_gain_pct']:+.1f}%",
        fmt_bytes(r["graph_memory_bytes"]),
        _f(r["capture_s"], ".2f"),
        f"{100 * r['eager_steps'] / steps:.1f}%",
    ]


def _any_extrapolated(doc: dict) -> bool:
    return any(_guessed(r) for r in _rows(doc))


def plan_table(doc: dict) -> Table:
    w = doc["workload"]
    t = Table(
        title=escape(
            f"gmtool plan: {doc['model'].get('name')} ({doc['mode']} graphs), workload "
            f"{Path(w['path']).name} ({w['steps']} steps, {w['sizes']} sizes)"
        ),
        caption=EXTRAPOLATED_LEGEND if _any_extrapolated(doc) else None,
        caption_justify="left",
    )
    for c in HEAD:
        t.add_column(c, justify="left" if c == "capture list" else "right")
    for i, r in enumerate(_rows(doc)):
        cells = _cells(r, w["steps"])
        t.add_row(*([f"[bold]{cells[0]}[/]"] + cells[1:] if i == 0 else cells))
    return t


def render_markdown(doc: dict) -> str:
    w, b = doc["workload"], doc["budgets"]
    budgets = (
        ", ".join(
            f"{k} {v}"
            for k, v in (
                ("memory", fmt_bytes(b["memory_bytes"]) if b["memory_bytes"] else None),
                ("capture", f"{b['capture_s']} s" if b["capture_s"] else None),
                ("graphs", b["max_graphs"]),
            )
            if v
        )
        or "none"
    )
    lines = [
        f"# gmtool plan: {md_text(doc['model'].get('name'))}",
        "",
        f"Workload `{w['path']}`: {w['steps']} steps, {w['sizes']} distinct sizes, largest {w['largest_step']} "
        f"tokens. Costs: {doc['source'].get('kind')} ({doc['mode']} graphs). Budgets: {budgets}; memory "
        f"sharing: {doc['memory_sharing']}.",
        "",
        f"**Capture sizes** ({doc['num_graphs']}): `{', '.join(map(str, doc['capture_sizes']))}`",
        "",
        f"Expected {doc['expected_ms_per_step']:.4f} ms per step (all eager: {doc['eager_ms_per_step']:.4f} ms), "
        f"graph memory {fmt_bytes(doc['graph_memory_bytes'])}, capture {doc['capture_s']:.2f} s.",
        "",
        *lazy_line(doc.get("lazy_capture")),
        "## Plan against the engines' defaults",
        "",
        "| " + " | ".join(HEAD) + " |",
        "|" + "---|" * len(HEAD),
    ]
    lines += ["| " + " | ".join(_cells(r, w["steps"])) + " |" for r in _rows(doc)]
    if _any_extrapolated(doc):
        lines += ["", EXTRAPOLATED_LEGEND + "."]
    lines += ["", "## Flags", ""]
    for engine, forms in doc["flags"].items():
        for form, text in forms.items():
            lines += [f"{engine} ({form}):", "", "```", text, "```", ""]
    if doc["notes"]:
        lines += ["## Notes", ""] + [f"- {md_text(n)}" for n in doc["notes"]]
    return "\n".join(lines) + "\n"


def lazy_line(lazy: dict | None) -> list[str]:
    if not lazy or not lazy["captures"]:
        return []
    worst = max(lazy["first_hits"], key=lambda h: h["spike_ms"])
    never = (
        f"; {len(lazy['never_captured'])} sizes no step reaches are never captured" if lazy["never_captured"] else ""
    )
    return [
        f"Captured lazily (on the first miss, in the workload's order) instead: {lazy['captures']} captures "
        f"take {lazy['capture_s_in_serving']:.2f} s inside serving; the worst first-hit step takes "
        f"{worst['spike_ms']:.1f} ms (size {worst['size']}, step {worst['at_step']}){never}.",
        "",
    ]


def write_plot(path: Path, doc: dict) -> None:
    """Expected ms per step against graph memory (or graph count): the Pareto curve, the plan and defaults."""
    from matplotlib.figure import Figure

    by_memory = doc["graph_memory_bytes"] is not None
    x_of = (lambda r: r["graph_memory_bytes"] / 2**20) if by_memory else (lambda r: r["num_graphs"])
    fig = Figure(figsize=(7, 4.5))
    ax = fig.subplots()
    curve = sorted(doc["curve"], key=x_of)
    ax.step(
        [x_of(c) for c in curve],
        [c["expected_ms_per_step"] for c in curve],
        where="post",
        color="C0",
        label="best set under each budget",
    )
    ax.scatter([x_of(doc)], [doc["expected_ms_per_step"]], color="C3", zorder=3, label="plan")
    for i, d in enumerate(doc["defaults"]):
        ax.scatter([x_of(d)], [d["expected_ms_per_step"]], marker="x", color=f"C{(i + 4) % 10}", label=d["engine"])
    ax.set_xlabel("graph memory (MiB)" if by_memory else "graphs captured")
    ax.set_ylabel("expected ms per step")
    ax.set_title(f"{doc['model'].get('name')}: {Path(doc['workload']['path']).name}", fontsize=10)
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def write_plan(out: Path, doc: dict) -> list[Path]:
    out = Path(out)
    paths = [out / PLAN_JSON, out / PLAN_MD, out / PLAN_PNG]
    paths[0].write_text(json_text.dumps(doc, indent=2, default=str))
    paths[1].write_text(render_markdown(doc))
    write_plot(paths[2], doc)
    return paths
