"""Built-in model profiles (published configs, random weights) and sweep profiles, both under profiles/.

They are package data: gmtool/builtin_profiles is a link to the repository's profiles/ (where people edit them),
and the wheel holds a copy of the files, so the same importlib.resources path works from the tree, from an
editable install and from an installed wheel, whatever the working directory."""

from __future__ import annotations

import difflib
import json
import os
from importlib.resources import files
from importlib.resources.abc import Traversable
from pathlib import Path

from gmtool.errors import GmtoolError

PROFILES_DIR: Traversable = files("gmtool") / "builtin_profiles"


def _names(kind: str) -> list[str]:
    return sorted(p.name.removesuffix(".json") for p in (PROFILES_DIR / kind).iterdir() if p.name.endswith(".json"))


def model_profiles() -> list[str]:
    return _names("models")


def sweep_profiles() -> list[str]:
    return _names("sweeps")


def load_model_profile(name: str) -> dict:
    path = PROFILES_DIR / "models" / f"{name}.json"
    # a name with a path's marks was meant as a path (not a profile: an absolute one or ./name would otherwise
    # reach into or past the profiles folder): say the path is not there
    if "/" in name or name.startswith(".") or name.endswith(".json"):
        raise GmtoolError(
            f"--model {name}: no such checkpoint folder or config.json here (gmtool never downloads: a Hub id "
            "needs its files on disk)"
        )
    if not path.is_file():
        # the tiny test profiles are named as a family: the line stays short as profiles are added (--help lists all)
        sized = [n for n in model_profiles() if not n.startswith("tiny-")]
        near = difflib.get_close_matches(name.lower(), model_profiles(), n=1, cutoff=0.75)
        raise GmtoolError(
            f"unknown model {name!r}"
            + (f" (did you mean {near[0]}?)" if near else "")
            + f": give a profile ({', '.join(sized)}, or tiny-* for tests), a checkpoint folder or a config.json"
        )
    return json.loads(path.read_text())


class _RepeatedKey(Exception):
    pass


def _unique_keys(pairs: list[tuple]) -> dict:
    keys = [k for k, _ in pairs]
    if len(set(keys)) < len(keys):
        raise _RepeatedKey(next(k for k in keys if keys.count(k) > 1))
    return dict(pairs)


def load_sweep_profile(name_or_path: str) -> dict:
    """A sweep profile (a name under profiles/sweeps or a path) as SweepConfig keyword arguments; an unknown key
    or a value of the wrong type is refused."""
    from gmtool.config import check_profile  # config imports model, which imports this module

    path: Path | Traversable = Path(name_or_path)
    if not path.is_file():
        path = PROFILES_DIR / "sweeps" / f"{name_or_path}.json"
    if not path.is_file():
        if name_or_path.endswith(".json") or "/" in name_or_path or os.sep in name_or_path:  # meant as a file
            raise GmtoolError(
                f"no sweep profile file {name_or_path!r} (built-in profiles: {', '.join(sweep_profiles())})"
            )
        raise GmtoolError(f"unknown sweep profile {name_or_path!r}: choose from {', '.join(sweep_profiles())}")
    try:
        prof = json.loads(path.read_text(), object_pairs_hook=_unique_keys)
    except json.JSONDecodeError as e:
        raise GmtoolError(f"sweep profile {path} is not valid JSON: {e}") from None
    except _RepeatedKey as e:  # json keeps the last value of a key given twice, as if the first were not there
        raise GmtoolError(f"sweep profile {path} gives {e.args[0]!r} twice: keep one") from None
    except UnicodeDecodeError as e:
        raise GmtoolError(f"sweep profile {path} is not UTF-8 text: {e.reason} at byte {e.start}") from None
    except OSError as e:
        raise GmtoolError(f"cannot read sweep profile {path}: {e.strerror or e}") from None
    return check_profile(prof, str(path))
