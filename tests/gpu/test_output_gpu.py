"""memreport's --format on a GPU (it refuses the CPU): json prints memreport.json alone on stdout, quiet the
verdict line alone, human the table, a progress line per bucket, and the verdict last."""

from __future__ import annotations

import json

import pytest
import torch

from tests.test_compare import run_cli

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

MEM = [
    "memreport",
    "--model",
    "tiny-qwen3",
    "--device",
    "cuda",
    "--buckets",
    "1,2",
    "--strategies",
    "independent,shared",
    "--num-iters",
    "2",
    "--num-iters-warmup",
    "1",
]


def test_memreport_formats(tmp_path):
    code, stdout, stderr = run_cli(*MEM, "--format", "json", "--out", tmp_path / "j")
    assert code == 0, stderr
    assert json.loads(stdout) == json.loads((tmp_path / "j" / "memreport.json").read_text())
    code, stdout, stderr = run_cli(*MEM, "--format", "quiet", "--out", tmp_path / "q")
    assert code == 0, stderr
    assert stdout.splitlines() == ["verdict: 2 ok, 0 UNSAFE, 0 errors (2 strategies)"]
    code, stdout, stderr = run_cli(*MEM, "--out", tmp_path / "h")
    assert code == 0, stderr
    assert stdout.rstrip().splitlines()[-1] == "verdict: 2 ok, 0 UNSAFE, 0 errors (2 strategies)"
    assert "memreport independent: bucket 1 done" in stdout  # not a terminal: a progress line per bucket
