"""make mutants' list stays in step with the code on every CI run (a mutant whose text moved would only show
when someone ran the mutants): each mutant's old text occurs once in its file, and every test it names exists."""

from __future__ import annotations

import importlib.util
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _mutants():
    spec = importlib.util.spec_from_file_location("gmtool_mutants", ROOT / "tools" / "mutants.py")
    mod = sys.modules.setdefault("gmtool_mutants", importlib.util.module_from_spec(spec))
    if not hasattr(mod, "MUTANTS"):  # its dataclasses need the module registered while it runs
        spec.loader.exec_module(mod)
    return mod


def test_every_mutant_applies_once_to_the_file_it_names():
    mod = _mutants()
    assert mod.check_sync(mod.MUTANTS) == []
    assert len(mod.MUTANTS) >= 90


def test_every_test_a_mutant_names_exists():
    missing = []
    for m in _mutants().MUTANTS:
        for node in m.tests:
            path, _, name = node.partition("::")
            file = ROOT / path
            base = name.split("[")[0]
            if not file.is_file() or (base and not re.search(rf"^def {re.escape(base)}\(", file.read_text(), re.M)):
                missing.append(f"{m.id}: {node}")
    assert missing == []


def test_the_sync_check_fails_on_a_moved_text(tmp_path):
    mod = _mutants()
    m = mod.MUTANTS[0]
    (tmp_path / m.file).parent.mkdir(parents=True)
    (tmp_path / m.file).write_text("nothing of the old text")
    assert mod.check_sync([m], root=tmp_path) == [
        f"{m.id}: the old text occurs 0 times in {m.file} (must be exactly once)"
    ]
