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
    g = early_compile.geometry(cfg, {"num_attention_heads": 32, "num_key_value_heads": 8, "hidden_size": 4096})
    assert (g.heads, g.kv_heads, g.head_dim) == (32, 8, 128)
    assert early_compile.geometry(cfg, {"num_attention_heads": 32, "hidden_size": 4096}).kv_heads == 32


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


def test_a_window_switched_off_is_no_window_and_an_unreadable_config_no_geometry(tmp_path):
    raw = {**early_compile.raw_config("qwen3-0.6b"), "sliding_window": 4096, "use_sliding_window": False}
    assert early_compile.geometry(_cfg(), raw) is not None
    assert early_compile.geometry(_cfg(), {**raw, "use_sliding_window": True}) is None
    assert early_compile.geometry(_cfg(), {"num_attention_heads": 12, "num_key_value_heads": 5, "head_dim": 64}) is None
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
    from gmtool.kernels import compile_ahead
    from gmtool.model.attention import TorchAttention

    seen = []

    class Spy(TorchAttention):
        def write_kv(self, kc, vc, k, v, slots):
            seen.append(("write", tuple(k.shape), tuple(v.shape), slots.data_ptr(), tuple(kc.shape[1:])))

        def decode(self, ctx, q, kc, vc, scale, out, opts=None):
            views = ctx.views
            seen.append(("decode", tuple(q.shape), views.block_tables.data_ptr() - views.slot_mapping.data_ptr()))

    @contextlib.contextmanager
    def plain(device, held_out=None):
        yield None
        held_out.append(len(seen))

    monkeypatch.setattr(compile_ahead, "compiling_only", plain)
    cfg = _cfg(max_num_seqs=16, max_kv_len=256)
    geom = early_compile.geometry(cfg, early_compile.raw_config("qwen3-0.6b"))
    run = early_compile.EarlyCompile(geom)
    early_compile._compile(run, Spy(), torch.device("cpu"))
    assert run.error is None and run.seconds is not None
    decodes = [x for x in seen if x[0] == "decode"]
    writes = [x for x in seen if x[0] == "write"]
    assert [d[1] for d in decodes] == [(s, 16, 128) for s in (1, 2, 4, 8, 16)]
    assert [w[1] for w in writes] == [(s, 8, 128) for s in (1, 2, 4, 8, 16)]
    assert all(w[4] == (16, 8, 128) for w in writes)  # the cache's block: block size, kv heads, head dim
    # the metadata sits where an executor's own inputs put it for each key (its alignment is part of a variant)
    ref = PersistentInputs(cfg.policy().max_tokens, 16, 256 // 16, 1, torch.float32, torch.device("cpu"))
    for d, s in zip(decodes, (1, 2, 4, 8, 16)):
        v = ref.views(BucketKey(s, None, True))
        assert d[2] == v.block_tables.data_ptr() - v.slot_mapping.data_ptr()
    assert run.launches == len(seen) == 10


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
