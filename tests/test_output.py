"""Output people read: tables that fit 80 columns (columns dropped by priority, never a number cut to '0.…'), a
legend and a verdict line, the noise marks in capture as in compare, one progress line per bucket when stdout is
not a terminal, one colour per mode in every plot, and --format human|json|quiet on every command."""
from __future__ import annotations

import io
import json
import re

import pytest
from rich.console import Console

from gmtool.report.results import output_dir
from tests.test_report import make_doc


def test_a_failed_default_run_leaves_no_gmtool_out_behind(tmp_path, monkeypatch):
    """The default --out is gmtool-out/<command>-...: a run that fails first leaves neither directory."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(RuntimeError):
        with output_dir(tmp_path / "gmtool-out" / "capture-1", force=False):
            raise RuntimeError("refused before writing")
    assert list(tmp_path.iterdir()) == []
    (tmp_path / "gmtool-out").mkdir()
    (tmp_path / "gmtool-out" / "older-run").mkdir()
    with pytest.raises(RuntimeError):
        with output_dir(tmp_path / "gmtool-out" / "capture-2", force=False):
            raise RuntimeError("refused before writing")
    assert [p.name for p in (tmp_path / "gmtool-out").iterdir()] == ["older-run"]  # not created by this run
