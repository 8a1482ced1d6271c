"""GMTOOL_COMPILE_PROCESSES on the GPU: in a fresh process with an empty Triton cache, compile-ahead's pass hands
every compile to the worker processes (waited for until ready, so the count is not a race), and the --fuse
graphs captured after it replay as the same shapes run eagerly."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

CHILD = r"""
import json, time, torch
from gmtool.core.batch import make_batch
from gmtool.core.compositions import parse_composition
from gmtool.kernels import compile_workers
from gmtool.measure import bench
from gmtool.measure.timing import rel_err_per_seq

ex = bench._executor([1, 8, 64], 1024, 64 * 64 + 1, fuse=True)
workers = compile_workers.running()
deadline = time.monotonic() + 120
while workers.ready < len(workers.workers) and time.monotonic() < deadline:
    time.sleep(0.05)
worst = 0.0
for b in (64, 8, 1):
    batch = make_batch(parse_composition(f"1*{b}", seed=b), ex.cache, ex.lm.vocab_size, 256)
    ex.capture(ex.key_for(batch), batch)
for b in (1, 8, 64):
    batch = make_batch(parse_composition(f"1*{b}", seed=b + 1), ex.cache, ex.lm.vocab_size, 256)
    got = ex.step(batch).float().clone()
    want = ex.eager_same_shape(batch).float()
    worst = max(worst, rel_err_per_seq(got, want))
print(json.dumps({"stats": workers.stats.__dict__, "worst": worst, "pass_s": ex.compile_ahead_s,
                  "note": ex.compile_ahead_note}))
"""


def test_the_pass_compiles_in_worker_processes_and_the_graphs_replay_as_eager(tmp_path):
    root = Path(__file__).resolve().parents[2]
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path), GMTOOL_COMPILE_PROCESSES="4", PYTHONPATH=str(root))
    p = subprocess.run([sys.executable, "-c", CHILD], cwd=root, env=env, capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout.strip().splitlines()[-1])
    stats = out["stats"]
    assert out["note"] is None and out["pass_s"] is not None
    assert stats["jobs"] >= 5 and stats["in_workers"] == stats["jobs"], stats
    assert out["worst"] < 2e-2, out
