"""GPU checks of the per-layer attention features: the Triton kernels against the dense float64 reference for each
feature (bf16, production head dims and windows), the window's bytes (only its pages are read: a long sequence
costs no more than a window-long one), and gmtool compare of eager, full and piecewise on the tiny feature
profiles with decode and prefill mixes."""

from __future__ import annotations

import json

import pytest
import torch

from gmtool.model.attention import LayerOpts
from gmtool.kernels.testing import make_case
from tests.test_attention_features import dense
from tests.test_compare import run_cli

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]
DEV = "cuda"
SCALE = 0.3  # tests.test_attention_features.dense scales by its own SCALE: keep them equal
BS = 16


def _case(q_lens, kv_lens, dk=128, dv=128, kv_heads=4, group=2, seed=0):
    case = make_case(
        q_lens,
        kv_lens,
        kv_heads=kv_heads,
        group=group,
        head_dim=dk,
        block_size=BS,
        dtype=torch.bfloat16,
        device=DEV,
        seed=seed,
    )
    if dv != dk:
        g = torch.Generator(device=DEV).manual_seed(seed + 5)
        case.v_cache = torch.randn(*case.k_cache.shape[:3], dv, generator=g, device=DEV).to(torch.bfloat16)
    return case


def _expected(case, opts: LayerOpts) -> torch.Tensor:
    out, t = [], 0
    sinks = None if opts.sinks is None else opts.sinks.cpu()
    cpu = LayerOpts(opts.window, opts.softcap, sinks)
    for i, (ql, kl) in enumerate(zip(case.q_lens, case.kv_lens)):
        nb = -(-kl // BS)
        k = case.k_cache[case.block_tables[i, :nb]].flatten(0, 1)[:kl].cpu()
        v = case.v_cache[case.block_tables[i, :nb]].flatten(0, 1)[:kl].cpu()
        out.append(dense(case.q[t : t + ql].cpu(), k, v, torch.arange(kl - ql, kl), cpu))
        t += ql
    return torch.cat(out)


def _opts(name: str) -> tuple[LayerOpts, int, int]:
    opts, dk, dv = FEATURES[name]
    sinks = None if opts.sinks is None else opts.sinks.to(DEV)
    return LayerOpts(opts.window, opts.softcap, sinks), dk, dv


FEATURES = {
    "gemma2-sliding-softcap": (LayerOpts(window=4096, softcap=50.0), 256, 256),
    "gpt-oss-sliding-sinks": (LayerOpts(window=128, sinks=torch.linspace(-2, 3, 8)), 64, 64),  # moved to DEV in _opts
    "mla-unequal-dims": (LayerOpts(), 192, 128),
}
LENS = [1, 127, 128, 129, 4095, 4096, 4097, 9000]  # both windows' edges, and far past them


@pytest.mark.parametrize("name", FEATURES)
def test_decode_kernel_features(name):
    from gmtool.kernels.decode_attention import decode_attention

    opts, dk, dv = _opts(name)
    case = _case([1] * len(LENS), LENS, dk=dk, dv=dv)
    got = decode_attention(
        case.q,
        case.k_cache,
        case.v_cache,
        case.block_tables,
        case.kv_lens_t,
        SCALE,
        window=opts.window,
        softcap=opts.softcap,
        sinks=opts.sinks,
    )
    torch.testing.assert_close(got.double().cpu(), _expected(case, opts), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("name", FEATURES)
def test_varlen_kernel_features(name):
    from gmtool.kernels.prefill_attention import varlen_attention, varlen_attention_wide

    opts, dk, dv = _opts(name)
    q_lens, kv_lens = [200, 1, 64, 300], [4200, 130, 64, 5000]  # chunks across the windows, a decode, a prompt
    case = _case(q_lens, kv_lens, dk=dk, dv=dv)
    want = _expected(case, opts)
    kw = dict(window=opts.window, softcap=opts.softcap, sinks=opts.sinks)
    wide = varlen_attention_wide(
        case.q, case.k_cache, case.v_cache, case.cu_q, case.kv_lens_t, case.block_tables, case.num_seqs, SCALE, **kw
    )
    planned = varlen_attention(
        case.q,
        case.k_cache,
        case.v_cache,
        case.cu_q,
        case.kv_lens_t,
        case.block_tables,
        case.num_seqs,
        max(q_lens),
        SCALE,
        **kw,
    )
    for got in (wide, planned):
        torch.testing.assert_close(got.double().cpu(), want, atol=2e-2, rtol=2e-2)


def test_sliding_decode_reads_only_the_window():
    """gemma-2-2b shapes: kv 32768 with a 4096 window takes about the time of kv 4096 without one (only the
    window's pages are read), and far less than kv 32768 without one."""
    from gmtool.kernels.decode_attention import decode_attention

    def ms(kv, window):
        case = _case([1] * 32, [kv] * 32, dk=256, dv=256, kv_heads=4, group=2)

        def fn():
            return decode_attention(
                case.q, case.k_cache, case.v_cache, case.block_tables, case.kv_lens_t, SCALE, window=window
            )

        fn()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(20):
            fn()
        end.record()
        torch.cuda.synchronize()
        return start.elapsed_time(end) / 20

    windowed, short, full = ms(32768, 4096), ms(4096, None), ms(32768, None)
    print(f"decode 32 x kv 32768: window 4096 {windowed:.3f} ms, full {full:.3f} ms; kv 4096 full {short:.3f} ms")
    assert windowed < 1.5 * short and windowed < full / 3


@pytest.mark.parametrize("model", ["tiny-gemma2", "tiny-gpt-oss", "tiny-deepseek-v2"])
def test_compare_feature_profiles(model, tmp_path):
    """Decode and prefill mixes across the tiny profiles' windows (16 and 24 tokens): every replay equals eager."""
    for scenario, buckets, comps in (("decode", "1,8", "1@40,1*8@100"), ("prefill", "64", "1*48,2*16+8@40,1@30+20@70")):
        code, stdout, stderr = run_cli(
            "compare",
            "eager,full,piecewise",
            "--model",
            model,
            "--device",
            "cuda",
            "--scenario",
            scenario,
            "--buckets",
            buckets,
            "--compositions",
            comps,
            "--max-kv-len",
            "256",
            "--num-iters",
            "3",
            "--num-iters-warmup",
            "1",
            "--format",
            "json",
            "--out",
            tmp_path / scenario,
        )
        assert code == 0, stderr
        doc = json.loads(stdout)
        assert doc["records"] and all(r["status"] == "ok" for r in doc["records"]), [
            (r["mode"], r["composition"], r["status"], r.get("max_rel_err")) for r in doc["records"]
        ]
