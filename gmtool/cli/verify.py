"""gmtool verify: hunt for wrong replays (poisoned memory, a soak under a moving workload, the first diverging
layer, capturability and dynamic-dimension analysis). Exit 0 clean, 3 when something is found, 2 bad input."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Optional

import typer
from rich.markup import escape

from gmtool.cli import options as o
from gmtool.cli.output import Output
from gmtool.errors import Interrupted
from gmtool.report.results import default_out_dir, output_dir
from gmtool.verify.faults import FAULTS
from gmtool.verify.run import CPU_DEFAULTS, GPU_DEFAULTS, VerifyConfig
from gmtool import json_text


def _default(name: str) -> str:
    return str(VerifyConfig.__dataclass_fields__[name].default)


def _scaled(name: str) -> str:
    """verify's own default for an engine-shape option: a small engine on the CPU tape, the engines' scale on CUDA
    (gmtool.verify.run), not capture's."""
    return f"{CPU_DEFAULTS[name]} on the CPU, {GPU_DEFAULTS[name]} on CUDA"


def verify(
    model: o.ModelOpt = None,
    modes: Annotated[
        Optional[str],
        typer.Option(
            "--modes",
            help="Graph modes to soak: full, piecewise, auto, full-narrow "
            "(full-narrow's wrong replays are the bug it exists to show).",
            show_default=_default("modes"),
        ),
    ] = None,
    steps: Annotated[
        Optional[int], typer.Option("--steps", help="Engine steps per soak.", show_default=_default("steps"))
    ] = None,
    check_every: Annotated[
        Optional[int],
        typer.Option(
            "--check-every",
            help="Check every K-th step against eager, and each graph's first two replays.",
            show_default=_default("check_every"),
        ),
    ] = None,
    strategy: Annotated[
        Optional[str],
        typer.Option(
            "--strategy",
            help="Memory strategies, comma-separated: default "
            "(one graph pool), independent, shared, shared-ascending, vmm (CUDA).",
            show_default=_default("strategy"),
        ),
    ] = None,
    inject: Annotated[
        Optional[str],
        typer.Option("--inject", help=f"Inject a bug to see it caught: {', '.join(FAULTS)} (pad-read:LAYER)."),
    ] = None,
    buckets: Annotated[
        Optional[str],
        typer.Option(
            "--buckets",
            "-b",
            help=f"{o.BUCKET_SYNTAX} Default: {_scaled('buckets')}.",
        ),
    ] = None,
    device: o.DeviceOpt = None,
    dtype: o.DtypeOpt = None,
    max_num_seqs: Annotated[
        Optional[int],
        typer.Option("--max-num-seqs", help="Most sequences in one step.", show_default=_scaled("max_num_seqs")),
    ] = None,
    max_kv_len: Annotated[
        Optional[int],
        typer.Option("--max-kv-len", help="Longest context a sequence may have.", show_default=_scaled("max_kv_len")),
    ] = None,
    block_size: Annotated[
        Optional[int],
        typer.Option("--block-size", help="KV cache block size in tokens.", show_default=_scaled("block_size")),
    ] = None,
    max_tokens: Annotated[
        Optional[int],
        typer.Option(
            "--max-tokens",
            help="auto's largest step: steps above the largest bucket run eagerly, as engines run them "
            "(auto only). Default: the largest bucket.",
        ),
    ] = None,
    attention: o.AttentionOpt = None,
    piecewise_impl: o.PiecewiseImplOpt = None,
    seed: o.SeedOpt = None,
    out: Annotated[Optional[Path], o.out_dir_option("verify")] = None,
    force: o.ForceOpt = False,
    fmt: o.FormatOpt = o.OutputFormat.HUMAN,
) -> None:
    """Soak the graphs under an engine-like workload with poisoned memory; localize any wrong replay."""
    from gmtool.verify.report import dyndims_table, runs_table, write_document
    from gmtool.verify.run import run_verify

    out_ = Output(fmt)
    given = dict(
        model=model,
        modes=modes,
        steps=steps,
        check_every=check_every,
        strategy=strategy,
        inject=inject,
        buckets=buckets,
        device=device,
        dtype=dtype,
        max_num_seqs=max_num_seqs,
        max_kv_len=max_kv_len,
        block_size=block_size,
        max_tokens=max_tokens,
        attention=attention,
        piecewise_impl=piecewise_impl,
        seed=seed,
    )
    cfg = VerifyConfig(**{k: v for k, v in given.items() if v is not None})
    with output_dir(out or default_out_dir("verify"), force) as out_dir:
        doc = run_verify(cfg, lambda text: out_.console.print(f"[dim]{escape(text)}[/]", highlight=False))
        path = write_document(out_dir, doc)
    out_.document(json_text.dumps(doc, indent=2, default=str))
    for f in doc["capturability"]:
        out_.show(f"[yellow]capturability:[/] {escape(f['text'])}", highlight=False, soft_wrap=True)
    if doc["dynamic_dims"]:
        out_.show(dyndims_table(doc))
    dd_notes = [n for d in doc["dynamic_dims"] for n in (d["graph_nodes"] or {}).get("notes", []) + [d["note"]]]
    for note in dict.fromkeys(n for n in dd_notes if n):  # the same note for every mode once
        out_.show(f"[dim]dynamic dimensions: {escape(note)}[/]", highlight=False, soft_wrap=True)
    if doc["runs"]:
        out_.show(runs_table(doc))
    for n in doc["notes"]:
        out_.note(n)
    for f in doc["findings"]:
        out_.problems.print(f"[bold red]found:[/] {escape(str(f))}", highlight=False, soft_wrap=True)
    out_.show(escape(f"verify.json: {path}"), highlight=False)
    out_.verdict(doc["verdict"], doc["exit_code"] == 0, label="")
    if doc.get("partial") and not doc["findings"]:
        raise Interrupted(f"interrupted; what was measured is in {path}")
    if doc["exit_code"]:
        raise typer.Exit(doc["exit_code"])
