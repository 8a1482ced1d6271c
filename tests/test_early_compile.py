"""The decode attention's kernels launched for compiling while the model is built (gmtool.kernels.early_compile):
the geometry read from a config without transformers, the runs it refuses to guess for, each bucket's K/V write
and attention launched smallest first over an executor's input layout, and compiling_only() holding only its
own thread's launches. The GPU test (tests/gpu/test_fast_launch_gpu.py) checks that the captures then compile
nothing."""

from __future__ import annotations

import threading

import pytest
import torch

from gmtool.config import SweepConfig
from gmtool.kernels import early_compile


def _cfg(**kw) -> SweepConfig:
    return SweepConfig(**{"model": "qwen3-0.6b", "device": "cpu", "buckets": "1,2,4,8:64:8", **kw})


def test_the_geometry_is_read_from_a_profile_s_config_with_every_decode_bucket_within_the_sequence_slots():
    cfg = _cfg(max_num_seqs=32, max_kv_len=2048, block_size=32)
    g = early_compile.geometry(cfg, early_compile.raw_config("qwen3-0.6b"))
    assert (g.heads, g.kv_heads, g.head_dim) == (16, 8, 128)
    assert (g.block_size, g.max_kv_len, g.max_seqs) == (32, 2048, 32)
    assert g.sizes == (1, 2, 4, 8, 16, 24, 32)  # 40..64 hold more sequences than the slots: never a decode key
    assert g.max_tokens == cfg.policy().max_tokens and g.dtype == cfg.torch_dtype
    # no head_dim in the config: hidden size over heads, as transformers derives it
    llama = {"model_type": "llama", "num_attention_heads": 32, "hidden_size": 4096}
    g = early_compile.geometry(cfg, {**llama, "num_key_value_heads": 8})
    assert (g.heads, g.kv_heads, g.head_dim) == (32, 8, 128)
    assert early_compile.geometry(cfg, llama).kv_heads == 32


@pytest.mark.parametrize(
    "model, kw",
    [
        ("qwen3-0.6b", {"scenario": "prefill"}),  # varlen kernels: their launch shapes come from the batches
        ("qwen3-0.6b", {"pdl": True, "fuse": True, "small_m_gemm": True}),  # another variant of each kernel
        ("mistral-7b-v0.1", {}),  # a sliding window
        ("phi-3-mini", {}),
        ("gemma-2-2b", {}),  # soft-capped logits
        ("gemma-3-1b", {}),  # sliding layers
        ("gpt-oss-20b", {}),  # sinks
        ("deepseek-v2-lite", {}),  # MLA: V's head dim is its own
    ],
)
def test_no_guess_where_the_config_does_not_tell_the_variants(model, kw):
    assert early_compile.geometry(_cfg(model=model, **kw), early_compile.raw_config(model)) is None


@pytest.mark.parametrize("model_type", ["gemma2", "gemma", "mistral", "falcon", "gpt_bigcode", "cohere2", None])
def test_no_guess_for_a_family_whose_defaults_a_saved_config_leaves_out(model_type):
    """A saved config holds only what differs from its class's defaults: gemma2's window and soft-cap, falcon's
    single KV head, mistral's window are the defaults, absent from the JSON. Only families whose defaults are
    plain attention are read from the JSON alone."""
    raw = {"model_type": model_type, "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 128}
    assert early_compile.geometry(_cfg(), raw) is None
    assert early_compile.geometry(_cfg(), {**raw, "model_type": "qwen2"}) is not None


def test_a_window_switched_off_is_no_window_and_an_unreadable_config_no_geometry(tmp_path):
    raw = {**early_compile.raw_config("qwen3-0.6b"), "sliding_window": 4096, "use_sliding_window": False}
    assert early_compile.geometry(_cfg(), raw) is not None
    assert early_compile.geometry(_cfg(), {**raw, "use_sliding_window": True}) is None
    odd = {"model_type": "llama", "num_attention_heads": 12, "num_key_value_heads": 5, "head_dim": 64}
    assert early_compile.geometry(_cfg(), odd) is None  # heads not a multiple of the KV heads
    (tmp_path / "config.json").write_text("{not json")
    assert early_compile.raw_config(str(tmp_path)) is None
    assert early_compile.raw_config("no-such-model") is None
    (tmp_path / "config.json").write_text('{"num_attention_heads": 4, "head_dim": 16}')
    assert early_compile.raw_config(str(tmp_path)) == {"num_attention_heads": 4, "head_dim": 16}


def test_nothing_starts_off_cuda():
    assert early_compile.start(_cfg()) is None


def test_each_decode_bucket_s_write_and_attention_are_launched_smallest_first_over_the_executor_s_layout(
    monkeypatch,
):
    """On the CPU, with the torch attention standing in for Triton's and compiling_only() a plain context: the
    K/V write and the attention of every decode size, with the shapes and the metadata views an executor of
    the same geometry gives that bucket."""
    import contextlib

    from gmtool.core.buckets import BucketKey
    from gmtool.core.inputs import PersistentInputs
    from gmtool.kernels import compile_ahead, triton_prep
    from gmtool.model.attention import TorchAttention

    seen = []

    class Spy(TorchAttention):
        def write_kv(self, kc, vc, k, v, slots):
            seen.append(("write", tuple(k.shape), tuple(v.shape), slots.data_ptr(), tuple(kc.shape[1:])))

        def decode(self, ctx, q, kc, vc, scale, out, opts=None):
            v = ctx.views
            at = v.slot_mapping.data_ptr()
            seen.append(("decode", tuple(q.shape), (v.block_tables.data_ptr() - at, v.kv_lens.data_ptr() - at), at))

    @contextlib.contextmanager
    def plain(device, held_out=None):
        seen.append(("window",))
        yield None
        held_out.append(7)  # what compiling_only() counted: the run keeps it

    monkeypatch.setattr(compile_ahead, "compiling_only", plain)
    monkeypatch.setattr(triton_prep, "import_for_compiles", lambda: seen.append(("imports",)))
    cfg = _cfg(max_num_seqs=16, max_kv_len=256)
    geom = early_compile.geometry(cfg, early_compile.raw_config("qwen3-0.6b"))
    run = early_compile.EarlyCompile(geom)
    early_compile._compile(run, Spy(), torch.device("cpu"))
    assert run.error is None and run.seconds is not None
    # Triton's compile imports done before the window forks its compile children from this thread
    assert seen[:2] == [("imports",), ("window",)]
    decodes = [x for x in seen if x[0] == "decode"]
    writes = [x for x in seen if x[0] == "write"]
    assert [d[1] for d in decodes] == [(s, 16, 128) for s in (1, 2, 4, 8, 16)]
    assert [w[1] for w in writes] == [(s, 8, 128) for s in (1, 2, 4, 8, 16)]
    assert all(w[4] == (16, 8, 128) for w in writes)  # the cache's block: block size, kv heads, head dim
    # the metadata sits where an executor's own inputs put it for each key (its alignment is part of a variant)
    ref = PersistentInputs(cfg.policy().max_tokens, 16, 256 // 16, 1, torch.float32, torch.device("cpu"))
    for d, w, s in zip(decodes, writes, (1, 2, 4, 8, 16)):
        v = ref.views(BucketKey(s, None, True))
        at = v.slot_mapping.data_ptr()
        assert d[2] == (v.block_tables.data_ptr() - at, v.kv_lens.data_ptr() - at)
        assert w[3] == d[3]  # the write's slots are the step's slot mapping
    assert run.launches == 7


def test_a_failure_is_kept_in_one_line_and_the_build_goes_on(monkeypatch):
    from gmtool.model.attention import TorchAttention

    class Broken(TorchAttention):
        def write_kv(self, *a):
            raise ValueError("no such kernel\nsecond line")

    run = early_compile.EarlyCompile(early_compile.geometry(_cfg(), early_compile.raw_config("qwen3-0.6b")))
    monkeypatch.setattr("gmtool.kernels.compile_ahead.compiling_only", lambda *a, **k: _null())
    early_compile._compile(run, Broken(), torch.device("cpu"))
    assert run.error == "ValueError: no such kernel" and run.seconds is not None
    assert "failed (ValueError: no such kernel)" in run.summary()


def _null():
    import contextlib

    return contextlib.nullcontext()


def test_compiling_only_holds_its_own_thread_s_launches_and_runs_another_thread_s(monkeypatch):
    """The build's main thread goes on while the early compile holds its launches: a launch of the main thread
    (the GEMM warm-up's, a probe's) must run, not be held and dropped."""
    pytest.importorskip("triton")
    from triton.runtime.jit import JITFunction

    from gmtool.kernels import compile_ahead, launcher

    calls = []
    monkeypatch.setattr(JITFunction, "run", lambda self, *a, grid, warmup, **kw: calls.append((a, warmup)) or "ran")
    monkeypatch.setattr(compile_ahead, "_async_mode", lambda: _Mode)
    held: list[int] = []
    other = []
    with compile_ahead.compiling_only(torch.device("cpu"), workers=1, held_out=held):
        assert JITFunction.run(object(), 1, grid=(1,), warmup=False) is launcher.HELD
        t = threading.Thread(target=lambda: other.append(JITFunction.run(object(), 2, grid=(1,), warmup=False)))
        t.start()
        t.join()
        assert other == ["ran"] and calls == [((2,), False)]
    assert calls == [((2,), False), ((1,), True)]  # the held one compiled (a warmup) on leaving
    assert held == [1]


class _Mode:
    def __init__(self, pool):
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        pass


def test_a_refused_build_waits_for_the_early_compile_before_it_raises(monkeypatch):
    """check_fits refusing (or a load failing) while the thread holds its launches: the build joins it before
    the error reaches a caller that may go on to compile (its window on Triton's run must be over)."""
    from gmtool.errors import GmtoolError
    from gmtool.measure import workbench

    class Fake:
        joined = 0

        def join(self):
            Fake.joined += 1

    def refuse(cfg):
        raise GmtoolError("too big")

    monkeypatch.setattr(early_compile, "start", lambda cfg: Fake())
    monkeypatch.setattr("gmtool.memory.estimate.check_fits", refuse)
    with pytest.raises(GmtoolError, match="too big"):
        workbench.Workbench.build(_cfg(model="tiny-qwen3", buckets="1,2"))
    assert Fake.joined == 1


def test_two_threads_compiling_only_take_turns_and_leave_triton_s_run_as_found(monkeypatch):
    """The early compile's window and another (a second build's, or the pass) do not overlap: the second waits
    for the first to end. Overlapping, the one that ended last put back the other's stand-in for good, and a
    later thread reusing the first's id had its launches held and never run."""
    pytest.importorskip("triton")
    from triton.runtime.jit import JITFunction

    from gmtool.kernels import compile_ahead

    original = lambda self, *a, grid, warmup, **kw: "ran"  # noqa: E731
    monkeypatch.setattr(JITFunction, "run", original)
    monkeypatch.setattr(compile_ahead, "_async_mode", lambda: _Mode)
    inside, leave, order = threading.Event(), threading.Event(), []

    def first():
        with compile_ahead.compiling_only(torch.device("cpu"), workers=1):
            order.append("first in")
            inside.set()
            leave.wait(10)
            order.append("first out")

    def second():
        with compile_ahead.compiling_only(torch.device("cpu"), workers=1):
            order.append("second in")
        order.append("second out")

    a = threading.Thread(target=first)
    a.start()
    assert inside.wait(10)
    b = threading.Thread(target=second)
    b.start()
    b.join(0.3)
    assert b.is_alive() and order == ["first in"]  # waiting for the first window to end
    leave.set()
    a.join(10)
    b.join(10)
    assert order == ["first in", "first out", "second in", "second out"]
    assert JITFunction.run is original


def test_start_imports_triton_s_compile_modules_on_its_own_thread_before_the_compile_thread_runs(monkeypatch):
    """The main thread goes on to import transformers (torch._dynamo imports Triton's modules too): the modules
    a compile imports are imported before the thread starts, on the caller's thread, never beside that."""
    from types import SimpleNamespace

    from gmtool.kernels import compile_ahead, triton_prep

    cfg = _cfg()
    fake = SimpleNamespace(**{f: getattr(cfg, f) for f in ("model", "scenario", "tp", "pdl", "block_size")})
    fake.__dict__.update(
        max_kv_len=cfg.max_kv_len,
        max_num_seqs=cfg.max_num_seqs,
        torch_dtype=cfg.torch_dtype,
        policy=cfg.policy,
        torch_device=torch.device("cuda", 0),
        attention_backend="triton",
    )
    events = []
    monkeypatch.setattr(compile_ahead, "unavailable", lambda: None)
    monkeypatch.setattr(
        triton_prep, "import_compile_modules", lambda: events.append(("imports", threading.get_ident()))
    )
    monkeypatch.setattr("gmtool.kernels.TritonAttention", lambda: "backend")
    monkeypatch.setattr(
        early_compile,
        "_compile",
        lambda run, backend, device: events.append(("compile", threading.get_ident(), device)),
    )
    run = early_compile.start(fake)
    run.join()
    me = threading.get_ident()
    assert events[0] == ("imports", me)
    assert events[1][0] == "compile" and events[1][1] != me and events[1][2] == torch.device("cuda", 0)
    monkeypatch.setenv("GMTOOL_EARLY_COMPILE", "off")
    assert early_compile.start(fake) is None
