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


BOUND = r"""
import os, sys, torch
os.environ["TRITON_INTERPRET"] = "1"
import gmtool.kernels as K
K.available = lambda: True
from gmtool.model.attention import forward_context
from tests.helpers import Rig, rel
tri, worst, paths = K.TritonAttention(), 0.0, set()
cases = [(False, (8,), ["1*8", "1*5"]), (True, (32,), ["16+16", "20+12@64"])]
cases.append((False, (128,), ["100+28", "8*4", "30+2@40"]))  # planned: 2 query tiles, then 1
for wide, buckets, comps in cases:
    rig = Rig(wide_key=wide, buckets=buckets)
    rig.ex.attention = tri
    ex, lm, bound = rig.ex, rig.lm, None
    for i, t in enumerate(comps):  # one bucket per case: the binding is made once and serves every mix
        b = rig.batch(t, seed=i)
        ex.eager_same_shape(b)  # loads the batch and writes its K/V into the cache
        key = ex.key_for(b)
        ctx = ctx if bound is not None else ex._context(key, ex.inputs.load(b, key), b)
        ctx.prepare(b.plan)
        g = torch.Generator().manual_seed(i)
        q = torch.randn(key.num_tokens, lm.rank_heads, lm.head_dim, generator=g)
        if bound is None:
            q_buf, out = q.clone(), torch.zeros(key.num_tokens, lm.rank_heads, ex.cache.spec.v_dim)
            bound = ctx.bind(0, q_buf, 0.125, out)
        q_buf.copy_(q)
        with forward_context(ctx):
            want = ctx.attend_cached(0, q, 0.125)
            bound()
        n = int(b.cu_q[-1]) if not b.is_decode else b.num_seqs
        worst = max(worst, rel(out[:n].flatten(1), want[:n].flatten(1)))
        paths |= set(bound.paths)
from gmtool.kernels.kv_write import write_kv  # FX runners' own K/V write, bound the same way
kc, vc = torch.zeros(6, 4, 2, 16), torch.zeros(6, 4, 2, 8)
k, v, slots = torch.randn(5, 2, 16), torch.randn(5, 2, 8), torch.tensor([9, 3, -1, 22, 4])
write = tri.bind_write_kv(kc, vc, k, v, slots)
write()
want_k, want_v = torch.zeros_like(kc), torch.zeros_like(vc)
write_kv(want_k, want_v, k, v, slots)
worst = max(worst, float((kc - want_k).abs().max()), float((vc - want_v).abs().max()), float(kc.abs().sum() == 0))
paths |= set(write.paths)
print("WORST", worst, "PATHS", paths)
sys.exit(0 if worst < 1e-5 and len(paths) == 1 and "interpreter" in paths.pop() else 1)
"""


def test_bound_runner_launches_match_the_eager_op_under_the_interpreter():
    """A runner's bound launches (gmtool.kernels.launcher) through the real kernels, interpreted: the same
    result as the eager op for every mix of the bucket it was bound in, and the direct path off (the path names
    the interpreter)."""
    assert importlib.util.find_spec("triton"), "triton is not installed: pip install -e '.[test]'"
    root = Path(__file__).resolve().parent.parent
    env = dict(os.environ, PYTHONPATH=str(root), TRITON_INTERPRET="1")
    p = subprocess.run([sys.executable, "-c", BOUND], cwd=root, env=env, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-2000:]
    assert "interpreter" in p.stdout
