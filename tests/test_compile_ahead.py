"""Triton kernels compiled ahead of the first capture (gmtool.kernels.compile_ahead): inside compiling_only()
every Triton launch becomes a warmup (compiled, not run) under an async compile mode, and the launch path is
restored on leaving, also when the forward raises. The GPU run measures what it saves (bench --stages capture)."""

from __future__ import annotations

import pytest
import torch

triton = pytest.importorskip("triton")


class FakeMode:
    """Stands in for Triton's AsyncCompileMode: records that it was entered with a pool and left."""

    events: list = []

    def __init__(self, pool):
        self.pool = pool

    def __enter__(self):
        FakeMode.events.append(("enter", self.pool is not None))
        return self

    def __exit__(self, *exc):
        FakeMode.events.append(("exit",))


class QueuingMode:
    """Queues each new key's compile on its pool, as Triton's AsyncCompileMode does; waits for them on leaving."""

    active = None

    def __init__(self, executor):
        self.executor, self.futures, self.keys = executor, [], set()

    def submit(self, key, compile_fn, *callbacks):
        if key not in self.keys:
            self.keys.add(key)
            self.futures.append(self.executor.submit(compile_fn))

    def __enter__(self):
        QueuingMode.active = self
        return self

    def __exit__(self, *exc):
        for f in self.futures:
            f.result()


def test_launches_inside_compile_instead_of_running(monkeypatch):
    from triton.runtime.jit import JITFunction

    from gmtool.kernels import compile_ahead, launcher

    calls = []
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, grid, warmup, **kw: calls.append((a, grid, warmup, kw)))
    monkeypatch.setattr(compile_ahead, "_async_mode", lambda: FakeMode)
    FakeMode.events = []
    original = JITFunction.run
    with compile_ahead.compiling_only(torch.device("cpu"), workers=2):
        assert JITFunction.run(object(), 1, 2, grid=(4,), warmup=False, BLOCK=16) is launcher.HELD
        assert calls == []  # held while the forward runs
    assert calls == [((1, 2), (4,), True, {"BLOCK": 16})]  # then made, as a warmup
    assert JITFunction.run is original
    assert FakeMode.events == [("enter", True), ("exit",)]
    with pytest.raises(RuntimeError), compile_ahead.compiling_only(torch.device("cpu"), workers=1):
        JITFunction.run(object(), 3, grid=(1,), warmup=False)
        raise RuntimeError("a forward that fails")
    assert JITFunction.run is original  # restored whatever happened inside
    assert len(calls) == 1  # and a failed forward's launches are not compiled


def test_reasons_it_does_not_run(monkeypatch):
    from gmtool.kernels import compile_ahead

    for off in ("0", "false", "Off"):
        monkeypatch.setenv("GMTOOL_COMPILE_AHEAD", off)
        assert compile_ahead.unavailable() == f"off: GMTOOL_COMPILE_AHEAD={off}"
    monkeypatch.delenv("GMTOOL_COMPILE_AHEAD")  # on by default
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    assert compile_ahead.unavailable() is None or "AsyncCompileMode" in compile_ahead.unavailable()
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert "interpreter" in compile_ahead.unavailable()
    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(compile_ahead, "_async_mode", lambda: None)
    assert "AsyncCompileMode" in compile_ahead.unavailable()


def test_only_the_first_capture_warms_up_and_a_failed_cold_capture_is_warmed_and_retried(monkeypatch):
    """One eager warm-up per executor (cuBLAS's workspace, GPU-NOTES pitfall 1); later shapes capture cold. A
    cold capture that fails is warmed up and captured again, and then replays like eager."""
    from gmtool.errors import CaptureError
    from tests.helpers import Rig, rel

    rig = Rig()
    ex = rig.ex
    warmups = []
    real_warm = ex.forward_impl.warmup
    monkeypatch.setattr(ex.forward_impl, "warmup", lambda e, fn: warmups.append(1) or real_warm(e, fn))
    for text in ["1*16", "1*8"]:
        b = rig.batch(text)
        assert rel(rig.graph(b), rig.eager(b)) < 1e-5
    assert [e.warmed_up for e in ex.graphs.values()] == [True, False] and len(warmups) == 1
    assert ex.compile_ahead_s is None  # the CPU tape compiles nothing

    real_record, fails = ex._record, []

    def record_failing_once(entry, fn):
        if not fails:
            fails.append(entry.key)
            ex.backend.abort()
            raise CaptureError("a launch the capture refused")
        return real_record(entry, fn)

    monkeypatch.setattr(ex, "_record", record_failing_once)
    b = rig.batch("1*4")
    assert rel(rig.graph(b), rig.eager(b)) < 1e-5
    entry = ex.graphs[ex.key_for(b)]
    assert fails and entry.warmed_after_failure and entry.warmed_up and len(warmups) == 2

    ex.warmup_every_capture = True
    rig.graph(rig.batch("1*30"))
    assert len(warmups) == 3


def test_a_failed_compile_ahead_is_said_and_the_capture_goes_on(monkeypatch):
    """It is an optimization: if it fails (a Triton whose async mode breaks), the kernels compile at their first
    launch as before, and the note says why."""
    import contextlib

    from gmtool.kernels import compile_ahead
    from tests.helpers import Rig, rel

    rig = Rig()

    @contextlib.contextmanager
    def broken(device, workers=8):
        raise RuntimeError("A thread initializer failed")
        yield

    monkeypatch.setattr(compile_ahead, "compiling_only", broken)
    monkeypatch.setattr(compile_ahead, "unavailable", lambda: None)
    ex, b = rig.ex, rig.batch("1*8")
    key = ex.key_for(b)
    ex.inputs.load(b, key)
    ex.device = torch.device("cuda")  # past the CPU check, for this call only
    compile_ahead.before_first_capture(ex, key, b, lambda: None)
    ex.device = torch.device("cpu")
    assert "A thread initializer failed" in ex.compile_ahead_note and ex.compile_ahead_s is None
    assert rel(rig.graph(b), rig.eager(b)) < 1e-5


def test_the_compile_log_counts_variants_and_seconds_per_kernel_and_restores_triton_s_hooks(monkeypatch):
    """Triton calls jit_cache_hook before a compile (or a load from its disk cache) and jit_post_compile_hook
    after, on the launching thread; in AsyncCompileMode the compiles run in threads and the post hooks come
    when the mode exits, so those compiles count without seconds. Leaving restores whatever hooks were set."""
    import time
    from types import SimpleNamespace

    from triton import knobs

    from gmtool.kernels import compile_ahead

    def compile_(hooks, name, key, sleep=0.0):
        assert hooks.jit_cache_hook(key=key, repr=key, fn=SimpleNamespace(name=name)) is None
        time.sleep(sleep)
        hooks.jit_post_compile_hook(key=key, repr=key, fn=SimpleNamespace(name=name))

    mine = lambda **kw: None  # noqa: E731
    knobs.runtime.jit_cache_hook = mine
    try:
        with compile_ahead.compile_log() as log:
            hooks = knobs.runtime
            compile_(hooks, "_rms", "a", 0.02)
            compile_(hooks, "_rms", "b")
            compile_(hooks, "_gemm", "c", 0.05)
            monkeypatch.setattr(compile_ahead, "_async_compiling", lambda: True)
            for key in ("d", "e"):  # submitted together, finalized at the mode's exit
                hooks.jit_cache_hook(key=key, repr=key, fn=SimpleNamespace(name="_async"))
            time.sleep(0.05)
            for key in ("d", "e"):
                hooks.jit_post_compile_hook(key=key, repr=key, fn=SimpleNamespace(name="_async"))
        assert knobs.runtime.jit_cache_hook is mine and knobs.runtime.jit_post_compile_hook is None
    finally:
        knobs.runtime.jit_cache_hook = None
    s = log.summary()
    assert s["compiles"] == 5 and s["untimed"] == 2 and 0.07 <= s["compile_s"] < 0.5
    assert list(s["kernels"]) == ["_gemm", "_rms", "_async"]
    assert s["kernels"]["_rms"]["variants"] == 2 and s["kernels"]["_async"] == {"variants": 2, "s": 0.0}


@pytest.mark.parametrize("callbacks", [1, 2])  # Triton 3.6 passes finalize; 3.9 finalize and cleanup
def test_compiling_only_loads_each_kernel_in_its_worker(monkeypatch, callbacks):
    """A worker compiles, then loads the kernel (_init_handles builds Triton's C launcher, a cc run), so the
    first launch does not build launchers one after the other; a failed load is left to that launch."""
    import threading

    from gmtool.kernels import compile_ahead

    class FakeMode:
        active = None

        def __init__(self, executor):
            self.executor, self.done = executor, []

        def submit(self, key, compile_fn, *rest):
            assert len(rest) == callbacks
            kernel = self.executor.submit(compile_fn).result()
            rest[0](kernel)
            self.done.append(kernel)

        def __enter__(self):
            FakeMode.active = self
            return self

        def __exit__(self, *exc):
            return None

    class Kernel:
        def __init__(self, fail=False):
            self.fail, self.loaded_in = fail, None

        def _init_handles(self):
            if self.fail:
                raise RuntimeError("no launcher")
            self.loaded_in = threading.current_thread().name

    monkeypatch.setattr(compile_ahead, "_async_mode", lambda: FakeMode)
    monkeypatch.setenv("GMTOOL_COMPILE_FORK", "0")  # this mode compiles at submit: no child could go first
    finalized = []
    cbs = [finalized.append, lambda k: None][:callbacks]
    with compile_ahead.compiling_only(torch.device("cpu"), workers=2):
        mode = FakeMode.active
        mode.submit("a", Kernel, *cbs)
        mode.submit("b", lambda: Kernel(fail=True), *cbs)
    good, bad = mode.done
    assert good.loaded_in not in (None, threading.current_thread().name) and bad.loaded_in is None
    assert finalized == [good, bad]


def test_a_capture_times_its_warm_up_capture_and_measurement_apart_and_the_split_adds_up(monkeypatch):
    """Each entry says how long its eager warm-up (the executor's first capture only), its capture and its
    memory readings with the upload took; bench's capture_split puts them beside compile-ahead's pass, and its
    rest is what none of them holds."""
    import time

    from gmtool.measure.bench import capture_split
    from tests.helpers import Rig

    rig = Rig()
    ex = rig.ex
    real_warm = ex.forward_impl.warmup

    def slow_warmup(e, fn):
        time.sleep(0.05)
        real_warm(e, fn)

    monkeypatch.setattr(ex.forward_impl, "warmup", slow_warmup)
    t0 = time.perf_counter()
    entries = [ex.capture(ex.key_for(b), b) for b in (rig.batch("1*16"), rig.batch("1*8"))]
    total = time.perf_counter() - t0
    first, second = entries
    assert first.warmup_s >= 0.05 and second.warmup_s == 0.0
    assert all(e.capture_s > 0 and e.measure_s >= 0 for e in entries)
    alone = capture_split(entries, None, total)
    assert alone["compile_ahead"] == 0.0 and alone["rest"] >= 0  # no time counted twice
    assert alone["warm_up"] == first.warmup_s and alone["capture"] == first.capture_s + second.capture_s
    split = capture_split(entries, 0.25, total)
    assert split["compile_ahead"] == 0.25 and split["rest"] == pytest.approx(alone["rest"] - 0.25)


def test_a_finished_pass_leaves_a_marker_that_skips_the_next_for_the_same_configuration_only(monkeypatch, tmp_path):
    """With every variant already in Triton's disk cache, the pass cost more than loading the kernels at their
    first launches; its marker (a digest of what decides the variants, in the cache directory) skips it. The
    marker is written only after a pass that finished, and another shape or model digests differently."""
    import contextlib

    from gmtool.kernels import compile_ahead, compile_marker
    from tests.helpers import Rig, rel

    passes = []

    @contextlib.contextmanager
    def counting(device, workers=8):
        passes.append(device)
        yield

    monkeypatch.setattr(compile_ahead, "compiling_only", counting)
    monkeypatch.setattr(compile_ahead, "unavailable", lambda: None)
    monkeypatch.setattr(compile_marker, "triton_cache_dir", lambda: tmp_path)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda d=None: "Fake GPU")
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda d=None: (9, 0))

    def first_capture(rig, text):
        ex, b = rig.ex, rig.batch(text)
        key = ex.key_for(b)
        ex.inputs.load(b, key)
        ex.compile_ahead_s = ex.compile_ahead_note = None
        ex.device = torch.device("cuda")  # past the CPU check, for this call only
        try:
            compile_ahead.before_first_capture(ex, key, b, lambda: None)
        finally:
            ex.device = torch.device("cpu")
        return ex, b

    rig = Rig()
    ex, b = first_capture(rig, "1*8")
    assert len(passes) == 1 and ex.compile_ahead_s is not None and ex.compile_ahead_note is None
    markers = list((tmp_path / "gmtool-compiled-ahead").iterdir())
    assert len(markers) == 1

    again = Rig()
    ex, b = first_capture(again, "1*8")  # a new executor, the same configuration: skipped
    assert len(passes) == 1 and ex.compile_ahead_s is None
    assert ex.compile_ahead_note.startswith(compile_marker.SKIPPED) and str(tmp_path) in ex.compile_ahead_note
    assert rel(again.graph(b), again.eager(b)) < 1e-5

    first_capture(Rig(), "1*4")  # another first bucket of the same decode buckets: the pass ran for all of them
    assert len(passes) == 1
    first_capture(Rig(buckets=(4, 8, 16)), "1*8")  # other buckets: another digest, the pass runs
    assert len(passes) == 2 and len(list((tmp_path / "gmtool-compiled-ahead").iterdir())) == 2

    monkeypatch.setenv("TRITON_DEBUG", "1")  # an environment Triton compiles differently under
    first_capture(Rig(), "1*8")
    assert len(passes) == 3
    monkeypatch.setenv("DISABLE_LLVM_OPT", "1")  # in Triton's own cache key, though not TRITON_*
    first_capture(Rig(), "1*8")
    assert len(passes) == 4

    @contextlib.contextmanager
    def failing(device, workers=8):
        passes.append(device)
        raise RuntimeError("a compile failed")
        yield

    monkeypatch.setattr(compile_ahead, "compiling_only", failing)
    first_capture(Rig(buckets=(2, 4, 8)), "1*2")
    assert len(passes) == 5 and len(list((tmp_path / "gmtool-compiled-ahead").iterdir())) == 4  # no marker


def test_the_pass_runs_the_leading_layers_up_to_one_of_each_type():
    from types import SimpleNamespace as NS

    from gmtool.kernels.compile_ahead import PASS_LAYERS, pass_layers

    assert PASS_LAYERS == 3  # layer 0, 1 and another: what Triton keys a layer-following int on
    assert pass_layers(NS(num_hidden_layers=28)) == 3
    assert pass_layers(NS(num_hidden_layers=2)) == 2
    gemma = ["sliding_attention"] * 5 + ["full_attention"]
    assert pass_layers(NS(num_hidden_layers=26, layer_types=gemma * 5)) == 6
    assert pass_layers(NS(num_hidden_layers=4, layer_types=gemma)) == 3  # types past the last layer do not count
    assert pass_layers(NS(num_hidden_layers=5, layer_types=gemma[1:])) == 5


@pytest.mark.parametrize("fuse", [False, True])
def test_leading_layers_shortens_the_forward_and_restores_it(tmp_path, fuse):
    """Inside leading_layers the forward (transformers' own, or --fuse's) runs layers 0-2 of 5; after it, all 5,
    also when the forward raised."""
    import json
    from pathlib import Path

    from gmtool.kernels.compile_ahead import leading_layers
    from gmtool.model import families
    from gmtool.model.fused import fuse_layers
    from tests.helpers import Rig

    profile = Path(__file__).parents[1] / "gmtool" / "builtin_profiles" / "models" / "tiny-qwen3.json"
    config = json.loads(profile.read_text())["config"] | {"num_hidden_layers": 5}
    (tmp_path / "config.json").write_text(json.dumps(config))
    rig = Rig(model=str(tmp_path))
    if fuse:
        fuse_layers(rig.lm.model, "torch")
    ran = []
    for i, layer in enumerate(families.base_model(rig.lm.model).layers):
        layer.mlp.register_forward_pre_hook(lambda m, a, i=i: ran.append(i))
    b = rig.batch("1*4")
    with leading_layers(rig.lm):
        rig.eager(b)
    assert ran == [0, 1, 2]
    ran.clear()
    rig.eager(b)
    assert ran == [0, 1, 2, 3, 4]
    with pytest.raises(RuntimeError), leading_layers(rig.lm):
        raise RuntimeError("a forward that fails")
    assert rig.lm.num_layers == 5


def test_each_compile_in_the_pass_builds_its_launcher_beside_it_and_only_in_the_pass(monkeypatch):
    """A compile inside compiling_only() hands its source to _build_launcher (in another thread), then compiles;
    Triton's compile is restored on leaving, and a binder that kept the wrapper only compiles afterwards."""
    import threading

    import triton.compiler as compiler_package

    from gmtool.kernels import compile_ahead

    built, done = [], threading.Event()
    monkeypatch.setattr(compile_ahead, "_build_launcher", lambda src: built.append(src) or done.set())
    monkeypatch.setattr(compiler_package, "compile", lambda src, **kw: ("compiled", src, kw))
    fake = compiler_package.compile
    monkeypatch.setattr(compile_ahead, "_async_mode", lambda: FakeMode)
    with compile_ahead.compiling_only(torch.device("cpu"), workers=2):
        kept = compiler_package.compile  # what a binder made in here holds
        assert kept is not fake
        assert kept("SRC", target=7) == ("compiled", "SRC", {"target": 7})
        assert done.wait(10)
    assert built == ["SRC"] and compiler_package.compile is fake
    assert kept("LATER") == ("compiled", "LATER", {}) and built == ["SRC"]


def test_triton_s_first_launch_work_starts_at_model_load_in_two_threads(monkeypatch):
    """Triton's hash of itself in one thread; its first launch's imports and the driver in another; joined
    before the first capture. Under the interpreter nothing starts."""
    import importlib

    import triton.runtime.cache

    from gmtool.kernels import triton_prep

    done = []
    monkeypatch.setattr(triton.runtime.cache, "triton_key", lambda: done.append("key"))
    real_import = importlib.import_module
    monkeypatch.setattr(importlib, "import_module", lambda name: done.append(name) or real_import("json"))
    monkeypatch.setattr(triton_prep, "first_launch_work", [])
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    triton_prep.prepare_triton_in_background()
    assert triton_prep.first_launch_work == []
    monkeypatch.delenv("TRITON_INTERPRET")
    triton_prep.prepare_triton_in_background()
    triton_prep.prepare_triton_in_background()  # once per process
    threads = list(triton_prep.first_launch_work)
    assert len(threads) == 2
    for t in threads:
        t.join(30)
    assert sorted(done) == sorted(["key", *triton_prep.FIRST_LAUNCH_IMPORTS])


def test_a_compile_that_starts_only_when_the_pass_is_left_still_builds_its_launcher(monkeypatch):
    """Triton's AsyncCompileMode runs a compile when a pool thread is free: beyond the pool's threads (or on a
    thread not yet scheduled) it starts only while the mode's exit waits. That compile is still the pass's: its
    launcher is built beside it and the workers get it."""
    import threading

    import triton.compiler as compiler_package

    from gmtool.kernels import compile_ahead

    class QueuedMode:  # every pool thread busy: compiles run when the mode is left
        active = None

        def __init__(self, executor):
            self.executor, self.queued = executor, []

        def submit(self, key, compile_fn, *callbacks):
            self.queued.append(compile_fn)

        def __enter__(self):
            QueuedMode.active = self
            return self

        def __exit__(self, *exc):
            for fn in self.queued:
                self.executor.submit(fn).result()

    built, done = [], threading.Event()
    monkeypatch.setattr(compile_ahead, "_build_launcher", lambda src: built.append(src) or done.set())
    monkeypatch.setattr(compiler_package, "compile", lambda src, **kw: ("compiled", src))
    monkeypatch.setattr(compile_ahead, "_async_mode", lambda: QueuedMode)
    with compile_ahead.compiling_only(torch.device("cpu"), workers=1):
        kept = compiler_package.compile  # what the binder Triton makes at the launch's replay holds
        QueuedMode.active.submit("k", lambda: kept("SRC", target=7))
    assert done.wait(10) and built == ["SRC"]
    assert kept("LATER") == ("compiled", "LATER") and built == ["SRC"]  # after: compiles only


def test_a_compile_that_fails_in_the_pass_leaves_no_async_mode_active(monkeypatch):
    """Triton 3.6's AsyncCompileMode raises a failed compile from its exit before unsetting itself: left active,
    every later launch in the thread would submit its compile to the pass's shut-down pool, and the capture
    that should go on without the pass would fail. Leaving compiling_only() unsets it."""
    from triton.runtime import _async_compile

    from gmtool.kernels import compile_ahead

    class Triton36Mode:
        def __init__(self, executor):
            self.executor, self.futures = executor, []

        def submit(self, key, compile_fn, *callbacks):
            self.futures.append(self.executor.submit(compile_fn))

        def __enter__(self):
            _async_compile.active_mode.set(self)
            return self

        def __exit__(self, *exc):
            for f in self.futures:
                f.result()
            _async_compile.active_mode.set(None)

    def failing():
        raise RuntimeError("a compile failed")

    monkeypatch.setattr(compile_ahead, "_async_mode", lambda: Triton36Mode)
    try:
        with pytest.raises(RuntimeError, match="a compile failed"):
            with compile_ahead.compiling_only(torch.device("cpu"), workers=1):
                _async_compile.active_mode.get().submit("k", failing)
        assert _async_compile.active_mode.get() is None
    finally:
        _async_compile.active_mode.set(None)


def test_a_held_launch_keeps_stand_ins_of_its_tensors_not_the_tensors(monkeypatch):
    """The pass holds launches until its forwards end: it must not hold their activations. Each tensor argument
    is held as a few-byte tensor with what Triton specializes on (dtype, 16-byte alignment); other arguments
    as they are."""
    import gc
    import weakref

    from triton.runtime.jit import JITFunction

    from gmtool.kernels import compile_ahead

    calls = []
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, grid, warmup, **kw: calls.append((a, kw)))
    monkeypatch.setattr(compile_ahead, "_async_mode", lambda: FakeMode)
    big = torch.zeros(1 << 20, dtype=torch.bfloat16)
    gone = weakref.ref(big)
    with compile_ahead.compiling_only(torch.device("cpu"), workers=1):
        JITFunction.run(object(), big, big[1:], torch.ones(3), 7, grid=(1,), warmup=False, out=big[8:], eps=1e-6)
        del big
        gc.collect()
        assert gone() is None  # not held by the pass
    ((args, kw),) = calls
    assert [(a.dtype, a.data_ptr() % 16 == 0, a.numel()) for a in args[:3]] == [
        (torch.bfloat16, True, 1),
        (torch.bfloat16, False, 1),
        (torch.float32, True, 1),
    ]
    assert args[3] == 7 and kw["eps"] == 1e-6
    assert kw["out"].dtype == torch.bfloat16 and kw["out"].data_ptr() % 16 == 0 and kw["out"].numel() == 1


def test_the_pass_runs_every_decode_bucket_s_forward_smallest_first_and_the_captured_shape_last(monkeypatch):
    """Which variants a shape launches only its forward tells (the decode split count and the combine's dims a
    program change between the smallest and the largest bucket): with those two alone, a middle bucket's combine
    compiled inside its capture. Buckets past the sequence slots are never decode graphs: not run (their forward
    fails with torch attention, and the pass with it). The captured shape's forward reads its batch again, and
    so does the capture after a forward that failed. A prefill key runs its own forward only."""
    import contextlib

    from gmtool.kernels import compile_ahead, compile_marker
    from tests.helpers import Rig

    ran = []

    @contextlib.contextmanager
    def passing(device, workers=8):
        yield
        ran.append("exit")

    monkeypatch.setattr(compile_ahead, "compiling_only", passing)
    monkeypatch.setattr(compile_ahead, "unavailable", lambda: None)
    monkeypatch.setattr(compile_marker, "done_marker", lambda *a: None)

    def first_pass(rig, text, fail_at=None):
        ex, b = rig.ex, rig.batch(text)
        key = ex.key_for(b)
        ex.inputs.load(b, key)
        loaded, seen, forward = ex.inputs.arena.clone(), [], ex.forward

        def counted(views):
            ran.append(views.input_ids.shape[0])
            if views.input_ids.shape[0] == fail_at:
                raise RuntimeError("a forward that fails")
            forward(views)

        monkeypatch.setattr(ex, "forward", counted)
        ex.device = torch.device("cuda")  # past the CPU check, for this call only
        try:
            compile_ahead.before_first_capture(
                ex, key, b, lambda: (ran.append("own"), seen.append(ex.inputs.arena.clone()))
            )
        finally:
            ex.device = torch.device("cpu")
        staged = ex.inputs._host_slots(key)[4].numel()  # the key's inputs in the arena
        assert torch.equal(ex.inputs.arena[:staged], loaded[:staged])  # as loaded before the pass
        return ex, [s[:staged] for s in seen], loaded[:staged]

    ex, seen, loaded = first_pass(Rig(buckets=(1, 4, 8, 16, 32)), "1*8")
    assert ex.compile_ahead_s is not None, ex.compile_ahead_note
    assert ran == [1, 4, 16, 32, "own", "exit"]
    assert 0 < ex.compile_ahead_forwards_s <= ex.compile_ahead_s
    assert len(seen) == 1 and torch.equal(seen[0], loaded)  # the captured shape's forward read its own batch

    ran.clear()
    ex, _, _ = first_pass(Rig(buckets=(1, 4, 8, 16, 32), max_num_seqs=8), "1*8")
    assert ran == [1, 4, "own", "exit"] and ex.compile_ahead_note is None

    ran.clear()
    ex, seen, _ = first_pass(Rig(buckets=(1, 4, 8, 16, 32)), "1*8", fail_at=16)
    assert ran == [1, 4, 16] and not seen  # the pass stopped at the failure
    assert "a forward that fails" in ex.compile_ahead_note and ex.compile_ahead_s is None
    assert ex.compile_ahead_forwards_s is None

    prefill = Rig(buckets=(16, 32), mode="full")
    pb = prefill.batch("2*5")
    assert compile_ahead.pass_shapes(prefill.ex, prefill.ex.key_for(pb), pb) == []


def test_child_compiles_run_each_variant_once_in_another_process_and_say_which_failed(tmp_path):
    """A child runs the compile in its own process (the launcher built after it there, IN_CHILD), leaving the
    parent's state alone; a key forks once; a compile that raises is a child that failed, not an exception in
    the parent."""
    import os

    from gmtool.kernels.compile_children import IN_CHILD, ChildCompiles

    children, prebuilding = ChildCompiles(), [True]

    def compile_ok():
        (tmp_path / "ok").write_text(f"{os.getpid()} {prebuilding[0]}")

    def compile_fails():
        raise RuntimeError("a compile failed")

    ok = children.start("a", compile_ok, prebuilding)
    assert children.start("a", compile_ok, prebuilding) is None
    bad = children.start("b", compile_fails, prebuilding)
    children.all_started()
    assert children.wait(ok) is True and children.wait(bad) is False
    pid, mode = (tmp_path / "ok").read_text().split(" ", 1)
    assert int(pid) != os.getpid() and mode == IN_CHILD and prebuilding == [True]


def test_a_child_compile_that_outlives_its_time_is_killed_and_reaped(monkeypatch):
    import os
    import time

    from gmtool.kernels.compile_children import ChildCompiles

    monkeypatch.setattr(ChildCompiles, "CHILD_TIMEOUT_S", 0.3)
    children = ChildCompiles()
    pid = children.start("k", lambda: time.sleep(60), [True])
    children.all_started()
    t0 = time.monotonic()
    assert children.wait(pid) is False and time.monotonic() - t0 < 10
    with pytest.raises(ChildProcessError):  # reaped: no zombie left
        os.waitpid(pid, os.WNOHANG)


@pytest.mark.parametrize("fork", ["1", "0"])
def test_in_the_pass_a_child_compiles_each_variant_before_its_worker_loads_it(monkeypatch, tmp_path, fork):
    """compiling_only() with a mode that queues compiles on its pool, as Triton's does: each new key's compile
    runs first in a forked child, then in the worker (which, with Triton, finds it in the disk cache and loads
    it); a key submitted again forks nothing. GMTOOL_COMPILE_FORK=0: the workers compile, as before."""
    import os

    from gmtool.kernels import compile_ahead

    class Kernel:
        def _init_handles(self):
            pass

    log = tmp_path / "log"

    def compile_of(name):
        def compile_fn():
            with open(log, "a") as f:
                f.write(f"{name} {os.getpid()}\n")
            return Kernel()

        return compile_fn

    monkeypatch.setenv("GMTOOL_COMPILE_FORK", fork)
    monkeypatch.setattr(compile_ahead, "_async_mode", lambda: QueuingMode)
    with compile_ahead.compiling_only(torch.device("cpu"), workers=2):
        for name in ("a", "b", "a"):
            QueuingMode.active.submit(name, compile_of(name))
    runs = [line.split() for line in log.read_text().splitlines()]
    me = str(os.getpid())
    for name in ("a", "b"):
        pids = [pid for n, pid in runs if n == name]
        if fork == "1":  # the child's run, then the worker's
            assert len(pids) == 2 and pids[0] != me and pids[1] == me, runs
        else:
            assert pids == [me], runs


def test_a_launch_like_one_held_is_held_once_and_the_longest_kernel_s_launches_replay_first(monkeypatch):
    """Launches that repeat one held (a later layer's: the same kernel, stand-ins, ints and constexprs) are not
    replayed again; the replays start with the kernel of the longest source (the longest compile), each kernel's
    in the order they came."""
    from types import SimpleNamespace

    from triton.runtime.jit import JITFunction

    from gmtool.kernels import compile_ahead

    calls = []
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, grid, warmup, **kw: calls.append((self.src, a, kw)))
    monkeypatch.setattr(compile_ahead, "_async_mode", lambda: FakeMode)
    short, long = SimpleNamespace(src="x = 1"), SimpleNamespace(src="a much longer kernel body")
    x = torch.zeros(64)
    with compile_ahead.compiling_only(torch.device("cpu"), workers=1):
        for layer in range(3):  # a layer's launches; its tensors differ, their stand-ins do not
            y = torch.zeros(64)
            JITFunction.run(short, y, 8, grid=(1,), warmup=False, BLOCK=16)
            JITFunction.run(long, y, 8, grid=(2,), warmup=False, BLOCK=16)
        JITFunction.run(short, x, 9, grid=(1,), warmup=False, BLOCK=16)  # another int: another launch
        JITFunction.run(short, x, 8, grid=(1,), warmup=False, BLOCK=32)  # another constexpr
        JITFunction.run(short, x[1:], 8, grid=(1,), warmup=False, BLOCK=16)  # a misaligned tensor
    assert [(src, a[1:], kw) for src, a, kw in calls] == [
        (long.src, (8,), {"BLOCK": 16}),
        (short.src, (8,), {"BLOCK": 16}),
        (short.src, (9,), {"BLOCK": 16}),
        (short.src, (8,), {"BLOCK": 32}),
        (short.src, (8,), {"BLOCK": 16}),
    ]
    assert calls[1][1][0].data_ptr() % 16 == 0 and calls[4][1][0].data_ptr() % 16 != 0

    calls.clear()  # equal values of other types (1, True, 1.0) are other variants to Triton: each held
    with compile_ahead.compiling_only(torch.device("cpu"), workers=1):
        for value in (1, True, 1.0, 1):
            JITFunction.run(short, x, value, grid=(1,), warmup=False, FLAG=value)
    assert [(type(a[1]), type(kw["FLAG"])) for _, a, kw in calls] == [(int, int), (bool, bool), (float, float)]


def test_a_compile_child_builds_the_launcher_in_a_process_of_its_own_beside_the_compile(monkeypatch, tmp_path):
    """In a compile child (IN_CHILD), Triton's compile hands the source to _build_launcher in a grandchild while
    it compiles, and returns once both are done; the worker's compile then follows, in this process."""
    import os
    import threading
    import time

    import triton.compiler as compiler_package

    from gmtool.kernels import compile_ahead

    def append(name, text):
        with open(tmp_path / name, "a") as f:
            f.write(text + "\n")

    class Kernel:
        def _init_handles(self):
            pass

    built = threading.Event()
    monkeypatch.setattr(
        compile_ahead, "_build_launcher", lambda src: append("launcher", f"{src} {os.getpid()}") or built.set()
    )
    here = os.getpid()

    def compile_kernel(src, **kw):
        if os.getpid() != here:
            time.sleep(0.3)  # the child's compile is the slow one: the worker's must still come after it
        append("kernel", str(os.getpid()))
        return Kernel()

    monkeypatch.setattr(compiler_package, "compile", compile_kernel)
    monkeypatch.setattr(compile_ahead, "_async_mode", lambda: QueuingMode)
    monkeypatch.setenv("GMTOOL_COMPILE_FORK", "1")
    with compile_ahead.compiling_only(torch.device("cpu"), workers=1):
        wrapped = compiler_package.compile  # what Triton's binder takes in the pass
        QueuingMode.active.submit("k", lambda: wrapped("SRC", target=7))
    assert built.wait(10)  # the worker's own launcher build (a disk-cache hit with Triton), in a thread here
    child, worker = (tmp_path / "kernel").read_text().split()
    builds = sorted(line.split() for line in (tmp_path / "launcher").read_text().splitlines())
    me = str(os.getpid())
    assert worker == me and child != me
    assert [src for src, _ in builds] == ["SRC", "SRC"]
    pids = {pid for _, pid in builds}
    assert me in pids and len(pids - {me, child}) == 1, (builds, child)  # the other: neither here nor the child


def test_every_child_is_forked_before_any_worker_compiles(monkeypatch, tmp_path):
    """The workers wait until the last child is forked (a fork copies the locks other threads hold: none may be
    compiling then), even where a child is done long before; a worker that gives up waiting closes the forking."""
    import os
    import time

    from gmtool.kernels import compile_ahead, compile_children, compile_marker

    events = []
    real_fork = compile_children.fork_to_run

    def logged_fork(fn, **kw):
        pid = real_fork(fn, **kw)
        events.append(("fork", time.monotonic()))
        return pid

    class Kernel:
        def _init_handles(self):
            pass

    def compile_fn():  # fast in the child; logged in this process
        if os.getpid() == here:
            events.append(("compile", time.monotonic()))
        return Kernel()

    here = os.getpid()
    monkeypatch.setattr(compile_children, "fork_to_run", logged_fork)
    monkeypatch.setattr(compile_children.ChildCompiles, "MAX_CHILDREN", 8)
    monkeypatch.setattr(compile_ahead, "_async_mode", lambda: QueuingMode)
    monkeypatch.setattr(compile_marker, "triton_cache_dir", lambda: tmp_path)
    monkeypatch.setenv("GMTOOL_COMPILE_FORK", "1")
    with compile_ahead.compiling_only(torch.device("cpu"), workers=2) as children:
        for key in "abc":
            QueuingMode.active.submit(key, compile_fn)
            time.sleep(0.2)  # the first child is done well before the last fork
    forks = [t for kind, t in events if kind == "fork"]
    compiles = [t for kind, t in events if kind == "compile"]
    assert len(forks) == 3 and len(compiles) == 3 and max(forks) < min(compiles), events
    assert children.failed == 0

    monkeypatch.setattr(compile_children.ChildCompiles, "STARTED_TIMEOUT_S", 0.1)
    late = compile_children.ChildCompiles()
    pid = late.start("a", lambda: None, [True])
    assert late.wait(pid) and late.closed  # no all_started(): the worker gave up waiting
    assert late.start("b", lambda: None, [True]) is None


def test_child_compiles_are_capped_and_off_where_the_worker_could_not_find_theirs(monkeypatch, tmp_path):
    """At most MAX_CHILDREN forks (the rest compile in the threads). No forks without a Triton cache directory,
    or where Triton compiles every time: the worker's compile would not find the child's."""
    from triton import knobs

    from gmtool.kernels import compile_marker
    from gmtool.kernels.compile_children import ChildCompiles, forks

    monkeypatch.setattr(ChildCompiles, "MAX_CHILDREN", 1)
    children = ChildCompiles()
    first = children.start("a", lambda: None, [True])
    assert first is not None and children.start("b", lambda: None, [True]) is None
    children.all_started()
    assert children.wait(first)

    monkeypatch.delenv("GMTOOL_COMPILE_FORK", raising=False)
    monkeypatch.setattr(compile_marker, "triton_cache_dir", lambda: tmp_path)
    assert forks()
    monkeypatch.setenv("GMTOOL_COMPILE_FORK", "0")
    assert not forks()
    monkeypatch.delenv("GMTOOL_COMPILE_FORK")
    monkeypatch.setattr(knobs.compilation, "always_compile", True)
    assert not forks()
    monkeypatch.setattr(knobs.compilation, "always_compile", False)
    monkeypatch.setattr(compile_marker, "triton_cache_dir", lambda: None)
    assert not forks()


def test_a_child_past_its_time_is_killed_with_its_own_children(monkeypatch, tmp_path):
    """The timeout counts from the fork, and the kill takes the child's process group: its launcher build and
    ptxas too, not only the child."""
    import time

    from gmtool.kernels.compile_children import ChildCompiles, fork_to_run

    def compile_fn():
        grandchild = fork_to_run(lambda: time.sleep(60))
        (tmp_path / "grandchild").write_text(str(grandchild))
        time.sleep(60)

    monkeypatch.setattr(ChildCompiles, "CHILD_TIMEOUT_S", 0.5)
    children = ChildCompiles()
    pid = children.start("k", compile_fn, [True])
    time.sleep(0.6)  # past its time before anyone waits: the wait kills it at once
    children.all_started()
    t0 = time.monotonic()
    assert children.wait(pid) is False and time.monotonic() - t0 < 0.5 and children.failed == 1
    grandchild = int((tmp_path / "grandchild").read_text())
    deadline = time.monotonic() + 5
    while time.monotonic() < deadline:
        try:
            state = open(f"/proc/{grandchild}/stat").read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:
            break  # gone
        if state == "Z":  # killed, not yet reaped by its new parent
            break
        time.sleep(0.05)
    else:
        raise AssertionError(f"grandchild {grandchild} still running")
