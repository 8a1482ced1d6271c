"""An option given twice with different values: click keeps the last one and drops the first without a word,
and what the user asked for first would be lost. Refused instead, naming both."""

from __future__ import annotations

from gmtool.errors import GmtoolError


def _occurrences(param, argv: list[str]) -> list[str]:
    """What each occurrence of param in argv says: its value, or for a flag, the name it was given by."""
    names = [*param.opts, *param.secondary_opts]
    takes_value = not getattr(param, "is_flag", False) and param.nargs == 1
    said, i = [], 0
    while i < len(argv):
        tok = argv[i]
        if tok == "--":
            break
        name, eq, value = tok.partition("=")
        if tok in names:
            if takes_value:
                said.append(argv[i + 1] if i + 1 < len(argv) else "")
                i += 1
            else:
                said.append(tok)
        elif eq and name in names and name.startswith("--"):
            said.append(value)
        i += 1
    return said


def refuse_repeated(group, argv: list[str]) -> None:
    """Raise GmtoolError where argv gives one of its command's single-valued options twice, differently. group:
    the click group of the commands (typer's, whose click may be its own copy: read by duck typing)."""
    name = next((a for a in argv if not a.startswith("-")), None)
    command = group.commands.get(name) if name else None
    if command is None:
        return
    rest = argv[argv.index(name) + 1 :]
    for param in command.params:
        if getattr(param, "param_type_name", "") != "option" or param.multiple or getattr(param, "count", False):
            continue
        said = _occurrences(param, rest)
        if len(set(said)) > 1:
            shown = " then ".join(f"'{s}'" for s in said)
            raise GmtoolError(
                f"{param.opts[0]} given {len(said)} times ({shown}): only one would be used; give it once"
            )
