"""gmtool plan: the capture sizes that minimize a workload's expected step time under memory, capture-time and
graph-count budgets, from a results file or measured on the spot."""

from __future__ import annotations

import contextlib
from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from gmtool.app import run_plan_measure
from gmtool.cli import options as o
from gmtool.cli.output import Output
from gmtool.cli.progress import progress_bars
from gmtool.cli.run_sweep import build_config
from gmtool.core.buckets import parse_buckets
from gmtool.errors import GmtoolError
from gmtool.modes import GraphMode
from gmtool.plan.costs import PLANNED as PLAN_MODES
from gmtool.plan.costs import from_results
from gmtool.plan.document import PLAN_JSON, PLAN_MD, PLAN_PNG, build_document, lazy_line, plan_table, write_plan
from gmtool.plan.optimizer import Budgets, PoolSharing
from gmtool.plan.run import PlanInputs, check_candidates, check_steps, make_plan, needed_buckets
from gmtool.plan.workload import builtin_workloads, is_decode, load_workload
from gmtool.profiles import load_sweep_profile
from gmtool import json_text
from gmtool.report.results import (
    OUTPUT_FILES,
    check_out_dir,
    default_out_dir,
    load_results,
    output_dir,
)


def _positive(value, name: str):
    if value is not None and not 0 < value < float("inf"):
        raise GmtoolError(f"{name} must be positive and finite, got {value}")
    return value


def _profile_mode(modes, note) -> str | None:
    """The graph mode a sweep profile's modes ask for, as plan costs one: full or piecewise (full where it has
    both, said in a note); None without modes."""
    unknown = [m for m in modes if m not in tuple(GraphMode)]
    if unknown:
        raise GmtoolError(f"unknown mode {unknown[0]!r} in the profile: choose from {', '.join(GraphMode)}")
    asked = [GraphMode(m) for m in modes if GraphMode(m).captures]
    plannable = [m for m in asked if m in PLAN_MODES]
    if not asked:
        return None
    if not plannable:
        raise GmtoolError(
            f"the profile's modes ({', '.join(asked)}) hold no full or piecewise graphs, the ones plan costs: "
            "give --mode full or --mode piecewise"
        )
    mode = GraphMode.FULL if GraphMode.FULL in plannable else plannable[0]
    if len(asked) > 1:
        note(f"plan costs one graph mode: {mode}, of the profile's {', '.join(asked)} (--mode picks another)")
    return mode


def plan(
    workload: Annotated[
        str,
        typer.Option(
            "--workload",
            "-w",
            help="CSV or JSONL of step shapes num_tokens,num_seqs"
            f"[,count], or a built-in workload ({', '.join(builtin_workloads())}).",
        ),
    ],
    from_: Annotated[
        Optional[Path],
        typer.Option(
            "--from",
            help="A results.json (or its directory) of compare or "
            "capture to take per-bucket costs from; without it they are measured "
            "now.",
        ),
    ] = None,
    memory_budget: Annotated[
        Optional[float], typer.Option("--memory-budget", help="Graph memory allowed, GiB.")
    ] = None,
    capture_budget: Annotated[
        Optional[float], typer.Option("--capture-budget", help="Capture time allowed, s.")
    ] = None,
    max_graphs: Annotated[Optional[int], typer.Option("--max-graphs", help="Most graphs to capture.")] = None,
    memory_sharing: Annotated[
        PoolSharing,
        typer.Option(
            "--memory-sharing",
            help="shared: one pool, graph memory is "
            "the largest pool plus each graph's memory outside it; independent: the sum.",
        ),
    ] = PoolSharing.SHARED,
    candidates: Annotated[
        Optional[str],
        typer.Option(
            "--candidates",
            help="Sizes the plan may pick from (default: the measured buckets and the workload's sizes within them).",
        ),
    ] = None,
    mode: Annotated[
        Optional[str],
        typer.Option(
            "--mode", help="full | piecewise: the graphs planned (default: full, or the results' one graph mode)."
        ),
    ] = None,
    model: o.ModelOpt = None,
    buckets: o.BucketsOpt = None,
    compositions: o.CompositionsOpt = None,
    scenario: o.ScenarioOpt = None,
    piecewise_impl: o.PiecewiseImplOpt = None,
    attention: o.AttentionOpt = None,
    compile: o.CompileOpt = None,
    fuse: o.FuseOpt = None,
    device: o.DeviceOpt = None,
    dtype: o.DtypeOpt = None,
    max_kv_len: o.MaxKvLenOpt = None,
    max_tokens: o.MaxTokensOpt = None,
    max_num_seqs: o.MaxSeqsOpt = None,
    kv_cache_gb: o.KvCacheGbOpt = None,
    block_size: o.BlockSizeOpt = None,
    num_iters: o.ItersOpt = None,
    num_iters_warmup: o.WarmupOpt = None,
    seed: o.SeedOpt = None,
    profile: o.ProfileOpt = None,
    out: Annotated[Optional[Path], o.out_dir_option("plan")] = None,
    force: o.ForceOpt = False,
    fmt: o.FormatOpt = o.OutputFormat.HUMAN,
) -> None:
    """Choose the capture sizes that minimize the workload's expected step time within the budgets (padding
    included; steps above the largest graph run eager), and compare with the engines' default lists."""
    if mode is not None and mode not in PLAN_MODES:
        raise GmtoolError(f"--mode must be full or piecewise, got {mode!r}")
    if memory_budget is not None and memory_budget * 2**30 == float("inf"):  # finite in GiB, not in bytes
        raise GmtoolError(f"--memory-budget {memory_budget} GiB is beyond any device: give a finite budget")
    budgets = Budgets(
        _positive(memory_budget, "--memory-budget") and memory_budget * 2**30,
        _positive(capture_budget, "--capture-budget"),
        _positive(max_graphs, "--max-graphs"),
    )
    if max_tokens is not None and max_tokens <= 0:  # as capture and compare say it, before the workload's steps
        raise GmtoolError(f"--max-tokens must be positive, got {max_tokens}")
    try:
        chosen = parse_buckets(candidates) if candidates is not None else None
    except GmtoolError as e:  # its message speaks of buckets: say which option held them
        raise GmtoolError(f"--candidates: {e}") from None
    steps, path = load_workload(workload)
    check_steps(steps["num_tokens"], max_tokens)  # before measuring: a refusal after it would lose the measurement
    check_candidates(chosen, max_tokens)
    out_ = Output(fmt)
    said: list[str] = []  # notes printed as they came (before a measurement): the plan's notes hold them too

    def note(text: str) -> None:
        said.append(text)
        out_.note(text)

    out_dir, measured_files = None, []
    # what shapes a measurement (--max-tokens also bounds the plan's candidates: it stays valid with --from)
    measuring = dict(
        buckets=buckets,
        compositions=compositions,
        piecewise_impl=piecewise_impl,
        attention=attention,
        compile=compile,
        fuse=fuse,
        device=device,
        dtype=dtype,
        max_kv_len=max_kv_len,
        max_num_seqs=max_num_seqs,
        kv_cache_gb=kv_cache_gb,
        block_size=block_size,
        num_iters=num_iters,
        num_iters_warmup=num_iters_warmup,
        seed=seed,
    )
    target = Path(out or default_out_dir("plan"))
    src = Path(from_) if from_ is not None else None
    if src is not None and target.resolve() == (src if src.is_dir() else src.parent).resolve():
        # --force would clear the results it reads, and the plan's results files would replace them
        raise GmtoolError(f"--out {target} holds the --from results: give the plan a directory of its own")
    if src is not None and target.is_dir():  # --from writes the plan's three files only
        mine = {PLAN_JSON, PLAN_MD, PLAN_PNG}
        theirs = sorted({f.name for p in OUTPUT_FILES for f in target.glob(p)} - mine)
        if theirs:  # --force would delete another run's results to write three plan files beside nothing
            raise GmtoolError(
                f"--out {target} holds another run's files ({', '.join(theirs)}): plan --from writes only "
                f"{', '.join(sorted(mine))}, give a directory of its own"
            )
    check_out_dir(target, force)  # before a measurement, not after it; cleared (--force) only to write
    if from_ is not None:
        given = [k for k, v in {**measuring, "scenario": scenario, "profile": profile}.items() if v is not None]
        if given:  # they shape a measurement, and --from measures nothing: they would be ignored
            raise GmtoolError(
                f"--{given[0].replace('_', '-')} sets how costs are measured, but --from takes them from "
                f"{from_}: drop it, or drop --from to measure now"
            )
        doc = load_results(from_).to_dict()
        name = doc["model"].get("name")
        if model is not None and Path(model).name != name:
            raise GmtoolError(f"--model {model} but {from_} measured {name}")
        source = {"kind": "results file", "path": str(from_)}
    else:
        prof = load_sweep_profile(profile) if profile is not None else {}
        mode = mode or _profile_mode(prof.get("modes", ()), note)
        cfg = build_config(
            prof,
            model=model,
            # a profile's scenario stands (with its KV length): the workload's only where neither names one
            scenario=scenario or prof.get("scenario") or ("decode" if is_decode(steps) else "mixed"),
            modes=("eager", mode or "full"),
            max_tokens=max_tokens,
            **measuring,
        )
        if cfg.tp > 1:  # the sweep would need its ranks started by gmtool.parallel.launch; plan has no --tp
            raise GmtoolError(
                f"the profile asks for tp {cfg.tp}: plan measures on one device; measure with capture or compare "
                "--tp (with the profile), then plan --from those results"
            )
        if budgets.memory_bytes is not None and cfg.torch_device.type != "cuda":  # before measuring, not after
            raise GmtoolError(
                "a memory budget needs graph memory figures, which the CPU backend does not measure: measure on "
                "CUDA, or plan --from a CUDA results file"
            )
        first_notes = list(cfg.notes)  # a rebuild names the model: the first's note of the CPU default stays
        if buckets is None:  # only the buckets the workload reaches, with the mixes that run on them
            kept = needed_buckets(cfg.bucket_sizes, int(steps["num_tokens"].max()))
            mixes, left = _mixes_on(cfg, kept)
            if left:
                note(f"the mixes {', '.join(left)} run on buckets the workload never reaches: not measured")
            # every option as the first config resolved it, but the mixes: none left means each bucket's defaults
            opts = {k: v for k, v in cfg_opts(cfg).items() if k != "compositions"}
            cfg = build_config(None, **opts, buckets=",".join(map(str, kept)), compositions=mixes)
        for n in dict.fromkeys(first_notes + cfg.notes):
            note(n)
        source = {"kind": "measured now", "buckets": cfg.bucket_sizes}
        # measured into the plan's directory: a Ctrl-C, or a plan that cannot be made, keeps what was measured there
        with output_dir(target, force) as out_dir:
            measured, measured_files = run_plan_measure(cfg, out_dir, progress_bars(out_.console))
        doc = measured.to_dict()
    mixed = int(steps.loc[steps["num_tokens"] != steps["num_seqs"], "count"].sum())
    total, scenario = int(steps["count"].sum()), doc["config"].get("scenario")
    notes = said + (
        [
            f"{mixed} of {total} steps are not pure decode but the costs are of decode "
            "graphs: they are costed by their token count"
        ]
        if mixed and scenario == "decode"
        else []
    )
    if mixed < total and scenario in ("prefill", "mixed"):  # the other way round: decode steps, other graphs' costs
        notes.append(
            f"{total - mixed} of {total} steps are pure decode but the costs are of {scenario} graphs: they are "
            "costed by their token count (measure a decode run for them)"
        )
    partial = doc.get("partial")
    if partial:
        notes.append(
            f"the costs come from a partial run ({partial.get('measured')} of {partial.get('planned')} "
            f"{partial.get('unit', 'rows')}): buckets it did not reach were not measured, sizes there are "
            "estimated from those it did"
        )
    inp = PlanInputs(steps, path, from_results(doc, mode), budgets, memory_sharing, chosen, max_tokens, notes)
    res = make_plan(inp)
    plan_doc = build_document(res, inp, source, doc["model"], doc["machine"])
    # --from: the directory is prepared only now; a measurement prepared (and filled) it already
    with output_dir(target, force) if out_dir is None else contextlib.nullcontext(out_dir) as out_dir:
        files = measured_files + write_plan(out_dir, plan_doc)
    out_.document(json_text.dumps(plan_doc, indent=2, default=str))
    out_.show(plan_table(plan_doc))
    for line in lazy_line(plan_doc.get("lazy_capture")):
        out_.show(line, highlight=False)
    for n in plan_doc["notes"]:
        if n not in said:
            out_.show(f"[yellow]note:[/] {escape(n)}", highlight=False)
    out_.show(escape("wrote " + ", ".join(str(f) for f in files)), highlight=False)
    out_.verdict(
        f"{','.join(map(str, plan_doc['capture_sizes'])) or '(none: no set of candidate sizes within the budgets beats running eager)'}",
        True,
        label="capture sizes",
    )


def _mixes_on(cfg, buckets: list[int]) -> tuple[str | None, list[str]]:
    """cfg's own mixes (--compositions) that run on one of buckets, as cfg's bucket policy places them, and the
    others; None where none is left (each bucket then gets the defaults)."""
    from gmtool.core.compositions import parse_composition

    if not cfg.compositions:
        return None, []
    policy, kept, left = cfg.policy(), [], []
    for text in cfg.compositions.split(","):
        c = parse_composition(text)
        (kept if (c.bucket or policy.bucket_for(c.num_tokens)) in buckets else left).append(text.strip())
    return ",".join(kept) or None, left


def cfg_opts(cfg) -> dict:
    """A config's options as given (to rebuild it with other buckets)."""
    from gmtool.config import SWEEP_OPTIONS

    return {k: getattr(cfg, k) for k in SWEEP_OPTIONS if k != "buckets"}
