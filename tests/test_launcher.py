"""Bound Triton launches (gmtool.kernels.launcher) on the CPU: a fake kernel stands in for Triton's JITFunction
and the CompiledKernel it returns, so the launcher's logic runs without a GPU. First call through kernel[grid],
later calls straight to the compiled kernel with the call's grid and ints; another specialization is another
binding, compiled through kernel[grid]; no direct API, or the interpreter: every call through kernel[grid], and
the path says why. The runners bound through TritonAttention launch with the current step's grid."""

from __future__ import annotations

import os
from types import SimpleNamespace

import pytest
import torch

from gmtool.kernels import launcher
from gmtool.kernels.launcher import DIRECT, PENDING, BoundKernel, direct_launch_problem

STREAM = 77


class FakeCompiled:
    """What Triton 3.6/3.9's CompiledKernel offers the direct path; its launcher records each launch."""

    def __init__(self, signature: dict, key):
        self.src = SimpleNamespace(signature=signature)
        self.function, self.packed_metadata, self.key = f"fn{key}", f"meta{key}", key
        self.launches = []

    @property
    def run(self):
        return lambda *a: self.launches.append(a)


class FakeKernel:
    """A JITFunction: kernel[grid](*args, **kw) records the call and returns the variant of its specialization
    (the tensors' dtypes and the constexprs; the do_not_specialize ints play no part), compiling it once."""

    def __init__(self, names=("x_ptr", "out_ptr", "n", "rows", "BLOCK"), constexprs=("BLOCK",), loose=("rows",)):
        self.arg_names = list(names)
        self.params = [SimpleNamespace(do_not_specialize=n in loose) for n in names]
        self.constexprs, self.loose = constexprs, loose
        self.calls, self.variants = [], {}

    def __getitem__(self, grid):
        def run(*args, **kw):
            self.calls.append((grid, args, kw))
            named = dict(zip(self.arg_names, args)) | kw
            key = tuple(
                str(v.dtype) if isinstance(v, torch.Tensor) else v
                for n, v in named.items()
                if n in self.arg_names and n not in self.loose
            )
            if key not in self.variants:
                sig = {n: "constexpr" if n in self.constexprs else "i32" for n in self.arg_names}
                self.variants[key] = FakeCompiled(sig, len(self.variants))
            return self.variants[key]

        return run


@pytest.fixture(autouse=True)
def no_gpu_stream(monkeypatch):
    monkeypatch.setattr(launcher, "_stream_source", lambda: ((lambda device: STREAM), 0))
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)


def bound(kernel, x, out, block=16):
    return BoundKernel(kernel, (x, out, 5, 0), {"BLOCK": block}, {"num_warps": 4}, varying=("rows",))


def test_first_call_compiles_through_triton_then_launches_directly():
    k, x, out = FakeKernel(), torch.zeros(8), torch.zeros(8)
    b = bound(k, x, out)
    assert b.path == PENDING
    b((3, 1, 2), 3)
    assert len(k.calls) == 1 and b.path == DIRECT
    grid, args, kw = k.calls[0]
    assert grid == (3, 1, 2) and args == (x, out, 5, 3) and kw == {"BLOCK": 16, "num_warps": 4}
    compiled = k.variants[next(iter(k.variants))]
    assert compiled.launches == []  # the first launch was Triton's own
    b((4, 2, 2), 9)
    b((1, 1, 2), 1)
    assert len(k.calls) == 1  # no more binding, specializing or looking up
    head = (STREAM, "fn0", "meta0", None, None, None)
    # pointers as addresses, the call's ints in their slots, the constexprs in parameter order (skipped there)
    assert compiled.launches == [
        (4, 2, 2, *head, x.data_ptr(), out.data_ptr(), 5, 9, 16),
        (1, 1, 2, *head, x.data_ptr(), out.data_ptr(), 5, 1, 16),
    ]


@pytest.mark.parametrize("change", ["constexpr", "dtype"])
def test_another_specialization_is_another_binding_compiled_through_triton(change):
    k, x, out = FakeKernel(), torch.zeros(8), torch.zeros(8)
    a = bound(k, x, out)
    b = bound(k, x, out, block=32) if change == "constexpr" else bound(k, x.double(), out)
    for step in range(3):
        a((1, 1, 1), step + 1)
        b((2, 1, 1), step + 1)
    assert [grid for grid, _, _ in k.calls] == [(1, 1, 1), (2, 1, 1)]  # each binding's first call only
    assert len(k.variants) == 2
    first, second = k.variants.values()
    assert [x[0] for x in first.launches] == [1, 1] and [x[0] for x in second.launches] == [2, 2]
    assert a.path == b.path == DIRECT


def test_a_varying_int_must_not_select_a_variant():
    """An int Triton specializes (== 1, % 16) could change the compiled variant from one call to the next:
    binding it as varying is refused."""
    k = FakeKernel(loose=())
    with pytest.raises(ValueError, match="do_not_specialize"):
        bound(k, torch.zeros(8), torch.zeros(8))
    with pytest.raises(ValueError, match="constexprs"):
        BoundKernel(FakeKernel(), (torch.zeros(8), torch.zeros(8), 5, 0), {}, {})


class NoPacked(FakeKernel):
    def __getitem__(self, grid):
        def run(*args, **kw):
            compiled = super(NoPacked, self).__getitem__(grid)(*args, **kw)
            return SimpleNamespace(src=compiled.src, function="f", launches=compiled.launches)  # no run/metadata

        return run


def _fallback_calls_triton_every_time(k, b):
    for rows in (3, 4, 5):
        b((rows, 1, 1), rows)
    assert [(g, args[3]) for g, args, _ in k.calls] == [((r, 1, 1), r) for r in (3, 4, 5)]  # this call's


def test_without_the_direct_api_every_call_goes_through_triton_and_says_why():
    k = NoPacked()
    b = bound(k, torch.zeros(8), torch.zeros(8))
    _fallback_calls_triton_every_time(k, b)
    assert b.path.startswith("triton: ") and "run, packed_metadata" in b.path


def test_under_the_interpreter_every_call_goes_through_triton(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    k = FakeKernel()
    b = bound(k, torch.zeros(8), torch.zeros(8))
    _fallback_calls_triton_every_time(k, b)
    assert "interpreter" in b.path and not any(v.launches for v in k.variants.values())


def test_another_argument_layout_or_a_hook_keeps_triton_s_path(monkeypatch):
    k = FakeKernel()
    other = FakeCompiled({"x_ptr": "*fp32", "out_ptr": "*fp32", "n": "i32", "rows": "i32"}, 0)  # no constexpr
    assert "layout" in direct_launch_problem(k, other, ("rows",))
    const = FakeCompiled({**{n: "i32" for n in k.arg_names}, "rows": "constexpr"}, 0)
    assert "rows compiled as constants" in direct_launch_problem(k, const, ("rows",))
    ok = FakeCompiled({n: "i32" for n in k.arg_names}, 0)
    monkeypatch.setattr(launcher, "_launch_hooks", lambda: (SimpleNamespace(calls=[]), SimpleNamespace(calls=[])))
    assert direct_launch_problem(k, ok, ("rows",)) is None  # empty hook chains: nothing to call
    monkeypatch.setattr(launcher, "_launch_hooks", lambda: (SimpleNamespace(calls=[print]), None))
    assert "hook" in direct_launch_problem(k, ok, ("rows",))


# -- runners bound through TritonAttention: the kernels are fakes, the argument building is gmtool's -----------
@pytest.fixture
def fake_kernels(monkeypatch):
    pytest.importorskip("triton")
    from gmtool.kernels import decode_attention as da, prefill_attention as pa

    made = {}
    for mod, name in ((pa, "_varlen_kernel"), (da, "_decode_split_kernel"), (da, "_combine_kernel")):
        real = getattr(mod, name)
        fake = FakeKernel(real.arg_names, [p.name for p in real.params if p.is_constexpr], ("num_seqs",))
        fake.params = real.params  # the real do_not_specialize declarations
        monkeypatch.setattr(mod, name, fake)
        made[name] = fake
    return made


def _triton_ctx(impl, plan, num_seqs=0, tokens=64, heads=4):
    from gmtool.kernels import TritonAttention
    from gmtool.kernels.testing import make_case
    from gmtool.model.attention import ForwardContext

    q_lens = [q for q, _ in plan] if impl != "decode" else [1] * len(plan)
    case = make_case(q_lens, [k for _, k in plan], num_tokens=tokens, kv_heads=2, group=2, head_dim=32)
    views = SimpleNamespace(
        block_tables=case.block_tables, kv_lens=case.kv_lens_t, cu_q=case.cu_q, slot_mapping=case.slot_mapping
    )
    cache = SimpleNamespace(k=[case.k_cache], v=[case.v_cache])
    tri = TritonAttention.__new__(TritonAttention)
    tri._scratch = {}
    ctx = ForwardContext(cache, views, impl, plan, num_seqs, backend=tri)
    return ctx, torch.zeros(tokens, heads, 32), torch.zeros(tokens, heads, 32)


def test_planned_runner_launches_with_the_current_steps_grid(fake_kernels):
    """Bound at capture with the capture's plan; each replay launches with the plan prepared for that step."""
    from gmtool.core.executor import AttentionRunner

    k = fake_kernels["_varlen_kernel"]
    ctx, q, out = _triton_ctx("planned", ((16, 40), (8, 8)))
    runner = AttentionRunner(0, q, out, 0.5, ctx)
    assert k.calls == []  # binding launches nothing
    steps = [((64, 64),), ((30, 40), (20, 30), (14, 14)), ((1, 9),)]
    for plan in steps:
        ctx.prepare(plan)
        runner.replay()
    assert len(k.calls) == 1 and k.calls[0][0] == (1, 1, 4)  # the first step's: one sequence, one 64-row tile
    assert k.calls[0][1][11] == 1  # num_seqs
    (compiled,) = k.variants.values()
    assert [(x[:3], x[9 + 11]) for x in compiled.launches] == [((3, 1, 4), 3), ((1, 1, 4), 1)]
    assert ctx.planned_with == [ctx.signature]  # what this step consumed


def test_masked_and_decode_runners_launch_bucket_grids_directly(fake_kernels):
    from gmtool.core.executor import AttentionRunner

    ctx, q, out = _triton_ctx("masked", ((16, 40), (8, 8)), num_seqs=2)
    runner = AttentionRunner(0, q, out, 0.5, ctx)
    for _ in range(3):
        runner.replay()
    k = fake_kernels["_varlen_kernel"]
    (compiled,) = k.variants.values()
    assert [c[0] for c in k.calls] == [(64 // 64 + 2, 1, 4)] and len(compiled.launches) == 2
    assert runner.launch.paths == (DIRECT,)

    ctx, q, out = _triton_ctx("decode", ((1, 300), (1, 8)), tokens=2)
    runner = AttentionRunner(0, q, out, 0.5, ctx)
    twin = AttentionRunner(0, q.clone(), out.clone(), 0.5, ctx)  # another layer of the same shape
    for _ in range(2):
        runner.replay()
        twin.replay()
    assert runner.launch.paths == (DIRECT, DIRECT)  # split and combine (300 tokens: two splits)
    split, combine = fake_kernels["_decode_split_kernel"], fake_kernels["_combine_kernel"]
    assert len(split.calls) == len(combine.calls) == 2  # each runner's first replay
    assert runner.launch.split.args[6] is twin.launch.split.args[6]  # one pair of split partials per shape


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="compiles for sm_90")
def test_triton_s_own_compiled_kernel_offers_the_direct_api():
    """The installed Triton's CompiledKernel (compiled for sm_90 here, no GPU needed) passes the check the
    direct path makes; a launch of it needs a GPU (tests/gpu/test_launcher_gpu.py)."""
    pytest.importorskip("triton")
    os.environ.setdefault("TRITON_DEFAULT_FP_FUSION", "1")
    from gmtool.kernels import prefill_attention as pa
    from gmtool.kernels.testing import compile_for_hopper

    consts = dict(G=2, D=64, D_PAD=64, DV=64, DV_PAD=64, PAGE=16, BLOCK_M=64, BLOCK_N=64, WIDE=False, PREC="tf32")
    consts |= dict(WINDOW=0, SOFTCAP=0.0, SINKS=False)
    idx = ("bt_ptr", "lens_ptr", "cu_ptr")
    arg_type = lambda n: ("*i64" if n in idx else "*bf16") if n.endswith("_ptr") else "fp32" if "scale" in n else "i32"  # noqa: E731
    compiled = compile_for_hopper(pa._varlen_kernel, consts, arg_type)
    assert direct_launch_problem(pa._varlen_kernel, compiled, ("num_seqs",)) is None
    assert pa._varlen_kernel.params[pa._varlen_kernel.arg_names.index("num_seqs")].do_not_specialize


def test_a_binding_takes_the_views_it_is_given(fake_kernels):
    """gmtool verify's frozen-metadata faults hand a runner a frozen copy of one buffer: the kernels bind it,
    while the step's grid still comes from the live context."""
    ctx, q, out = _triton_ctx("planned", ((16, 40), (8, 8)))
    frozen = SimpleNamespace(**{**vars(ctx.views), "kv_lens": ctx.views.kv_lens.clone()})
    launch = ctx.backend.bind(ctx, q, ctx.cache.k[0], ctx.cache.v[0], 0.5, out, views=frozen)
    assert launch.launch.args[5] is frozen.kv_lens and launch.launch.args[4] is ctx.views.cu_q
    ctx.prepare(((64, 64),))
    launch()
    assert fake_kernels["_varlen_kernel"].calls[0][0] == (1, 1, 4)


def test_decode_split_partials_are_reserved_before_capture_for_every_bucket():
    """A bound decode runner's split partials come from buffers the executor reserved before any capture: no
    allocation at binding (it would land in the capture's pool and outlive the graph, and only the first capture
    of a shape would make it), and every bucket's launch fits what was reserved."""
    pytest.importorskip("triton")
    from gmtool.kernels import TritonAttention
    from gmtool.kernels.decode_attention import _arguments, choose_num_splits

    heads, kv_heads, dv, page, blocks = 16, 8, 128, 16, 64
    sizes = [1, 2, 4, 8, 16, 32, 64, 128, 256]
    scratch = TritonAttention().reserve_scratch(torch.device("cpu"), sizes, heads, kv_heads, dv, blocks * page)
    asked = []
    for b in sizes:
        q = torch.zeros(b, heads, dv)
        cache = torch.zeros(4, page, kv_heads, dv)
        bt, lens = torch.zeros(b, blocks, dtype=torch.int64), torch.zeros(b, dtype=torch.int64)

        def spy(role, n):
            asked.append((role, n))
            return scratch(role, n)

        before = len(asked)
        _arguments(q, cache, cache, bt, lens, 1.0, None, None, 32, None, None, None, spy)
        splits = choose_num_splits(b, kv_heads, blocks * page, 132)
        mine = asked[before:]
        assert mine == ([("part", b * heads * splits * dv), ("lse", b * heads * splits)] if splits > 1 else [])
    assert asked and len({scratch("part", n).untyped_storage().data_ptr() for r, n in asked if r == "part"}) == 1
    with pytest.raises(Exception, match="exceed"):
        scratch("lse", 10**9)


def test_a_launch_held_by_compile_ahead_decides_nothing():
    """Inside compile-ahead's pass a launch returns launcher.HELD (compiled later, not run): the binding stays
    pending, and its first real launch afterwards takes the direct path."""

    class HeldThenReal(FakeKernel):
        held = True

        def __getitem__(self, grid):
            return (lambda *a, **kw: launcher.HELD) if self.held else super().__getitem__(grid)

    k, x, out = HeldThenReal(), torch.zeros(8), torch.zeros(8)
    b = bound(k, x, out)
    b((1, 1, 1), 2)
    assert b.path == PENDING
    k.held = False
    b((1, 1, 1), 2)
    assert b.path == DIRECT and len(k.calls) == 1
