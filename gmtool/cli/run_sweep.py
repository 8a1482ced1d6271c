"""What the sweep commands share: the config from command line, profile and defaults; problems and the exit code."""

from __future__ import annotations

import re

import typer
from rich.console import Console
from rich.markup import escape

from gmtool.config import SweepConfig
from gmtool.errors import GmtoolError
from gmtool.profiles import load_sweep_profile
from gmtool.records import Document
from gmtool.report.ledger import ledger_table
from gmtool.report.summary import verdict
from gmtool.report.tables import baseline_line, noise_warning


def build_config(profile: str | dict | None, **opts) -> SweepConfig:
    """Each option: the command line's value when given (not None), else the sweep profile's (a name, a path, or
    one already loaded), else SweepConfig's default."""
    prof = load_sweep_profile(profile) if isinstance(profile, str) else dict(profile or {})
    try:
        cfg = SweepConfig(**{**prof, **{k: v for k, v in opts.items() if v is not None}})
        cfg.check_decode_seqs()
    except GmtoolError as e:  # it names the options: say which of them the profile gave, not the command line
        if said := _from_profile(str(e), prof, opts, profile):
            raise type(e)(str(e) + said) from None
        raise
    return cfg


def _from_profile(message: str, prof: dict, opts: dict, profile) -> str:
    """Which options the message names took the profile's value."""
    keys = [k for k in dict.fromkeys(o.replace("-", "_") for o in re.findall(r"--([a-z][a-z-]*)", message))]
    given = [k for k in keys if k in prof and opts.get(k) is None]
    if not given:
        return ""
    where = f"sweep profile {profile}" if isinstance(profile, str) else "the sweep profile"
    return f" ({', '.join(f'{k}: {prof[k]!r}' for k in given)} came from {where})"


def _alike(errors: list[str]) -> list[tuple[str, int]]:
    """Each error with how many later ones say the same but for their numbers (a too-small KV cache fails every
    batch with its own block count), in first-seen order."""
    groups: dict[str, list] = {}
    for e in errors:
        groups.setdefault(re.sub(r"\d+(\.\d+)?", "#", e), [e, -1])[1] += 1
    return [(first, n) for first, n in groups.values()]


def finish(doc: Document, console: Console, then=None) -> None:
    """Print every problem once, then call then() (the verdict line comes last); exit 1 when a row failed, 3 when
    a replay that should be safe was not (full-narrow's UNSAFE rows are the finding it exists to show, not a
    failure)."""
    errors, seen = list(doc.errors), set(doc.errors)
    for r in doc.records:  # graph-mode error rows are recorded in the row only
        if r.status.failed and r.error and r.error not in seen:
            seen.add(r.error)
            errors.append(f"{r.mode} bucket {r.bucket} ({r.composition}): {r.error}")
    for e, alike in _alike(errors):
        more = f" (and {alike} more alike but for their numbers: each is in results.json)" if alike else ""
        console.print(f"[bold red]error:[/] {escape(e)}{more}", highlight=False, soft_wrap=True)
    for r in doc.unexpected_unsafe():
        console.print(
            f"[bold red]UNSAFE[/] {r.mode} bucket {r.bucket} {escape(f'{r.composition}: {r.error}')}",
            highlight=False,
            soft_wrap=True,
        )
    if then:
        then()
    code = doc.exit_code()
    if code:
        raise typer.Exit(code)


def show_sweep(out_, doc: Document, table, wrote: str, shown: list[str] | tuple = ()) -> None:
    """capture and compare: the document (json), the command's table, the ledger, the noise warning, the run's
    notes, the files written, then problems, the verdict and the exit code. table: the command's table of
    doc.to_dict(). shown: notes the command printed before the run (not repeated). Every other note is printed:
    what the run did not apply of what was asked (an option that does nothing here, random weights), the fused
    layers against the model's own, what the captures cost."""
    data = doc.to_dict()
    out_.document(doc.to_json())
    out_.show(table(data))
    if base := baseline_line(data):
        out_.show(escape(base), highlight=False)
    if (memory := ledger_table(data)) is not None:
        out_.show(memory)
    if noise := noise_warning(data):
        out_.show(f"[yellow]warning:[/] {escape(noise)}", highlight=False)
    for note in data.get("notes") or []:
        if note not in shown:
            out_.note(note)
    out_.show(escape(wrote), highlight=False)
    finish(doc, out_.problems, lambda: out_.verdict(verdict(data), doc.exit_code() == 0))
