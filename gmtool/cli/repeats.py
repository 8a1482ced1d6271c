"""An option given twice with different values: click keeps the last one and drops the first without a word,
and what the user asked for first would be lost. Refused instead, naming both."""

from __future__ import annotations

from gmtool.errors import GmtoolError


def _said(params, argv: list[str]) -> dict[str, list[str]]:
    """For each single-valued option in params, what each of its occurrences in argv says: its value, or for a
    flag the name it was given by. One pass, so an option's value is never read as another option."""
    by_name = {}
    for p in params:
        if getattr(p, "param_type_name", "") == "option" and not p.multiple and not getattr(p, "count", False):
            for name in (*p.opts, *p.secondary_opts):
                by_name[name] = p
    said: dict[str, list[str]] = {}
    i = 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            break
        name, value = tok, None
        if tok.startswith("--") and "=" in tok:
            name, _, value = tok.partition("=")
        elif not tok.startswith("--") and tok.startswith("-") and len(tok) > 2 and tok[:2] in by_name:
            name, value = tok[:2], tok[2:]  # -b4: a short option with its value attached
        p = by_name.get(name)
        if p is not None:
            takes_value = not getattr(p, "is_flag", False) and p.nargs == 1
            if not takes_value:
                value = name
            elif value is None:
                if i + 1 == len(argv):  # no value: click says the option needs one
                    break
                value = argv[i + 1]
                i += 1
            said.setdefault(p.opts[0], []).append(value)
        i += 1
    return said


def refuse_repeated(group, argv: list[str]) -> None:
    """Raise GmtoolError where argv gives one of its command's single-valued options twice, differently. group:
    the click group of the commands (typer's, whose click may be its own copy: read by duck typing)."""
    name = next((a for a in argv if not a.startswith("-")), None)
    command = group.commands.get(name) if name else None
    if command is None:
        return
    for opt, values in _said(command.params, argv[argv.index(name) + 1 :]).items():
        if len(set(values)) > 1:
            shown = " then ".join(f"'{v}'" for v in values)
            raise GmtoolError(f"{opt} given {len(values)} times ({shown}): only one would be used; give it once")
