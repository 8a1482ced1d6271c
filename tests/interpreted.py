"""Runs a test module's Triton kernel tests in a child pytest under the Triton interpreter, and checks that every
one of them ran and passed: a child that skipped them (triton missing, the interpreter not switched on) or
selected fewer of them than the module holds fails the parent test instead of passing quietly."""

from __future__ import annotations

import importlib.util
import os
import re
import subprocess
import sys
from types import ModuleType

import pytest

SELECT = "interp_"  # the child runs the tests whose names hold this (-k)
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"  # in the child
HAS_TRITON = importlib.util.find_spec("triton") is not None
interp_only = pytest.mark.skipif(not INTERPRETED, reason="runs in the TRITON_INTERPRET=1 child process")
needs_triton = pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
OK_OUTCOMES = {"passed", "deselected", "warning", "warnings"}


def expected_count(module: ModuleType, mark: pytest.MarkDecorator) -> int:
    """How many tests pytest collects from the module's functions that carry `mark` (the module's interp_only):
    one per combination of their parametrize lists."""
    n = 0
    for name, fn in vars(module).items():
        marks = getattr(fn, "pytestmark", [])
        if name.startswith("test") and callable(fn) and mark.mark in marks:
            combos = 1
            for m in marks:
                if m.name == "parametrize":
                    combos *= len(m.args[1])
            n += combos
    return n


def summary_counts(stdout: str) -> dict[str, int]:
    """pytest's last line ("15 passed, 21 deselected in 14.66s") as {"passed": 15, "deselected": 21}."""
    lines = [ln for ln in stdout.splitlines() if re.search(r"\bin [\d.]+s\b", ln)]
    assert lines, f"no pytest summary line in:\n{stdout[-3000:]}"
    return {word: int(n) for n, word in re.findall(r"(\d+) ([a-z]+)", lines[-1])}


def run_interpreted(module: ModuleType, mark: pytest.MarkDecorator, timeout: float = 900) -> dict[str, int]:
    path = module.__file__
    expected = expected_count(module, mark)
    assert expected > 0, f"no test in {path} carries the interpreter mark"
    env = {**os.environ, "TRITON_INTERPRET": "1", "TRITON_DEFAULT_FP_FUSION": "1"}
    cmd = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", path, "-k", SELECT]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout, check=False)
    log = r.stdout[-6000:] + r.stderr[-3000:]
    assert r.returncode == 0, log
    counts = summary_counts(r.stdout)
    assert counts.get("passed") == expected, f"{expected} interpreter tests expected to pass, got {counts}\n{log}"
    assert set(counts) <= OK_OUTCOMES, f"interpreter tests did not all run: {counts}\n{log}"
    return counts
