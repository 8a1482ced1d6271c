"""FastLaunch on the GPU (gmtool.kernels.launcher): each fused-layer kernel, its attention kernels and the small-M
GEMM called through their wrappers, once on Triton's own path and then on the direct one (a known variant), on
fresh inputs each time: the direct launches' outputs equal Triton's bit for bit, at aligned and misaligned
addresses (another variant), and the direct path was taken."""

import pytest
import torch

from gmtool.kernels import decode_attention as da
from gmtool.kernels import kv_write, launcher, layers, small_m

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEV = torch.device("cuda")
BF = torch.bfloat16
HQ, HKV, D, H, INTER, EPS = 16, 8, 128, 1024, 3072, 1e-6


def _r(*shape, seed, dtype=BF):
    return torch.randn(*shape, generator=torch.Generator(device=DEV).manual_seed(seed), device=DEV).to(dtype)


def _calls(seed: int, skew: int):
    """Each wrapper on fresh inputs; skew > 0 shifts the inputs' addresses by that many elements."""

    def off(t):
        if not skew:
            return t
        flat = torch.empty(t.numel() + skew, dtype=t.dtype, device=DEV)
        flat[skew:] = t.flatten()
        return flat[skew:].view(t.shape)

    t = 7
    x, r, w = off(_r(t, H, seed=seed)), off(_r(t, H, seed=seed + 1)), _r(H, seed=seed + 2)
    qkv = off(_r(t, (HQ + 2 * HKV) * D, seed=seed + 3))
    cos, sin = off(_r(t, D, seed=seed + 4)), off(_r(t, D, seed=seed + 5))
    qn, kn = _r(D, seed=seed + 6), _r(D, seed=seed + 7)
    gu = off(_r(t, 2 * INTER, seed=seed + 8))
    wt = _r(2 * H, H, seed=seed + 9)
    blocks, page = 64, 16
    kc, vc = _r(blocks, page, HKV, D, seed=seed + 10), _r(blocks, page, HKV, D, seed=seed + 11)
    k, v = _r(t, HKV, D, seed=seed + 12), _r(t, HKV, D, seed=seed + 13)
    g = torch.Generator(device=DEV).manual_seed(seed)
    slots = torch.randperm(blocks * page - page, device=DEV, generator=g)[:t] + page
    q = _r(4, HQ, D, seed=seed + 14)
    tables = torch.arange(1, 61, device=DEV, dtype=torch.int64).view(4, 15)
    lens = torch.tensor([1, 40, 200, 240], device=DEV, dtype=torch.int64)
    out = {
        "rms_norm": layers.rms_norm(x, w, EPS),
        "add_rms_norm": torch.cat(layers.add_rms_norm(x, r, w, EPS)),
        "qk_norm_rope": torch.cat([a.flatten() for a in layers.qk_norm_rope(qkv, HQ, HKV, D, cos, sin, qn, kn, EPS)]),
        "silu_mul": layers.silu_mul(gu),
        "small_m": small_m.linear(x, wt),
        "small_m_1": small_m.linear(x[:1], wt),
    }
    kv_write.write_kv(kc, vc, k, v, slots)
    out["write_kv"] = torch.cat([kc.flatten(), vc.flatten()])
    out["decode"] = da.decode_attention(q, kc, vc, tables, lens, D**-0.5)
    return out


@pytest.mark.parametrize("skew", [0, 1])
def test_direct_launches_equal_triton_s_bit_for_bit(monkeypatch, skew):
    _calls(0, skew)  # first calls: through Triton, variants kept
    direct = _calls(100, skew)
    monkeypatch.setattr(launcher.FastLaunch, "_direct_allowed", lambda self: False)
    via_triton = _calls(100, skew)
    torch.cuda.synchronize()
    for name, got in direct.items():
        assert torch.equal(got, via_triton[name]), name
    fast = [layers._RMS_NORM, layers._ADD_RMS_NORM, layers._QK_NORM_ROPE, layers._SILU_MUL, kv_write._WRITE_KV]
    fast += [da._DECODE_SPLIT, small_m._SMALL_M]
    assert all(f.path == launcher.DIRECT for f in fast), [f.path for f in fast]


def test_kernels_first_launched_in_compile_ahead_s_pass_launch_directly_after_it(monkeypatch, tmp_path):
    """The usual cold start: an executor's first capture runs compile-ahead's pass, where each kernel's first
    launch in the process happens under the pass's stand-in for Triton's run. After it, the fused layers'
    kernels launch directly (the review of 2026-12-01 found them on Triton's path for good), and the captured
    graphs replay like eager."""
    from gmtool.core.batch import make_batch
    from gmtool.core.compositions import parse_composition
    from gmtool.kernels import compile_marker
    from gmtool.measure import bench
    from gmtool.measure.timing import rel_err_per_seq

    fresh = {
        (layers, "_RMS_NORM"): layers._rms_norm_kernel,
        (layers, "_ADD_RMS_NORM"): layers._add_rms_norm_kernel,
        (layers, "_QK_NORM_ROPE"): layers._qk_norm_rope_kernel,
        (layers, "_SILU_MUL"): layers._silu_mul_kernel,
        (da, "_DECODE_SPLIT"): da._decode_split_kernel,
    }  # no write_kv: the fused QK-norm + RoPE kernel writes the cache
    for (module, name), kernel in fresh.items():  # not set up yet: their first launch is the pass's
        monkeypatch.setattr(module, name, launcher.FastLaunch(kernel))
    monkeypatch.setattr(compile_marker, "triton_cache_dir", lambda: tmp_path)  # no marker: the pass runs
    monkeypatch.delenv("GMTOOL_COMPILE_AHEAD", raising=False)
    ex = bench._executor([1, 8], 1024, 64 * 16 + 1, fuse=True)
    batch = make_batch(parse_composition("1*8", seed=3), ex.cache, ex.lm.vocab_size, 8)
    ex.capture(ex.key_for(batch), batch)
    assert ex.compile_ahead_s is not None, ex.compile_ahead_note
    eager = ex.eager_same_shape(batch).clone()  # an eager forward after the pass: known variants go direct
    paths = {name: getattr(module, name).path for module, name in fresh}
    assert all(p == launcher.DIRECT for p in paths.values()), paths
    assert rel_err_per_seq(ex.step(batch), eager) < 2e-2
    ex.release()


_COLD_CAPTURE = """
import json, sys
from gmtool.core.batch import make_batch
from gmtool.core.compositions import parse_composition
from gmtool.kernels import compile_ahead
from gmtool.measure import bench
buckets = [1, 8, 64, 256]
fuse = sys.argv[1] == "fuse"
with compile_ahead.compile_log() as built:  # the decode attention's kernels compile during the build
    ex = bench._executor(buckets, 1024, 256 * 64 + 1, fuse=fuse)
with compile_ahead.compile_log() as log:
    for b in sorted(buckets, reverse=True):
        batch = make_batch(parse_composition(f"1*{b}", seed=b), ex.cache, ex.lm.vocab_size, 256)
        ex.capture(ex.key_for(batch), batch)
early = ex.lm.early_compile
print(json.dumps({"built": built.summary(), "log": log.summary(), "ahead_s": ex.compile_ahead_s,
                  "note": ex.compile_ahead_note, "early": None if early is None else [early.launches, early.error]}))
"""


def _cold_capture(tmp_path, fuse: bool) -> dict:
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    root = str(Path(__file__).resolve().parents[2])
    env = {**os.environ, "TRITON_CACHE_DIR": str(tmp_path / "triton"), "PYTHONPATH": root}
    env.pop("GMTOOL_COMPILE_AHEAD", None)
    args = [sys.executable, "-c", _COLD_CAPTURE, "fuse" if fuse else "hf"]
    run = subprocess.run(args, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_a_cold_capture_compiles_every_variant_in_compile_ahead_s_pass(tmp_path):
    """On an empty Triton cache, in a fresh process: the decode buckets 256, 64, 8 and 1 launch different decode
    split and combine variants (on an H200, 1 shares its heads' dims out, 8 and 64 do not); every one of them
    compiles during the build (gmtool.kernels.early_compile: the decode attention's) or in the pass (the fused
    layers'), none inside a capture (a compile there is timed: CompileLog's compile_s and untimed)."""
    doc = _cold_capture(tmp_path, fuse=True)
    assert doc["ahead_s"] is not None, doc["note"]
    built, log = doc["built"], doc["log"]
    assert log["compiles"] >= 4 and log["untimed"] == log["compiles"], log  # the fused layers' kernels
    assert "_decode_split_kernel" not in log["kernels"], log  # compiled during the build, not again
    assert built["untimed"] == built["compiles"] and "_decode_split_kernel" in built["kernels"], built
    assert doc["early"][0] > 0 and doc["early"][1] is None, doc["early"]
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    if 64 <= sms < 512:  # 16 heads: a program per 32 dims at B=1 (64 programs), whole heads at 8 and 64
        assert built["kernels"]["_combine_kernel"]["variants"] == 2, built


def test_the_hf_layers_decode_kernels_compile_during_the_build_and_none_after_it(tmp_path):
    """The model's own layers launch only the attention's Triton kernels: each variant the captures need was
    guessed from the config and compiled while the model was built, so the pass and the captures compile
    nothing (a wrong guess would compile there)."""
    doc = _cold_capture(tmp_path, fuse=False)
    built, log = doc["built"], doc["log"]
    assert log["compiles"] == 0, log
    assert {"_write_kv_kernel", "_decode_split_kernel", "_combine_kernel"} <= set(built["kernels"]), built
    assert doc["early"][1] is None, doc["early"]
