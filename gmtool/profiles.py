"""Built-in model profiles (published configs, random weights) and sweep profiles, both under profiles/."""
from __future__ import annotations

import json
from pathlib import Path

from gmtool.errors import GmtoolError

PROFILES_DIR = Path(__file__).resolve().parent.parent / "profiles"


def _names(kind: str) -> list[str]:
    return sorted(p.stem for p in (PROFILES_DIR / kind).glob("*.json"))


def model_profiles() -> list[str]:
    return _names("models")


def sweep_profiles() -> list[str]:
    return _names("sweeps")


def load_model_profile(name: str) -> dict:
    path = PROFILES_DIR / "models" / f"{name}.json"
    if not path.is_file():
        raise GmtoolError(
            f"unknown model {name!r}: give a profile ({', '.join(model_profiles())}), "
            "a local checkpoint directory, or a path to a config.json"
        )
    return json.loads(path.read_text())


def load_sweep_profile(name_or_path: str) -> dict:
    """A sweep profile (a name under profiles/sweeps or a path) as SweepConfig keyword arguments; an unknown key
    or a value of the wrong type is refused."""
    from gmtool.config import check_profile  # config imports model, which imports this module

    path = Path(name_or_path)
    if not path.is_file():
        path = PROFILES_DIR / "sweeps" / f"{name_or_path}.json"
    if not path.is_file():
        raise GmtoolError(f"unknown sweep profile {name_or_path!r}: choose from {', '.join(sweep_profiles())}")
    try:
        prof = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise GmtoolError(f"sweep profile {path} is not valid JSON: {e}") from None
    return check_profile(prof, str(path))
