"""GPU checks of the small-M GEMM (gmtool.kernels.small_m): against torch.matmul at every projection shape of
every built-in model profile (fused QKV, o_proj, fused gate/up, down) at M = 1, 8 and 32 in bf16; replayed in a
CUDA graph after its input is rewritten in place; and its weight bandwidth against cuBLAS at qwen3-0.6b's
shapes, printed (run with -s to see it; no timing is asserted: the machine is shared).
"""

import pytest
import torch

from gmtool.kernels.gemm_bench import model_timings, projection_shapes
from gmtool.profiles import load_model_profile, model_profiles

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEV = torch.device("cuda")
MS = (1, 8, 32)


def _randn(*shape, seed, scale=1.0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, generator=g, device=DEV) * scale).to(torch.bfloat16)


@pytest.mark.parametrize("model", model_profiles())
def test_small_m_matches_matmul_at_every_profile_shape(model):
    from gmtool.kernels.small_m import linear

    for name, (n, k, bias) in projection_shapes(load_model_profile(model)["config"]).items():
        w = _randn(n, k, seed=n + k, scale=k**-0.5)  # outputs of about unit size
        b = _randn(n, seed=n) if bias else None
        w32, b32 = w.float().t(), (b.float() if bias else 0)
        for m in MS:
            big = torch.full((m, k + 64), float("nan"), dtype=torch.bfloat16, device=DEV)
            big[:, :k] = _randn(m, k, seed=m)
            x = big[:, :k]  # a row stride past K, NaN between rows: reading past a row shows
            expect = torch.matmul(x.float(), w32) + b32
            out = linear(x, w, b)
            what = f"{model} {name} M={m} N={n} K={k} bias={bias}"
            assert out.dtype == torch.bfloat16 and out.shape == (m, n) and not out.isnan().any(), what
            torch.testing.assert_close(out.float(), expect, atol=2e-2, rtol=2e-2, msg=what)


def test_small_m_replays_in_a_graph():
    """Split-K (N=256 splits K: a partials buffer and the reduce kernel) and plain, captured once, replayed
    after x changes in place."""
    from gmtool.kernels.small_m import linear, pick

    sms = torch.cuda.get_device_properties(DEV).multi_processor_count
    assert pick(1, 256, 4096, sms).split > 1 and pick(1, 4096, 4096, sms).split == 1
    x = _randn(1, 4096, seed=1)
    ws = [_randn(n, 4096, seed=n, scale=4096**-0.5) for n in (256, 4096)]
    b = _randn(256, seed=3)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for w in ws:  # compiles the kernels outside the capture
            linear(x, w, b if w.shape[0] == 256 else None)
    stream.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        outs = [linear(x, w, b if w.shape[0] == 256 else None) for w in ws]
    for seed in (4, 5):
        x.copy_(_randn(1, 4096, seed=seed))
        graph.replay()
        torch.cuda.synchronize()
        for w, out in zip(ws, outs):
            expect = x.float() @ w.float().t() + (b.float() if w.shape[0] == 256 else 0)
            torch.testing.assert_close(out.float(), expect, atol=2e-2, rtol=2e-2)


def test_small_m_bandwidth_against_cublas(capsys):
    """Printed: weight TB/s of ours and of cuBLAS per qwen3-0.6b projection, and the 28-layer stack's sum."""
    rows = model_timings("qwen3-0.6b", MS)
    with capsys.disabled():
        print("\nsmall-M GEMM vs cuBLAS, qwen3-0.6b projections, bf16, CUDA graph, weights past L2")
        print(f"{'shape':8} {'M':>3} {'N':>5} {'K':>5}  {'ours us':>8} {'TB/s':>5}  {'cuBLAS us':>9} {'TB/s':>5}")
        for t in rows:
            print(
                f"{t.name:8} {t.m:3d} {t.n:5d} {t.k:5d}  {t.ours_us:8.2f} {t.ours_tbps:5.2f}  "
                f"{t.cublas_us:9.2f} {t.cublas_tbps:5.2f}"
            )
        for m in MS:
            ours = 28 * sum(t.ours_us for t in rows if t.m == m)
            theirs = 28 * sum(t.cublas_us for t in rows if t.m == m)
            print(f"28 layers at M={m}: ours {ours:.0f} us, cuBLAS {theirs:.0f} us ({theirs / ours:.2f}x)")
    assert all(t.ours_us > 0 and t.cublas_us > 0 for t in rows)
