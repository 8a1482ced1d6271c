"""The executor's Triton attention path (decode, masked, planned), run by Triton's CPU interpreter against the
torch reference. The tape backend cannot record Triton launches, so this checks the eager same-shape pass."""

import importlib.util
import os
import subprocess
import sys
from pathlib import Path

SCRIPT = r"""
import os, sys
os.environ["TRITON_INTERPRET"] = "1"
import gmtool.kernels as K
K.available = lambda: True  # the interpreter runs the kernels on CPU tensors
from tests.helpers import Rig, rel
tri, calls = K.TritonAttention(), {}
for name in ("decode", "masked", "planned"):  # count each path: no silent fallback to the reference
    run = getattr(tri, name)
    setattr(tri, name, lambda *a, run=run, name=name, **k: (calls.__setitem__(name, calls.get(name, 0) + 1), run(*a, **k))[1])
worst = 0.0
for wide, comps in [(False, ["1*8", "1*5"]), (True, ["16+16", "20+12@64"]), (False, ["16+16", "8*4"])]:
    rig = Rig(wide_key=wide)
    rig.ex.attention = tri
    for i, t in enumerate(comps):
        b = rig.batch(t, seed=i)
        worst = max(worst, rel(rig.ex.eager_same_shape(b).clone(), rig.eager(b)))
print("WORST", worst, "CALLS", calls)
sys.exit(0 if worst < 1e-5 and all(calls.get(n, 0) > 0 for n in ("decode", "masked", "planned")) else 1)
"""


def test_triton_attention_path_matches_torch_reference():
    assert importlib.util.find_spec("triton"), "triton is not installed: pip install -e '.[test]'"
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(root), TRITON_INTERPRET="1")
    p = subprocess.run([sys.executable, "-c", SCRIPT], cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "WORST" in p.stdout
