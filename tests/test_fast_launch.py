"""FastLaunch (gmtool.kernels.launcher) on the CPU: a fake JITFunction stands in for Triton's, so the keying runs
without a GPU. A call whose arguments key like an earlier one goes straight to that variant's launcher with its
own addresses and values; anything Triton would specialize differently on (a tensor's dtype or 16-byte
alignment, an int equal to 1 or divisible by 16, a constexpr, a launch option) goes through kernel[grid]
first. A launch hook, a replaced JITFunction.run (compile-ahead's pass) or a compiled kernel without the
launcher's convention keep every call on Triton's path."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from gmtool.kernels import launcher
from gmtool.kernels.launcher import DIRECT, FastLaunch

NAMES = ("x_ptr", "out_ptr", "n", "eps", "BLOCK", "PDL")
CONSTEXPR = ("BLOCK", "PDL")


class FakeCompiled:
    def __init__(self, tag, signature=True):
        if signature:
            self.src = SimpleNamespace(signature={n: "constexpr" if n in CONSTEXPR else "i32" for n in NAMES})
            self.function, self.packed_metadata = f"fn{tag}", f"meta{tag}"
        self.launches = []

    def run(self, *a):
        self.launches.append(a)


class JITFunction:
    """Named as Triton's class: FastLaunch takes only a JIT function's launches."""

    def __init__(self):
        self.arg_names = list(NAMES)
        self.params = [
            SimpleNamespace(name=n, is_constexpr=n in CONSTEXPR, has_default=n == "PDL", default=0) for n in NAMES
        ]
        self.pre_run_hooks = []
        self.through_triton = []  # each call of kernel[grid]: (grid, args, kwargs)
        self.compiled = FakeCompiled(0)

    refuse: Exception | None = None  # what Triton's run raises, when set

    def run(self, *args, grid, **kwargs):
        self.through_triton.append((grid, args, kwargs))
        if self.refuse is not None:
            raise self.refuse
        return self.compiled

    def __getitem__(self, grid):
        return lambda *args, **kwargs: self.run(*args, grid=grid, **kwargs)  # as Triton's JITFunction


@pytest.fixture
def fake(monkeypatch):
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    monkeypatch.setattr(
        launcher,
        "_active_driver",
        lambda: SimpleNamespace(get_current_device=lambda: 0, get_current_stream=lambda d: 7),
    )
    from triton import knobs

    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", None)
    monkeypatch.setattr(knobs.runtime, "launch_exit_hook", None)
    k = JITFunction()
    return k, FastLaunch(k)


def _x(offset=0, dtype=torch.bfloat16):
    return torch.zeros(64, dtype=dtype)[offset:]


def test_a_known_variant_launches_directly_with_this_call_s_addresses_and_values(fake):
    k, fast = fake
    x, out = _x(), _x()
    fast[(4,)](x, out, 3, 1e-6, BLOCK=64, num_warps=4)
    assert len(k.through_triton) == 1 and fast.path == DIRECT
    x2, out2 = _x(8), _x(16)  # other tensors, still 16-byte aligned; another int of the same class
    fast[(5, 2)](x2, out2, 5, 1e-5, BLOCK=64, num_warps=4)
    assert len(k.through_triton) == 1
    (launch,) = k.compiled.launches
    # grid padded to three, the stream, the variant's function and metadata, no launch metadata or hooks; then
    # every parameter in order: addresses for tensors, the call's ints and floats, constexprs (default: PDL=0)
    assert launch == (5, 2, 1, 7, "fn0", "meta0", None, None, None, x2.data_ptr(), out2.data_ptr(), 5, 1e-5, 64, 0)


@pytest.mark.parametrize(
    "change",
    [
        lambda a, kw: ((_x(1), *a[1:]), kw),  # 2 bytes off: not 16-byte aligned
        lambda a, kw: ((_x(dtype=torch.float16), *a[1:]), kw),
        lambda a, kw: ((*a[:2], 1, a[3]), kw),  # an int equal to 1
        lambda a, kw: ((*a[:2], 32, a[3]), kw),  # divisible by 16
        lambda a, kw: ((*a[:2], 2**40, a[3]), kw),  # beyond int32
        lambda a, kw: (a, {**kw, "BLOCK": 128}),
        lambda a, kw: (a, {**kw, "num_warps": 8}),
        lambda a, kw: (a, {**kw, "PDL": 1}),
    ],
)
def test_what_triton_specializes_on_goes_through_triton_first(fake, change):
    k, fast = fake
    args, kw = (_x(), _x(), 3, 1e-6), dict(BLOCK=64, num_warps=4)
    fast[(1,)](*args, **kw)
    args2, kw2 = change(args, kw)
    fast[(1,)](*args2, **kw2)
    assert len(k.through_triton) == 2 and not k.compiled.launches
    fast[(1,)](*args2, **kw2)  # now known: direct
    assert len(k.through_triton) == 2 and len(k.compiled.launches) == 1


def test_hooks_a_replaced_run_and_an_unconventional_kernel_keep_triton_s_path(fake, monkeypatch):
    from triton import knobs

    k, fast = fake
    args, kw = (_x(), _x(), 3, 1e-6), dict(BLOCK=64)
    fast[(1,)](*args, **kw)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", lambda *a: None)  # a profiler
    fast[(1,)](*args, **kw)
    monkeypatch.setattr(knobs.runtime, "launch_enter_hook", None)
    k.pre_run_hooks.append(lambda *a, **kw: None)
    fast[(1,)](*args, **kw)
    k.pre_run_hooks.clear()
    real = JITFunction.run
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, grid, **kw: real(self, *a, grid=grid, **kw))
    fast[(1,)](*args, **kw)  # compile-ahead's pass replaces JITFunction.run: its launches must compile, not run
    monkeypatch.setattr(JITFunction, "run", real)
    k.run = lambda *a, grid, **kw: real(k, *a, grid=grid, **kw)  # a spy on this kernel alone
    fast[(1,)](*args, **kw)
    del k.run
    assert len(k.through_triton) == 5 and not k.compiled.launches
    fast[(1,)](*args, **kw)
    assert len(k.through_triton) == 5 and len(k.compiled.launches) == 1

    k2 = JITFunction()
    k2.compiled = FakeCompiled(1, signature=False)  # a future from an async compile, say: not kept
    fast2 = FastLaunch(k2)
    for _ in range(3):
        fast2[(1,)](*args, **kw)
    assert len(k2.through_triton) == 3 and fast2.path != DIRECT


def test_an_argument_of_another_kind_goes_through_triton_once_and_its_error_is_the_caller_s(fake):
    """A tuple (or a numpy int, a descriptor) is not keyed: Triton's own path takes the launch, once, and an error
    Triton raises for it reaches the caller as it is, not retried by a second launch."""
    k, fast = fake
    for _ in range(2):
        fast[(1,)](_x(), _x(), (3, 4), 1e-6, BLOCK=64)
    assert len(k.through_triton) == 2 and not k.compiled.launches

    k.refuse = TypeError("this Triton cannot take a tuple here")
    with pytest.raises(TypeError, match="cannot take a tuple"):
        fast[(1,)](_x(), _x(), (3, 4), 1e-6, BLOCK=64)
    with pytest.raises(TypeError, match="cannot take a tuple"):
        fast[(1,)](_x(), _x(), 3, 1e-6, BLOCK=64, tag=[1])  # an unhashable keyword: Triton's path too
    assert len(k.through_triton) == 4


def test_under_the_interpreter_every_call_goes_through_triton(fake, monkeypatch):
    k, fast = fake
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for _ in range(2):
        fast[(1,)](_x(), _x(), 3, 1e-6, BLOCK=64)
    assert len(k.through_triton) == 2 and fast.path.startswith(launcher.VIA_TRITON)


def test_a_first_launch_inside_compile_ahead_s_pass_leaves_the_direct_path_for_after(fake, monkeypatch):
    """compile-ahead's pass replaces JITFunction.run with a stand-in naming Triton's in __wrapped__: a kernel's
    first launch in the process may be the pass's. Inside the pass no launch is direct (it must compile only);
    after it, known variants launch directly again."""
    import functools

    k, fast = fake
    real = JITFunction.run

    @functools.wraps(real)
    def compile_instead(self, *a, grid, **kw):
        real(self, *a, grid=grid, **kw)
        return object()  # a future, as AsyncCompileMode's: not kept

    args, kw = (_x(), _x(), 3, 1e-6), dict(BLOCK=64)
    monkeypatch.setattr(JITFunction, "run", compile_instead)
    for _ in range(2):
        fast[(1,)](*args, **kw)
    assert len(k.through_triton) == 2 and not k.compiled.launches
    monkeypatch.setattr(JITFunction, "run", real)  # the pass ends
    for _ in range(3):
        fast[(1,)](*args, **kw)
    assert len(k.through_triton) == 3 and len(k.compiled.launches) == 2


def test_keywords_key_by_type_and_value_and_triton_s_per_call_options_count(fake, monkeypatch):
    """n=3 and n=3.0 are other variants for Triton (i32, fp32), though equal in Python; a change of the debug
    knob, which Triton's run reads on every call, compiles anew."""
    from triton import knobs

    k, fast = fake
    fast[(1,)](_x(), _x(), n=3, eps=1e-6, BLOCK=64)
    fast[(1,)](_x(), _x(), n=3.0, eps=1e-6, BLOCK=64)
    assert len(k.through_triton) == 2
    fast[(1,)](_x(), _x(), n=3.0, eps=1e-6, BLOCK=64)
    assert len(k.through_triton) == 2 and len(k.compiled.launches) == 1
    monkeypatch.setattr(knobs.runtime, "debug", not knobs.runtime.debug)
    fast[(1,)](_x(), _x(), n=3.0, eps=1e-6, BLOCK=64)
    assert len(k.through_triton) == 3
