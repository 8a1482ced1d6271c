"""memreport: the same sweep under each memory strategy, replays re-checked in shuffled order, memory compared.

A shape's need is the peak memory its capture allocated (graph_mem_bytes). The headline: the memory a
strategy holds for all shapes over max(shape) (the floor any sharing can reach) and over sum(shape) (no
sharing at all).
"""

from __future__ import annotations

import csv
import gc
import random
import statistics
from pathlib import Path

import torch

from gmtool.modes import GraphMode
from gmtool.measure.check import checked_replay
from gmtool.errors import GmtoolError, OutOfMemory
from gmtool.core.executor import AttentionRunner
from gmtool.memory.document import ROW_FIELDS, UNAVAILABLE, MemDocument, StrategyRow
from gmtool.memory.ledger import inputs_bytes, strategy_ledger
from gmtool.memory.allocsim import ORDERS as SIMULATED
from gmtool.memory.strategies import make_strategy
from gmtool.report.fitted import Column, FittedTable
from gmtool.report.tables import _f, fmt_bytes
from gmtool.records import Status, style_of
from gmtool.measure.sweep import Sweep, machine_info
from gmtool.measure.timing import tolerances_for

MEMREPORT_JSON, MEMREPORT_CSV, MEMREPORT_PNG = "memreport.json", "memreport.csv", "memreport.png"


class ShuffledReplayProbe:
    """Once every row is measured: replays every composition again in shuffled order (each graph right after
    graphs of other shapes, whose memory it may share), judged against eager, then meters the strategy."""

    def __init__(self, strategy, seed: int):
        self.strategy, self.seed = strategy, seed
        self.shuffled: list[dict] = []
        self.inputs: dict = {}
        self.measured: dict = {}

    def after_sweep(self, bench, executors, res) -> None:
        rng, cfg = random.Random(self.seed), bench.cfg
        tols = tolerances_for(cfg.torch_dtype)
        for mode, ex in executors.items():
            comps = [c for b in cfg.compositions_by_bucket for c in cfg.compositions_by_bucket[b]]
            rng.shuffle(comps)
            for i, comp in enumerate(comps):
                self.shuffled.append(_replay_checked(bench, ex, mode, comp, i, tols))
            self.inputs[mode] = input_costs(ex)
        self.measured = self.strategy.measure()
        self.strategy.check(held_storages(executors))


def _replay_checked(bench, ex, mode, comp, order, tols) -> dict:
    """One replay, right after graphs of other shapes ran, judged as the sweep judges (gmtool.measure.check)."""
    rec = {
        "mode": mode,
        "order": order,
        "composition": comp.label,
        "key": None,
        "status": Status.SKIPPED,
        "max_rel_err": None,
        "max_rel_err_same_shape": None,
        "error": None,
    }
    try:
        batch = bench.batch(comp)
        key = rec["key"] = str(ex.key_for(batch))
        if ex.key_for(batch) not in ex.graphs:  # never captured (an earlier failure): nothing to replay
            return rec
        ref, _ = bench.reference(batch)
        _, check, _ = checked_replay(ex, batch, ref, bench.decoy(batch))
    except (GmtoolError, torch.OutOfMemoryError) as e:
        rec.update(status=Status.ERROR, error=str(e).splitlines()[0])
        return rec
    rec.update(max_rel_err=check.max_rel_err, max_rel_err_same_shape=check.max_rel_err_same_shape)
    why = check.failure(*tols)
    rec["status"] = Status.UNSAFE if why else Status.OK
    if why:
        ex.cache.scrub()
        rec["error"] = f"shuffled replay of {key}: {why}"
    return rec


def input_costs(ex) -> dict:
    """The one max-shape input arena against separate input tensors per captured shape."""
    from gmtool.core.auto import parts_of

    per_shape = sum(inputs_bytes(ex, k) for k in ex.graphs)
    # auto's parts share one input arena; piecewise adds the runners' shared buffers, max-shape arenas too
    arena = ex.inputs.nbytes + sum(b.nbytes for part in parts_of(ex) for b in part.runner_buffers())
    return {"input_arena_bytes": arena, "input_per_shape_bytes": per_shape}


def held_storages(executors: dict) -> list[tuple[int, int]]:
    """(address, bytes) of the tensors graph steps keep between pieces: they belong to their graph."""
    out = []
    for ex in executors.values():
        for entry in ex.graphs.values():
            for step in entry.steps:
                if isinstance(step, AttentionRunner):
                    for t in (step.q, step.out):
                        s = t.untyped_storage()
                        out.append((s.data_ptr(), s.nbytes()))
    return out


# -- one strategy ------------------------------------------------------------------------------------
def run_strategy(
    cfg, name: str, progress=None, shared=None, record_traces: bool = False, **vmm_opts
) -> tuple[StrategyRow, object]:
    """(the strategy's row, the SweepResult or None). Failures become the row's status, never exceptions.
    shared: a SharedWorkbench the run takes its model from (None: it builds its own). record_traces: each
    capture's allocator events go into the row's traces (gmtool.memory.alloctrace; CUDA's allocator history,
    where torch has it), for the allocator simulator's prediction (gmtool.memory.allocsim)."""
    if len(cfg.graph_modes) != 1:
        raise GmtoolError("memreport measures one graph mode at a time")
    mode = cfg.graph_modes[0]
    try:
        strategy = make_strategy(name, cfg.torch_device, **vmm_opts)
    except GmtoolError as e:
        return derive({"strategy": name, "mode": mode, "status": UNAVAILABLE, "reason": str(e)}), None
    if record_traces and name in SIMULATED and _history_available():  # VMM's prediction needs no traces
        strategy.record_traces()
    probe = ShuffledReplayProbe(strategy, cfg.seed)
    sweep = Sweep(cfg, progress, lambda mode, s=strategy: s, probes=(probe,))
    raw = {"strategy": name, "mode": mode, "order": strategy.order}
    res = bench = None
    free0 = torch.cuda.mem_get_info(cfg.torch_device)[0]
    try:
        bench = shared.for_config(cfg) if shared is not None else None
        if bench is not None:  # the model every strategy runs on is none's memory: measured from here
            torch.cuda.empty_cache()
            free0 = torch.cuda.mem_get_info(cfg.torch_device)[0]
        res = sweep.run(bench)
    except (GmtoolError, RuntimeError) as e:  # RuntimeError: CUDA errors too; the other strategies still run
        strategy.release()  # no-op when the executors released it; else the failure came before them
        oom = isinstance(e, (OutOfMemory, torch.OutOfMemoryError))
        first = (str(e).splitlines() or [type(e).__name__])[0]
        raw.update(
            status=Status.OOM if oom else Status.ERROR,
            reason=first if isinstance(e, GmtoolError) else f"{type(e).__name__}: {first}",
        )
    raw.update(
        per_key=list(strategy.per_key.values()),
        shuffled=probe.shuffled,
        measured=probe.measured,
        inputs=probe.inputs.get(mode, {}),
        warnings=list(strategy.warnings),
    )
    if getattr(strategy, "traces", None) is not None:
        strategy.traces.finish()  # a no-op when release() finished it
        raw["traces"] = strategy.traces.to_dict()
    if res is not None:
        raw.update(
            records=[r.to_dict() for r in res.records if r.mode in (mode, GraphMode.EAGER)],
            errors=res.errors,
            wall_s=res.wall_s,
        )
        raw["kv_bytes_per_token"] = res.model.get("kv_bytes_per_token")
    del sweep, probe, strategy, bench
    gc.collect()
    torch.cuda.empty_cache()  # the next strategy starts from the same allocator state
    # the ledger's "after release": what the driver did not get back (graph exec objects kept alive, say)
    raw["after_release_bytes"] = free0 - torch.cuda.mem_get_info(cfg.torch_device)[0]
    return derive(raw), res


def _history_available() -> bool:
    from gmtool.memory.alloctrace import history_available

    return history_available()[0]


def shape_totals(per_key: list[dict]) -> tuple[int | None, int | None]:
    needs = [k["graph_mem_bytes"] for k in per_key if k.get("graph_mem_bytes") is not None]
    return (sum(needs), max(needs)) if needs else (None, None)


def _ratio(a, b):
    return a / b if a is not None and b else None


def derive(raw: dict) -> StrategyRow:
    """Headline figures and status of one strategy from what its run collected (records as JSON dicts)."""
    row = dict.fromkeys(ROW_FIELDS)
    row.update(order="descending", per_key=[], shuffled=[], records=[], errors=[], warning_list=[])
    row.update({k: v for k, v in raw.items() if k not in ("measured", "inputs", "warnings", "kv_bytes_per_token")})
    m, inputs = raw.get("measured") or {}, raw.get("inputs") or {}
    for k in ("graph_pool_bytes", "physical_bytes", "virtual_reserved_bytes", "virtual_mapped_bytes"):
        row[k] = m.get(k)
    row["vmm"] = m.get("vmm")
    row["nvml_source"] = m.get("nvml_source")
    row.update({k: inputs.get(k) for k in ("input_arena_bytes", "input_per_shape_bytes")})
    pk = row["per_key"]
    row["captures"] = len(pk)
    row["sum_shape_bytes"], row["max_shape_bytes"] = shape_totals(pk)
    row["physical_over_max"] = _ratio(row["physical_bytes"], row["max_shape_bytes"])
    row["physical_over_sum"] = _ratio(row["physical_bytes"], row["sum_shape_bytes"])
    deltas = [k["device_delta_bytes"] for k in pk if k.get("device_delta_bytes") is not None]
    row["device_used_bytes"] = sum(deltas) if deltas else None
    nv = [k["nvml_delta_bytes"] for k in pk if k.get("nvml_delta_bytes") is not None]
    row["nvml_used_bytes"] = sum(nv) if nv and len(nv) == len(pk) else None
    caps = [k["capture_s"] for k in pk if k.get("capture_s") is not None]
    row["capture_s"] = sum(caps) if caps else None
    graph = [r for r in row["records"] if r["mode"] != GraphMode.EAGER]
    lat = [r["latency_ms"]["median"] for r in graph if r.get("latency_ms")]
    eager = [r["latency_ms"]["median"] for r in row["records"] if r["mode"] == GraphMode.EAGER and r.get("latency_ms")]
    row["replay_ms_median"] = statistics.median(lat) if lat else None
    row["eager_ms_median"] = statistics.median(eager) if eager else None
    errs = [r["max_rel_err"] for r in graph if r.get("max_rel_err") is not None]
    row["max_rel_err"] = max(errs) if errs else None
    row["replays"], row["replays_ok"] = len(graph), sum(r["status"] == Status.OK for r in graph)
    sh = [s for s in row["shuffled"] if s["status"] != "skipped"]
    row["shuffled_replays"], row["shuffled_ok"] = len(sh), sum(s["status"] == Status.OK for s in sh)
    sherr = [s["max_rel_err"] for s in sh if s.get("max_rel_err") is not None]
    row["shuffled_max_rel_err"] = max(sherr) if sherr else None
    led = strategy_ledger(row["strategy"], row["records"], pk, raw.get("kv_bytes_per_token"))
    row["ledger"] = [
        {k: (None if isinstance(v, float) and v != v else v) for k, v in r.items()} for r in led.to_dict("records")
    ]
    total = led["total_bytes"].sum(min_count=1)
    row["ledger_total_bytes"] = None if total != total else int(total)
    kv = led["kv_tokens_given_up"].sum(min_count=1)
    row["kv_tokens_given_up"] = None if kv != kv else int(kv)
    row["warning_list"] = list(raw.get("warnings") or [])
    row["warnings"] = len(row["warning_list"])
    if row.get("status") is None:
        row["status"], row["reason"] = _status(graph, sh, row["errors"])
    return StrategyRow(**row)


def _status(graph: list[dict], shuffled: list[dict], errors: list[str]) -> tuple[Status, str | None]:
    for status in (Status.OOM, Status.UNSAFE, Status.ERROR):
        bad = [r for r in graph + shuffled if r["status"] == status]
        if bad:
            return status, bad[0].get("error") or str(status)
    if errors:
        return Status.ERROR, errors[0]
    return Status.OK, None


# -- the document and its files ----------------------------------------------------------------------
def build_document(cfg, rows: list[StrategyRow], result=None) -> MemDocument:
    doc = MemDocument(
        machine=result.machine if result else machine_info(cfg.torch_device),
        model=result.model if result else {"name": cfg.model},
        config=cfg.to_dict(),
        mode=cfg.graph_modes[0],
        scenario=cfg.scenario,
        strategies=rows,
        notes=list(cfg.notes),
    )
    ref = next((r for r in rows if r.sum_shape_bytes), None)
    doc.sum_shape_bytes = ref.sum_shape_bytes if ref else None
    doc.max_shape_bytes = ref.max_shape_bytes if ref else None
    # the largest shape's own pool as the allocator holds it (segment rounding included): the fair
    # max(shape) for physical bytes, which are counted in whole segments too
    alone = next((r for r in rows if r.strategy == "independent" and r.per_key), None)
    pools = [k["pool_bytes"] for k in alone.per_key if k.get("pool_bytes")] if alone else []
    doc.max_shape_pool_bytes = max(pools) if pools else None
    for r in rows:
        r.physical_over_max_pool = _ratio(r.physical_bytes, doc.max_shape_pool_bytes)
    return doc


def write_report(out: Path, doc: MemDocument) -> list[Path]:
    out = Path(out)
    paths = [out / MEMREPORT_JSON, out / MEMREPORT_CSV, out / MEMREPORT_PNG]
    paths[0].write_text(doc.to_json())
    with paths[1].open("w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=ROW_FIELDS)
        w.writeheader()
        w.writerows(r.csv_row() for r in doc.strategies)
    write_chart(paths[2], doc.to_dict())
    return paths


def write_chart(path: Path, doc: dict) -> None:
    from matplotlib.figure import Figure  # no pyplot: no global backend state, renders with Agg

    rows, mib = doc["strategies"], 2**20
    fig = Figure(figsize=(max(6.0, 1.7 * len(rows) + 2), 4.8))
    ax = fig.subplots()
    w = 0.38
    for i, r in enumerate(rows):
        held, dev = r.get("physical_bytes"), r.get("device_used_bytes")
        if held is None and dev is None:
            ax.text(i, 0, r["status"], ha="center", va="bottom", rotation=90, fontsize=9, color="grey")
            continue
        if held is not None:
            ax.bar(i - w / 2, held / mib, w, color="C0", label="held by the graphs (physical)")
        if dev is not None:
            ax.bar(i + w / 2, dev / mib, w, color="C1", label="device memory the captures took")
    for key, style, color, label in (
        ("sum_shape_bytes", "--", "C3", "sum(shape)"),
        ("max_shape_bytes", ":", "C2", "max(shape)"),
    ):
        if doc.get(key):
            ax.axhline(doc[key] / mib, ls=style, color=color, label=f"{label} = {fmt_bytes(doc[key])}")
    ax.set_xticks(range(len(rows)), [r["strategy"] for r in rows])
    ax.set_ylabel("MiB")
    ax.set_title(
        f"CUDA graph memory per strategy: {doc['model'].get('name')}, {doc['mode']}, "
        f"{max((r['captures'] for r in rows), default=0)} shapes",
        fontsize=10,
    )
    handles, labels = ax.get_legend_handles_labels()
    if handles:  # every bar carries its label: show each once
        seen = dict(zip(labels, handles))
        ax.legend(seen.values(), seen.keys(), fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=120)


MEM_COLUMNS = [
    Column("strategy", justify="left"),
    Column("status", justify="left"),
    Column("shapes", rank=6),
    Column("pool (alloc.)", rank=5),
    Column("physical", rank=1),
    Column("VA mapped", rank=7),
    Column("device Δ", rank=7),
    Column("NVML Δ", rank=8),
    Column("phys/max", rank=2, legend="physical memory over the largest shape's own need (1.00: perfect sharing)"),
    Column("phys/max pool", rank=8),
    Column("phys/sum", rank=5),
    Column("inputs arena/per-shape", rank=9),
    Column("capture s", rank=4),
    Column("replay ms", rank=3),
    Column("shuffled ok", rank=2, legend="replays in shuffled bucket order that matched eager"),
    Column("warn", rank=6),
]


def memreport_table(document: MemDocument) -> FittedTable:
    doc = document.to_dict()
    title = (
        f"gmtool memreport: {doc['model'].get('name')}, {doc['mode']} graphs, sum(shape) "
        f"{fmt_bytes(doc.get('sum_shape_bytes'))}, max(shape) {fmt_bytes(doc.get('max_shape_bytes'))}"
    )
    rows = []
    for r in doc["strategies"]:
        style = style_of(r["status"])
        inputs = (
            "-"
            if r.get("input_arena_bytes") is None
            else f"{fmt_bytes(r['input_arena_bytes'])} / {fmt_bytes(r['input_per_shape_bytes'])}"
        )
        rows.append(
            [
                r["strategy"],
                f"[{style}]{r['status']}[/]",
                str(r.get("captures") or "-"),
                fmt_bytes(r.get("graph_pool_bytes")),
                fmt_bytes(r.get("physical_bytes")),
                fmt_bytes(r.get("virtual_mapped_bytes")),
                fmt_bytes(r.get("device_used_bytes")),
                fmt_bytes(r.get("nvml_used_bytes")),
                _f(r.get("physical_over_max"), ".2f"),
                _f(r.get("physical_over_max_pool"), ".3f"),
                _f(r.get("physical_over_sum"), ".2f"),
                inputs,
                _f(r.get("capture_s"), ".2f"),
                _f(r.get("replay_ms_median"), ".3f"),
                f"{r['shuffled_ok']}/{r['shuffled_replays']}" if r.get("shuffled_replays") else "-",
                str(r.get("warnings") or 0),
            ]
        )
    return FittedTable(title, MEM_COLUMNS, rows)


def memreport_verdict(document: MemDocument) -> str:
    """memreport in one line, per strategy: "N ok, M UNSAFE, K errors", and those this machine cannot run."""
    statuses = [r.status for r in document.strategies]
    line = (
        f"{statuses.count(Status.OK)} ok, {statuses.count(Status.UNSAFE)} UNSAFE, "
        f"{statuses.count(Status.ERROR) + statuses.count(Status.OOM)} errors ({len(statuses)} strategies"
    )
    line += f"; {statuses.count(UNAVAILABLE)} unavailable here" if UNAVAILABLE in statuses else ""
    partial = document.partial
    return line + (f"; partial run: {partial.summary})" if partial else ")")
