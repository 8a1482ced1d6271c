"""gmtool as installed: the built-in profiles travel with the package, and the shell completion options exist.
(make test-wheel builds the real wheel and runs it; these are the fast checks.)"""

import os
import shutil
import subprocess
import sys
import tomllib
from fnmatch import fnmatch
from pathlib import Path

from typer.testing import CliRunner

from gmtool.cli.main import app

ROOT = Path(__file__).resolve().parents[1]


def test_profiles_resolve_from_an_installed_package(tmp_path):
    """The package copied alone, as a wheel lays it out (the link followed): no repository root on the path or
    as the working directory, and the built-in names are still found."""
    site = tmp_path / "site"
    shutil.copytree(ROOT / "gmtool", site / "gmtool", ignore=shutil.ignore_patterns("__pycache__"))
    code = (
        "import gmtool, gmtool.profiles as p; print(gmtool.__file__); print(','.join(p.model_profiles())); "
        "print(','.join(p.sweep_profiles())); print(p.load_model_profile('tiny-qwen3')['config']['model_type'])"
    )
    r = subprocess.run(
        [sys.executable, "-c", code],
        cwd=tmp_path,
        env={"PYTHONPATH": str(site)},
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert r.returncode == 0, r.stderr
    where, models, sweeps, model_type = r.stdout.split()
    assert Path(where).is_relative_to(site)  # the copy was imported, not the tree
    assert {"tiny-qwen3", "qwen3-0.6b"} <= set(models.split(",")) and "smoke" in sweeps.split(",")
    assert model_type == "qwen3"


def test_the_wheel_takes_every_profile():
    """pyproject's package data covers every file under profiles/ (through gmtool/builtin_profiles): the model and
    sweep profiles and plan's built-in workloads, which a pip-installed gmtool otherwise lists as none."""
    globs = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["gmtool"]
    builtin = ROOT / "gmtool/builtin_profiles"
    files = [p.relative_to(ROOT / "gmtool").as_posix() for p in builtin.rglob("*") if p.is_file()]
    kinds = {f.split("/")[1] for f in files}
    assert len(files) >= 10 and kinds == {"models", "sweeps", "workloads"}
    missed = [f for f in files if not any(fnmatch(f, g) for g in globs)]
    assert not missed, f"left out of the wheel: {missed}"
    assert (ROOT / "gmtool/builtin_profiles").resolve() == (ROOT / "profiles").resolve()


def test_shell_completion_is_offered_and_completes():
    r = CliRunner().invoke(app, ["--help"])
    assert r.exit_code == 0 and "--install-completion" in r.output and "--show-completion" in r.output
    # what the installed bash script asks: the words so far, and gmtool answers with the completions
    env = {**os.environ, "_GMTOOL_COMPLETE": "complete_bash", "COMP_WORDS": "gmtool capture --scen", "COMP_CWORD": "2"}
    r = subprocess.run([sys.executable, "-m", "gmtool"], env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode == 0 and r.stdout.split() == ["--scenario"], (r.stdout, r.stderr)
