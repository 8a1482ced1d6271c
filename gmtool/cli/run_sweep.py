"""What capture and compare share: build the config, run the sweep with progress, write the files."""
from __future__ import annotations

from pathlib import Path

from rich.console import Console

from gmtool.cli.progress import SweepProgress
from gmtool.config import SweepConfig
from gmtool.profiles import load_sweep_profile
from gmtool.report.results import default_out_dir, prepare_out_dir, to_document, write_results
from gmtool.sweep import Sweep


def build_config(profile: str | None, **opts) -> SweepConfig:
    """Options left at None fall back to the sweep profile, then to SweepConfig's defaults."""
    prof = load_sweep_profile(profile) if profile else {}
    merged = {k: v for k, v in prof.items() if k in SweepConfig.__dataclass_fields__}
    merged.update({k: v for k, v in opts.items() if v is not None})
    return SweepConfig(**merged)


def run_and_write(cfg: SweepConfig, command: str, out: Path | None, force: bool, console: Console,
                  memory_factory=None) -> tuple[dict, Path]:
    out = prepare_out_dir(out or default_out_dir(command), force)
    for note in cfg.notes:
        console.print(f"[yellow]note:[/] {note}")
    with SweepProgress(console, command) as progress:
        result = Sweep(cfg, progress, memory_factory).run()
    doc = to_document(result, command)
    write_results(out, doc)
    return doc, out
