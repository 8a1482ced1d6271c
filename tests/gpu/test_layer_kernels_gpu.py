"""GPU checks of the fused decoder-layer kernels against their torch references (gmtool.model.layers_ref) at the
shapes of the real models, on fresh random inputs given as strided views; and one CUDA graph holding all
three kernels, replayed after its inputs are rewritten in place.
"""

import pytest
import torch

from gmtool.model.layers_ref import add_rms_norm_ref, qk_norm_rope_ref, rms_norm_ref, silu_mul_ref

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEV = torch.device("cuda")
TOL = {torch.bfloat16: 2e-2, torch.float32: 1e-5}
DTYPES = [torch.bfloat16, torch.float32]
TOKENS = [1, 32, 512]
HQ, HKV, D, INTER, EPS = 16, 8, 128, 3072, 1e-6


def _randn(*shape, dtype, seed, scale=1.0, shift=0.0):
    g = torch.Generator(device=DEV).manual_seed(seed)
    return (torch.randn(*shape, generator=g, device=DEV) * scale + shift).to(dtype)


def _view(rows, cols, dtype, seed, scale=1.0):
    """[rows, cols] with a row stride of cols + 64, NaN between rows: reading past a row shows."""
    big = torch.full((rows, cols + 64), float("nan"), dtype=dtype, device=DEV)
    big[:, :cols] = _randn(rows, cols, dtype=dtype, seed=seed, scale=scale)
    return big[:, :cols]


def _cos_sin(tokens, dtype, seed):
    pos = torch.randint(0, 32768, (tokens,), device=DEV, generator=torch.Generator(device=DEV).manual_seed(seed))
    freqs = pos[:, None].double() * 1e6 ** (-torch.arange(0, D, 2, device=DEV, dtype=torch.float64) / D)
    emb = torch.cat((freqs, freqs), -1)
    return emb.cos().to(dtype), emb.sin().to(dtype)


def _check(out, expect, dtype, what):
    assert out.dtype == dtype and out.shape == expect.shape and out.is_contiguous(), what
    assert not out.isnan().any(), f"{what}: NaN (read outside a row, or a row left unwritten)"
    torch.testing.assert_close(out.float(), expect.float(), atol=TOL[dtype], rtol=TOL[dtype], msg=what)


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("hidden", [1024, 4096])
@pytest.mark.parametrize("dtype", DTYPES)
def test_rms_norm(tokens, hidden, dtype):
    from gmtool.kernels.layers import rms_norm

    x = _view(tokens, hidden, dtype, seed=tokens, scale=4.0)
    w = _randn(hidden, dtype=dtype, seed=hidden, scale=0.3, shift=1.0)
    _check(rms_norm(x, w, EPS), rms_norm_ref(x, w, EPS), dtype, f"rms_norm T={tokens} H={hidden}")


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("hidden", [1024, 4096])
@pytest.mark.parametrize("dtype", DTYPES)
def test_add_rms_norm(tokens, hidden, dtype):
    from gmtool.kernels.layers import add_rms_norm

    x = _view(tokens, hidden, dtype, seed=tokens, scale=4.0)
    r = _view(tokens, hidden, dtype, seed=tokens + 7, scale=8.0)
    w = _randn(hidden, dtype=dtype, seed=hidden, scale=0.3, shift=1.0)
    out, total = add_rms_norm(x, r, w, EPS)
    e_out, e_total = add_rms_norm_ref(x, r, w, EPS)
    assert torch.equal(total, e_total), "the residual sum is one rounding of x + r, as torch's add"
    _check(out, e_out, dtype, f"add_rms_norm T={tokens} H={hidden}")


def _qk_inputs(tokens, dtype, seed):
    qkv = _view(tokens, (HQ + 2 * HKV) * D, dtype, seed=seed, scale=2.0)
    qkv[:, (HQ + HKV) * D :] = float("nan")  # v: never read
    weights = [_randn(D, dtype=dtype, seed=seed + i, scale=0.3, shift=1.0) for i in (1, 2)]
    return qkv, *_cos_sin(tokens, dtype, seed), *weights


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("norm", [True, False])
@pytest.mark.parametrize("dtype", DTYPES)
def test_qk_norm_rope(tokens, norm, dtype):
    from gmtool.kernels.layers import qk_norm_rope

    qkv, cos, sin, qw, kw = _qk_inputs(tokens, dtype, seed=tokens)
    weights = (qw, kw) if norm else (None, None)
    q, k = qk_norm_rope(qkv, HQ, HKV, D, cos, sin, *weights, eps=EPS)
    eq, ek = qk_norm_rope_ref(qkv, HQ, HKV, D, cos, sin, *weights, eps=EPS)
    _check(q, eq, dtype, f"q T={tokens} norm={norm}")
    _check(k, ek, dtype, f"k T={tokens} norm={norm}")


@pytest.mark.parametrize("tokens", TOKENS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_silu_mul(tokens, dtype):
    from gmtool.kernels.layers import silu_mul

    x = _view(tokens, 2 * INTER, dtype, seed=tokens, scale=3.0)
    _check(silu_mul(x), silu_mul_ref(x), dtype, f"silu_mul T={tokens}")


def test_layer_kernels_graph_follows_inputs():
    """All four captured once at T=32; new inputs copied in place; each replay matches the references."""
    from gmtool.kernels.layers import add_rms_norm, qk_norm_rope, rms_norm, silu_mul

    tokens, hidden, dtype = 32, 1024, torch.bfloat16

    def inputs(seed):
        return {
            "x": _view(tokens, hidden, dtype, seed=seed),
            "w": _randn(hidden, dtype=dtype, seed=seed + 1),
            "r": _view(tokens, hidden, dtype, seed=seed + 4),
            "qk": _qk_inputs(tokens, dtype, seed=seed + 2),
            "gu": _view(tokens, 2 * INTER, dtype, seed=seed + 3),
        }

    bufs, outs = inputs(0), {}

    def step():
        outs["norm"] = rms_norm(bufs["x"], bufs["w"], EPS)
        outs["add_norm"], outs["sum"] = add_rms_norm(bufs["x"], bufs["r"], bufs["w"], EPS)
        outs["q"], outs["k"] = qk_norm_rope(bufs["qk"][0], HQ, HKV, D, *bufs["qk"][1:], eps=EPS)
        outs["act"] = silu_mul(bufs["gu"])

    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        step()  # compiles the kernels: nothing may compile inside capture
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        step()

    for seed in (10, 20):
        new = inputs(seed)
        for name in ("x", "w", "r", "gu"):
            bufs[name].copy_(new[name])
        for buf, src in zip(bufs["qk"], new["qk"]):
            buf.copy_(src)
        for out in outs.values():
            out.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        _check(outs["norm"], rms_norm_ref(new["x"], new["w"], EPS), dtype, f"replay {seed}: rms_norm")
        e_norm, e_sum = add_rms_norm_ref(new["x"], new["r"], new["w"], EPS)
        _check(outs["add_norm"], e_norm, dtype, f"replay {seed}: add_rms_norm")
        _check(outs["sum"], e_sum, dtype, f"replay {seed}: residual sum")
        eq, ek = qk_norm_rope_ref(new["qk"][0], HQ, HKV, D, *new["qk"][1:], eps=EPS)
        _check(outs["q"], eq, dtype, f"replay {seed}: q")
        _check(outs["k"], ek, dtype, f"replay {seed}: k")
        _check(outs["act"], silu_mul_ref(new["gu"]), dtype, f"replay {seed}: silu_mul")
