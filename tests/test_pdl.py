"""Programmatic Dependent Launch (gmtool.kernels.pdl) on the CPU: what the PDL variants compile to for sm_90,
what they compute, and how --pdl is refused or falls back.

Compiled for Hopper (no GPU needed): every PDL variant holds griddepcontrol.wait before its first global memory
access (the rule that keeps PDL correct: what an earlier kernel wrote is read only after the wait), and the
small-M GEMM's weight prefetch comes before the wait; the plain variants hold no griddepcontrol at all.

Under the Triton interpreter (a child pytest with TRITON_INTERPRET=1, as tests/test_small_m.py runs): the
interpreter has neither griddepcontrol nor inline assembly, so the children's builder gets them as no-ops
(a kernel launched without PDL executes them as no-ops on the GPU too; a prefetch changes no value), the
prefetch recording its addresses. Every PDL variant must then give exactly the plain variant's numbers, and
the addresses must be the weight's own elements (no address past K) covering every 128-byte line it reads.
"""

from __future__ import annotations

import os
import re
import sys

import pytest
import torch

from tests.interpreted import INTERPRETED, HAS_TRITON, interp_only, run_interpreted

compiled_only = pytest.mark.skipif(INTERPRETED or not HAS_TRITON, reason="needs triton, not interpreted")

MODES = (0, 1, 2)  # gmtool.kernels.pdl.Pdl: OFF, AFTER_WAIT, EARLY
GLOBAL_ACCESS = re.compile(r"^\s*(@%p\d+\s+)?(ld\.global|st\.global|cp\.async|atom\.global|red\.global)", re.M)


# ---------------------------------------------------------------- compiled for sm_90


def _kernels():
    """(name, jit function, constexprs, pointer type of each *_ptr argument) for every PDL-aware kernel."""
    from gmtool.kernels import decode_attention as da, folded, kv_write as kw, layers, small_m

    gemm = dict(
        HAS_BIAS=True, PARTIAL=False, EVEN_K=True, BLOCK_M=16, BLOCK_N=16, BLOCK_K=256, PRECISION="tf32"
    ) | dict(PF_LINES=4, PF_STRIDE=64)
    split_gemm = gemm | dict(HAS_BIAS=False, PARTIAL=True, EVEN_K=False)
    dec = dict(NUM_HEADS=16, G=2, G_PAD=16, D=128, D_PAD=128, DV=128, DV_PAD=128, PAGE=16, BLOCK_N=64, PREC="tf32")
    feats = dict(WINDOW=0, SOFTCAP=0.0, SINKS=False)
    index = ("bt_ptr", "lens_ptr", "slot_ptr")

    def ptr(name, default="*bf16"):
        return "*i64" if name in index else "*fp32" if name in ("part_ptr", "lse_ptr") else default

    return [
        ("small_m", small_m._small_m_kernel, gemm, ptr),
        ("small_m split-K", small_m._small_m_kernel, split_gemm, lambda n: "*fp32" if n == "out_ptr" else "*bf16"),
        (
            "small_m folded norm",
            folded._norm_gemm_kernel,
            split_gemm | dict(X_SPLIT=4, X_BIAS=False, K_PAD=1024),
            lambda n: "*fp32" if n in ("x_ptr", "xb_ptr", "out_ptr") else "*bf16",
        ),
        (
            "split reduce",
            small_m._split_reduce_kernel,
            dict(SPLIT=4, HAS_BIAS=True, BLOCK=1024),
            lambda n: "*fp32" if n == "p_ptr" else "*bf16",
        ),
        ("rms_norm", layers._rms_norm_kernel, dict(H=1024, BLOCK=1024), ptr),
        ("add_rms_norm", layers._add_rms_norm_kernel, dict(H=1024, BLOCK=1024), ptr),
        ("qk_norm_rope", layers._qk_norm_rope_kernel, dict(HQ=16, HKV=8, HALF=64, HALF_PAD=64, NORM=True), ptr),
        (
            QK_ROWS,
            layers._qk_norm_rope_kernel,
            dict(HQ=16, HKV=8, HALF=64, HALF_PAD=64, NORM=True, PAGE=16, WRITE_KV=True, ROPE_ROWS=True),
            lambda n: "*i64" if n == "pos_ptr" else ptr(n),
        ),
        ("silu_mul", layers._silu_mul_kernel, dict(I=3072, BLOCK=1024), ptr),
        ("write_kv", kw._write_kv_kernel, dict(HKV=8, H_PAD=8, D=128, D_PAD=128, DV=128, DV_PAD=128, PAGE=16), ptr),
        ("decode split", da._decode_split_kernel, dec | feats | dict(SPLIT=True), ptr),
        (PRE_LENS_SPLIT, da._decode_split_kernel, dec | feats | dict(SPLIT=True, PRE_LENS=1), ptr),
        (
            "decode combine",
            da._combine_kernel,
            dict(NUM_HEADS=16, D=128, D_PAD=128, S_PAD=64, SINKS=False, WINDOW=0, BLOCK_N=64, DC=32),
            ptr,
        ),
    ]


PRE_LENS_SPLIT = "decode split, kv_lens before the wait"  # its one load of kv_lens (the step's input) comes first
# positions, slots, the RoPE table and the norm weights (no kernel writes them) read before the wait, after
# EARLY's trigger
QK_ROWS = "qk_norm_rope reading its RoPE rows"


def _ptx(jit_fn, consts, ptr):
    from gmtool.kernels.testing import compile_for_hopper

    def arg_type(name):
        if name.endswith("_ptr"):
            return ptr(name)
        return "fp32" if name in ("eps", "qk_scale", "scale") else "i32"

    return compile_for_hopper(jit_fn, consts, arg_type).asm["ptx"]


@compiled_only
@pytest.mark.parametrize("mode", MODES)
def test_pdl_variants_compile_for_hopper_and_wait_before_reading(mode):
    """Each kernel's PTX for sm_90 (triton's compiler and ptxas, no GPU): with PDL, griddepcontrol.wait before the
    first global load, store or async copy, and launch_dependents after the wait (before it in EARLY, except
    the GEMM's, which ends the cascade); the GEMM's prefetch before the wait. Off: no griddepcontrol, no prefetch,
    so the plain variants are the kernels as they were."""
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    for name, fn, consts, ptr in _kernels():
        ptx = _ptx(fn, consts | {"PDL": mode}, ptr)
        gemm = name.startswith("small_m")
        if mode == 0:
            assert "griddepcontrol" not in ptx and "prefetch" not in ptx, name
            continue
        wait, trigger = ptx.find("griddepcontrol.wait"), ptx.find("griddepcontrol.launch_dependents")
        assert wait >= 0 and trigger >= 0, f"{name}: no griddepcontrol in the PDL variant"
        before = [m.group(2) for m in GLOBAL_ACCESS.finditer(ptx[:wait])]
        if name == QK_ROWS:  # loads only (no store), and EARLY's trigger ahead of them all
            assert before and set(before) == {"ld.global"}, f"{name}: {before} before griddepcontrol.wait"
            first = GLOBAL_ACCESS.search(ptx).start()
            assert (trigger < first) == (mode == 2), f"{name}: EARLY's trigger behind the loads before the wait"
        else:
            allowed = ["ld.global"] if name == PRE_LENS_SPLIT else []
            assert before == allowed, f"{name}: global memory touched before griddepcontrol.wait: {before}"
        assert GLOBAL_ACCESS.search(ptx, wait) is not None, name
        assert (trigger < wait) == (mode == 2 and not gemm), f"{name}: launch_dependents on the wrong side of the wait"
        if gemm:
            prefetch = ptx.find("prefetch.global.L2")
            assert 0 <= prefetch < wait, f"{name}: the weight prefetch must come before the wait"
        else:
            assert "prefetch" not in ptx, name


@compiled_only
def test_plain_gemm_compiles_as_before_the_pdl_parameters():
    """PDL 0 (the default) with the prefetch constants at any value: the same PTX, so the non-PDL path of the
    small-M GEMM is the kernel it was (cp.async weight streaming included)."""
    from gmtool.kernels import small_m

    base = dict(HAS_BIAS=False, PARTIAL=False, EVEN_K=True, BLOCK_M=16, BLOCK_N=16, BLOCK_K=256, PRECISION="tf32")
    ptr = lambda n: "*bf16"  # noqa: E731
    plain = _ptx(small_m._small_m_kernel, base, ptr)
    assert plain == _ptx(small_m._small_m_kernel, base | dict(PDL=0, PF_LINES=4, PF_STRIDE=64), ptr)
    assert "cp.async.cg.shared.global" in plain


# ---------------------------------------------------------------- availability and options


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
def test_pdl_problem_says_why_not(monkeypatch):
    from gmtool.kernels import pdl

    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "interpreter" in pdl.problem(torch.device("cpu"))
    monkeypatch.delenv("TRITON_INTERPRET")
    assert "CUDA" in pdl.problem(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (8, 0))
    assert "sm_90" in pdl.problem(torch.device("cuda", 0))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))
    assert pdl.problem(torch.device("cuda", 0)) is None
    monkeypatch.setattr(pdl, "gdc_wait", None)
    assert "gdc_wait" in pdl.problem(torch.device("cuda", 0))
    assert pdl.launch_options(0) == {} and pdl.launch_options(pdl.Pdl.AFTER_WAIT) == {"launch_pdl": True}


def test_pdl_needs_the_small_m_gemm():
    from gmtool.config import SweepConfig
    from gmtool.errors import GmtoolError

    with pytest.raises(GmtoolError, match="needs small_m_gemm"):
        SweepConfig(device="cpu", fuse=True, pdl=True)
    assert SweepConfig(device="cpu", fuse=True, small_m_gemm=True, pdl=True).pdl


def test_pdl_falls_back_with_a_note_where_it_cannot_run():
    """On the CPU (torch ops, or triton without CUDA) --pdl runs the plain kernels and the run's notes say why."""
    from gmtool.config import SweepConfig
    from gmtool.measure.workbench import _pdl_mode

    notes = []
    cfg = SweepConfig(device="cpu", fuse=True, small_m_gemm=True, pdl=True)
    assert _pdl_mode(cfg, notes) == 0
    assert notes and notes[0].startswith("--pdl: off")
    assert _pdl_mode(SweepConfig(device="cpu", fuse=True, small_m_gemm=True), notes) == 0 and len(notes) == 1


def test_pdl_runs_the_early_mode_where_it_can(monkeypatch):
    """--pdl where PDL can run: EARLY (element-wise kernels let the next launch before their wait), no note."""
    pytest.importorskip("triton")
    from gmtool.config import SweepConfig
    from gmtool.kernels import pdl
    from gmtool.measure.workbench import _pdl_mode

    monkeypatch.setattr(pdl, "problem", lambda device=None: None)
    cfg = SweepConfig(device="cpu", fuse=True, small_m_gemm=True, pdl=True)
    cfg.attention_backend = "triton"  # as on a Hopper GPU
    notes = []
    assert _pdl_mode(cfg, notes) == pdl.Pdl.EARLY and notes == []


def test_fused_ops_pass_the_mode_on(monkeypatch):
    """LayerOps with pdl: the element-wise launchers get pdl=mode, the GEMM too, the attention runs in its scope,
    for steps the small-M GEMM serves; above them, and without pdl, nothing is passed (the plain launch)."""
    from gmtool.model import fused as fused_mod

    pytest.importorskip("triton")
    from gmtool.kernels import layers, pdl, small_m

    monkeypatch.setattr(fused_mod, "_triton_runs", lambda x: True)
    seen = []
    monkeypatch.setattr(small_m, "linear", lambda x, w, b=None, pdl=None: seen.append(pdl) or x)
    x = torch.zeros(2, 4)
    ops = fused_mod.LayerOps("triton", small_m=4, pdl=1)
    assert ops(x).silu_mul.keywords == {"pdl": 1} and ops(x).add_rms_norm.func is layers.add_rms_norm
    ops.linear(x, x)
    with ops.attention_launches(x):
        assert pdl.current() == pdl.Pdl.AFTER_WAIT
    assert pdl.current() == pdl.Pdl.OFF
    above = torch.zeros(1, 5, 4)  # 5 tokens, past small_m: cuBLAS's GEMMs, so no PDL launches either
    assert ops(above) is layers and ops.pdl_for(above) == 0
    with ops.attention_launches(above):
        assert pdl.current() == pdl.Pdl.OFF
    ops.pdl = 0
    assert ops(x) is layers
    ops.linear(x, x)
    assert seen == [1, None]
    with ops.attention_launches(x):
        assert pdl.current() == pdl.Pdl.OFF


@pytest.mark.skipif(not HAS_TRITON, reason="needs triton")
@pytest.mark.parametrize("mode,split_mode,combine_mode", [(0, 0, 0), (1, 1, 1), (2, 2, 1)])
def test_decode_combine_lets_the_next_kernel_launch_only_after_its_wait(monkeypatch, mode, split_mode, combine_mode):
    """Under EARLY the split kernel lets the combine launch before its wait, but the combine lets o_proj launch
    only after its own (measured faster: o_proj's prefetch off DRAM while the split reads K/V); both launch with
    PDL whenever the mode is on."""
    from gmtool.kernels import decode_attention as da
    from gmtool.kernels.testing import decode_case

    launched = {}

    class Recorder:
        def __init__(self, name):
            self.name = name

        def __getitem__(self, grid):
            return lambda *args, **kw: launched.__setitem__(self.name, (kw["PDL"], kw.get("launch_pdl", False)))

    monkeypatch.setattr(da, "_DECODE_SPLIT", Recorder("split"))
    monkeypatch.setattr(da, "_COMBINE", Recorder("combine"))
    case, q = decode_case([40, 7], num_slots=2, head_dim=32)
    da.decode_attention(q, case.k_cache, case.v_cache, case.block_tables, case.kv_lens_t, 0.2, num_splits=4, pdl=mode)
    assert launched == {"split": (split_mode, bool(mode)), "combine": (combine_mode, bool(mode))}


# ---------------------------------------------------------------- under the interpreter


@pytest.mark.skipif(INTERPRETED, reason="the child runs the tests itself")
def test_pdl_under_interpreter():
    """Every interp_only test of this module, run by the Triton interpreter in a child pytest: all must pass."""
    assert HAS_TRITON, "triton is not installed: pip install -e '.[test]' (the kernel interpreter tests need it)"
    run_interpreted(sys.modules[__name__], interp_only)


@pytest.fixture
def gdc_as_no_ops(monkeypatch):
    """griddepcontrol as no-ops (counted; the interpreter patches only triton.language's own builtins, so the
    gdc functions are replaced where gmtool.kernels.pdl.enter finds them) and the interpreter builder's inline asm
    as a recorded prefetch: returns (counts, prefetched addresses)."""
    import numpy as np
    import triton.language as tl
    from triton.runtime import interpreter

    from gmtool.kernels import pdl

    counts = {"wait": 0, "launch": 0}
    addresses = []

    class _Asm:
        def __init__(self, shape):
            self.shape = shape

        def get_result(self, i):
            return interpreter.TensorHandle(np.zeros(self.shape, dtype=np.int32), tl.int32)

    def inline_asm(self, asm, constraints, values, types, is_pure, pack):
        assert asm.startswith("prefetch.global.L2") and len(values) == 1, asm
        addresses.extend(int(a) for a in values[0].data.ravel())
        return _Asm(values[0].data.shape)

    monkeypatch.setattr(pdl, "gdc_wait", lambda: counts.__setitem__("wait", counts["wait"] + 1))
    monkeypatch.setattr(pdl, "gdc_launch_dependents", lambda: counts.__setitem__("launch", counts["launch"] + 1))
    monkeypatch.setattr(interpreter.InterpreterBuilder, "create_inline_asm", inline_asm)
    return counts, addresses


def _lines(t: torch.Tensor, cols: int) -> set[int]:
    """The 128-byte lines holding t[:, :cols] (t a row-strided 2-D view)."""
    rows = torch.arange(t.shape[0])[:, None] * t.stride(0) + torch.arange(cols)[None, :]
    return set(((t.data_ptr() + rows * t.element_size()) // 128).flatten().tolist())


@interp_only
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_interp_pdl_gemm_equals_plain_and_prefetches_its_weight(gdc_as_no_ops, dtype):
    """The small-M GEMM with PDL (AFTER_WAIT, EARLY) against PDL off: the same numbers (pick's blocks, a split-K
    of 3 with an uneven last slice and its reduce kernel, K not a multiple of BLOCK_K, BLOCK_K 64); every
    program waited;
    the prefetched addresses are W's elements, and cover every line of W the GEMM reads."""
    from gmtool.kernels.small_m import Config, linear

    counts, addresses = gdc_as_no_ops
    g = torch.Generator().manual_seed(0)
    for m, n, k in ((1, 40, 72), (3, 100, 300), (17, 33, 520)):
        x = torch.randn(m, k, generator=g).to(dtype)
        big = torch.full((n, k + 8), float("nan"), dtype=dtype)  # NaN past K: a read there shows
        big[:, :k] = torch.randn(n, k, generator=g).to(dtype) / k**0.5
        w = big[:, :k]
        # Config(16, 16, 64, 1): a row's last step ends inside a line no other step prefetches (the rows of W
        # start off a line), which only the step's last-element prefetch covers
        for cfg in (None, Config(32, 16, 32, 3), Config(32, 16, 64, 1)):
            addresses.clear()
            plain = linear(x, w, None, cfg)
            assert counts["wait"] == 0 and not addresses
            for mode in (1, 2):
                addresses.clear()
                got = linear(x, w, None, cfg, pdl=mode)
                assert torch.equal(got, plain), f"{(m, n, k)} {cfg} pdl={mode}"
                assert counts["wait"] > 0 and counts["launch"] > 0
                lo, hi = w.data_ptr(), w.data_ptr() + ((n - 1) * w.stride(0) + k) * w.element_size()
                assert all(lo <= a < hi and (a - lo) // w.element_size() % w.stride(0) < k for a in addresses)
                assert {a // 128 for a in addresses} >= _lines(w, k), "a weight line the GEMM reads was not prefetched"
                counts.update(wait=0, launch=0)


@interp_only
def test_interp_pdl_layer_and_attention_kernels_equal_plain(gdc_as_no_ops):
    """The element-wise kernels, the K/V write and decode attention (split and combine) with PDL: the plain
    variants' numbers exactly, every one having waited."""
    from gmtool.kernels import layers
    from gmtool.kernels.decode_attention import decode_attention
    from gmtool.kernels.kv_write import write_kv
    from gmtool.kernels.testing import decode_case

    counts, _ = gdc_as_no_ops
    g = torch.Generator().manual_seed(1)
    x, r, w = (torch.randn(3, 64, generator=g) for _ in range(3))
    w = w[0]
    qkv = torch.randn(3, (4 + 2 * 2) * 32, generator=g)
    cos, sin = torch.randn(3, 32, generator=g), torch.randn(3, 32, generator=g)
    qw, kw = torch.randn(32, generator=g), torch.randn(32, generator=g)
    runs = {
        "rms_norm": lambda p: layers.rms_norm(x, w, 1e-6, pdl=p),
        "add_rms_norm": lambda p: layers.add_rms_norm(x, r, w, 1e-6, pdl=p),
        "qk_norm_rope": lambda p: layers.qk_norm_rope(qkv, 4, 2, 32, cos, sin, qw, kw, 1e-6, pdl=p),
        "silu_mul": lambda p: layers.silu_mul(qkv, pdl=p),
    }
    case, q = decode_case([40, 7, 1], num_slots=4, head_dim=32)

    def attend(p):
        kc, vc = case.k_cache.clone(), case.v_cache.clone()
        write_kv(kc, vc, case.k_new, case.v_new, case.slot_mapping, pdl=p)
        out = decode_attention(q, kc, vc, case.block_tables, case.kv_lens_t, 0.2, num_splits=4, pdl=p)
        return out, kc, vc

    runs["write_kv + decode attention"] = attend
    for name, run in runs.items():
        plain = run(0)
        assert counts["wait"] == 0, name
        for mode in (1, 2):
            got = run(mode)
            for a, b in zip(got if isinstance(got, tuple) else (got,), plain if isinstance(plain, tuple) else (plain,)):
                assert torch.equal(a, b), f"{name} pdl={mode}"
            assert counts["wait"] > 0 and counts["launch"] > 0, name
            counts.update(wait=0, launch=0)


@interp_only
def test_interp_fused_step_with_pdl_equals_without(gdc_as_no_ops, monkeypatch):
    """A fused tiny-qwen3 decode step through LayerOps with PDL on: its kernels wait (and the GEMMs prefetch),
    and the logits are the plain step's exactly; off again, nothing waits."""
    from gmtool.model import fused as fused_mod

    from .helpers import Rig

    counts, addresses = gdc_as_no_ops
    monkeypatch.setattr(fused_mod, "_triton_runs", lambda x: True)
    rig = Rig()
    fused = fused_mod.fuse_layers(rig.lm.model, "triton", rig.lm.layout, small_m=4, pdl=1)
    assert "launched with PDL" in fused.summary
    decode = rig.batch("1*4", seed=1)
    on = rig.eager(decode)
    assert counts["wait"] > 0 and addresses
    fused.ops.pdl = 0
    counts.update(wait=0, launch=0)
    off = rig.eager(decode)
    assert counts["wait"] == 0 and "PDL" not in fused.summary
    assert torch.equal(on, off)
