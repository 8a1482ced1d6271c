"""The README's examples hold on the CPU: the ones it says run there get through the options and the config as
written (the run itself is stubbed: tests/test_cli_capture.py runs real captures), and --compile, which needs
CUDA, is refused before any model is built."""

import re
import shlex
import sys
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gmtool.cli.main import app, main

README = Path(__file__).resolve().parents[1] / "README.md"


def cpu_examples() -> list[list[str]]:
    """The commands of the first bash block of ## Commands: the ones the README says run as written on the CPU."""
    section = README.read_text().split("\n## Commands\n", 1)[1]
    block = re.search(r"```bash\n(.*?)```", section, re.S).group(1)
    return [shlex.split(line, comments=True)[1:] for line in block.splitlines() if line.startswith("gmtool ")]


class Configured(Exception):
    """Raised by the stubbed run: the command got as far as running, with this config."""


def test_the_readme_names_cpu_examples_of_every_command():
    assert {argv[0] for argv in cpu_examples()} == {"capture", "compare", "report"}


@pytest.mark.parametrize("argv", [a for a in cpu_examples() if a[0] != "report"], ids=" ".join)
def test_a_cpu_example_is_accepted_as_written(argv, monkeypatch, tmp_path):
    def run(cfg, *args, **kwargs):
        raise Configured(cfg)

    monkeypatch.setattr("gmtool.cli.capture.run_capture", run)
    monkeypatch.setattr("gmtool.cli.compare.run_compare", run)
    monkeypatch.chdir(tmp_path)  # the default output directory lands here
    r = CliRunner().invoke(app, argv)
    assert isinstance(r.exception, Configured), (r.output, r.exception)
    cfg = r.exception.args[0]
    if cfg.torch_device.type == "cpu":
        assert cfg.model == "tiny-qwen3"


def test_report_examples_read_what_an_earlier_example_wrote():
    examples = cpu_examples()
    for i, argv in enumerate(examples):
        if argv[0] == "report":
            outs = [a[a.index("--out") + 1] for a in examples[:i] if "--out" in a]
            assert argv[1] in outs, argv


def test_compile_on_the_cpu_is_refused_up_front(tmp_path, monkeypatch, capsys):
    out = tmp_path / "o"
    monkeypatch.setattr(sys, "argv", ["gmtool", "capture", "--device", "cpu", "--compile", "--out", str(out)])
    with pytest.raises(SystemExit) as e:
        main()
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert e.value.code == 2 and len(lines) == 1 and "--compile needs CUDA" in lines[0], lines
    assert not out.exists()
