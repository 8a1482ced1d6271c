"""gmtool memreport: graph memory of every captured shape under each pool strategy, replays checked."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from gmtool.app import run_memreport
from gmtool.cli import options as o
from gmtool.cli.output import Output, document_if_interrupted
from gmtool.cli.progress import progress_bars
from gmtool.cli.run_sweep import build_config
from gmtool.errors import GmtoolError
from gmtool.memory.ledger import sample_buckets
from gmtool.memory.report import MEMREPORT_JSON, memreport_table, memreport_verdict
from gmtool.memory.strategies import STRATEGIES, parse_strategies
from gmtool.modes import MEMORY_MODES
from gmtool.parallel import launch
from gmtool.parallel.launch import resolve_tp
from gmtool.records import Status
from gmtool.report.ledger import memreport_ledger_table, prediction_table
from gmtool.report.results import default_out_dir

MEMREPORT_MODES = MEMORY_MODES


def memreport(
    model: o.ModelOpt = None,
    buckets: o.BucketsOpt = None,
    compositions: o.CompositionsOpt = None,
    scenario: o.ScenarioOpt = None,
    strategies: Annotated[str, typer.Option("--strategies", help=f"Comma list of {', '.join(STRATEGIES)}.")] = ",".join(
        STRATEGIES
    ),
    mode: Annotated[
        Optional[str], typer.Option("--mode", help=" | ".join(MEMREPORT_MODES), show_default=o.shown_mode())
    ] = None,
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
    tp: o.TpOpt = None,
    tp_timeout: o.TpTimeoutOpt = None,
    profile: o.ProfileOpt = None,
    out: Annotated[Optional[Path], o.out_dir_option("memreport")] = None,
    force: o.ForceOpt = False,
    fmt: o.FormatOpt = o.OutputFormat.HUMAN,
    sample: Annotated[
        Optional[int],
        typer.Option(
            "--sample",
            help="Capture only this many of the buckets (smallest, largest, evenly between) and predict "
            "the whole list's memory per strategy.",
        ),
    ] = None,
    check: Annotated[
        bool,
        typer.Option(
            "--check",
            help="Predict from the sampled buckets (--sample, default 4), then capture every bucket "
            "and report the prediction's error per strategy.",
        ),
    ] = False,
) -> None:
    """Capture every bucket under each memory strategy (independent pools, one shared pool largest or smallest
    first, VMM ranges over shared physical memory); replay all against eager, also in shuffled order; compare
    the memory each holds with sum(shape) and max(shape)."""
    names = parse_strategies(strategies)
    if mode is not None and mode not in MEMREPORT_MODES:
        raise GmtoolError(f"--mode must be one of {', '.join(MEMREPORT_MODES)}, got {mode!r}")
    cfg = build_config(
        profile,
        model=model,
        buckets=buckets,
        compositions=compositions,
        scenario=scenario,
        modes=("eager", mode) if mode else None,
        piecewise_impl=piecewise_impl,
        attention=attention,
        compile=compile,
        fuse=fuse,
        device=device,
        dtype=dtype,
        max_kv_len=max_kv_len,
        max_tokens=max_tokens,
        max_num_seqs=max_num_seqs,
        kv_cache_gb=kv_cache_gb,
        block_size=block_size,
        num_iters=num_iters,
        num_iters_warmup=num_iters_warmup,
        seed=seed,
        tp=resolve_tp(tp),
    )
    if cfg.graph_modes not in [[m] for m in MEMREPORT_MODES]:  # modes from a sweep profile
        raise GmtoolError(
            f"memreport runs one graph mode ({', '.join(MEMREPORT_MODES)}), not {','.join(cfg.graph_modes) or 'none'}"
        )
    if cfg.eager_sizes:  # auto runs them eagerly: there is no graph memory of theirs to report
        raise GmtoolError(
            f"memreport measures graphs, and no graph serves the mixes above the largest bucket "
            f"({', '.join(map(str, cfg.eager_sizes))} tokens): give --compositions within --buckets"
        )
    if sample is not None:
        sample_buckets(cfg.bucket_sizes, sample)  # refused before anything runs
    if cfg.torch_device.type != "cuda":
        raise GmtoolError(f"memory strategies need CUDA: memreport cannot run on {cfg.torch_device}")
    out_ = Output(fmt)

    def said(row):
        if row.status != Status.OK:
            out_.problems.print(
                f"[bold yellow]{row.strategy}:[/] {row.status}: {escape(str(row.reason))}", highlight=False
            )

    with (
        launch.out_dir_for(out or default_out_dir("memreport"), force) as out_dir,
        document_if_interrupted(out_, out_dir / MEMREPORT_JSON),
    ):
        doc, paths = launch.run(
            run_memreport,
            cfg,
            names,
            out_dir,
            progress=progress_bars(out_.console),
            on_strategy=said,
            timeout=tp_timeout,
            sample=sample,
            check=check,
        )
    out_.document(doc.to_json())
    out_.show(memreport_table(doc))
    for table in (memreport_ledger_table(doc.to_dict()), prediction_table(doc.to_dict())):
        if table is not None:
            out_.show(table)
    for p in doc.prediction:  # the allocator simulator's: buckets whose events were not interpolated alike
        for note in p.notes:
            out_.show(f"[dim]prediction ({p.strategy}, {p.method}):[/] {escape(note)}", highlight=False)
    for r in doc.strategies:
        for w in r.warning_list:
            out_.show(f"[yellow]warning ({r.strategy}):[/] {escape(w)}", highlight=False)
    out_.show(escape(f"results: {', '.join(str(p) for p in paths)}"), highlight=False)
    code = doc.exit_code()
    out_.verdict(memreport_verdict(doc), code == 0)
    if code:
        raise typer.Exit(code)
