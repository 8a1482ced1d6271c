import pytest
import torch

from gmtool.core.backends.cpu import CpuTapeBackend, TapeGraph
from gmtool.core.buckets import BucketKey
from gmtool.errors import CaptureError, InputsNotLoaded
from gmtool.core.executor import AttentionRunner
from tests.helpers import Rig, rel


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-llama"])
def test_full_decode_graph_matches_eager_for_many_compositions(model):
    rig = Rig(model)
    for i, text in enumerate(["1*8", "1*5", "1*8", "1*6", "1*7"]):
        b = rig.batch(text, seed=i)
        assert rel(rig.graph(b), rig.eager(b)) < 1e-5, text
    # one graph served every batch of bucket 8: captured once, replayed with other kv lens / block tables
    assert list(rig.ex.graphs) == [BucketKey(8, None, True)]


def test_graph_cache_capture_on_miss_replay_on_hit():
    rig = Rig()
    captures = []
    real = rig.ex.capture
    rig.ex.capture = lambda key, batch: captures.append(key) or real(key, batch)
    for text in ["1*3", "1*4", "1*7", "1*2", "1*8", "1*16"]:
        rig.graph(rig.batch(text))
    assert captures == [BucketKey(4, None, True), BucketKey(8, None, True), BucketKey(16, None, True)]


def test_stale_input_not_copied_in_is_detected():
    """Replay reads only the persistent buffers: an input written elsewhere gives a wrong result."""
    rig = Rig()
    a, b = rig.batch("1*8", seed=1), rig.batch("1*8", seed=2)
    rig.graph(a)
    entry = rig.ex.graphs[BucketKey(8, None, True)]
    entry.replay(b)  # bug under test: batch b never copied into the persistent buffers
    stale = rig.ex.inputs.views(entry.key).logits[:8].clone()
    assert rel(stale, rig.eager(b)) > 1e-2
    assert rel(rig.graph(b), rig.eager(b)) < 1e-5  # with copy-in it is right again


@pytest.mark.parametrize("mode", ["full", "piecewise"])
def test_a_replay_over_another_bucket_s_inputs_is_refused(mode):
    """Keys lay the arena out at their own offsets: bucket 4's graph replayed after bucket 16 was loaded would read
    bucket 16's token ids as positions and its positions as sequence lengths (on the H200: an illegal address).
    The replay refuses; a load of its own batch makes it right again."""
    rig = Rig(mode=mode)
    small, large = rig.batch("1*4", seed=1), rig.batch("1*16", seed=2)
    rig.graph(small)
    rig.graph(large)
    entry = rig.ex.graphs[rig.ex.key_for(small)]
    with pytest.raises(InputsNotLoaded, match="another bucket"):
        entry.replay(small)
    entry = rig.ex.prepare(small)
    rig.ex.inputs.invalidate()  # poison and fault injection rewrite the padding: the layout stays bucket 4's
    entry.replay(small)
    assert rel(rig.ex.inputs.output(entry.key, 4).clone(), rig.eager(small)) < 1e-5


def test_replacing_a_buffer_object_is_not_seen_by_replay():
    """A graph reads the tensors it captured: pointing the views at a new tensor holding batch b changes
    nothing, and the replay (staging still holds batch a) computes batch a's result again."""
    rig = Rig()
    key = BucketKey(4, None, True)
    a, b = rig.batch("1*4", seed=1), rig.batch("1*4", seed=2)
    out_a = rig.graph(a)
    ref_b = rig.eager(b)
    assert rel(out_a, ref_b) > 1e-2  # the two results differ: the checks below can tell them apart
    views = rig.ex.inputs.views(key)
    views.input_ids = torch.tensor(b.input_ids)  # a new tensor, not a copy into the captured one
    logits = rig.ex.inputs.views(key).logits  # the output buffer, a view of the storage the graph writes
    logits.fill_(float("nan"))  # what the replay does not write stays NaN
    rig.ex.graphs[key].steps[0].replay()
    out = logits[:4].clone()
    assert not out.isnan().any()  # the replay wrote the output...
    assert torch.equal(out, out_a)  # ...with batch a's result, recomputed
    assert rel(out, ref_b) > 1e-2  # not b's


def test_padding_is_zeroed_and_addresses_are_stable():
    rig = Rig()
    inputs = rig.ex.inputs
    key = BucketKey(8, None, True)
    v1 = inputs.load(rig.batch("1*8", seed=3), key)
    ptrs = [t.data_ptr() for t in (v1.input_ids, v1.block_tables, v1.kv_lens, v1.logits)]
    v2 = inputs.load(rig.batch("1*5", seed=4), key)
    assert [t.data_ptr() for t in (v2.input_ids, v2.block_tables, v2.kv_lens, v2.logits)] == ptrs
    assert v2.input_ids[5:].eq(0).all() and v2.slot_mapping[5:].eq(0).all() and v2.kv_lens[5:].eq(0).all()
    assert v2.block_tables[5:].eq(0).all() and v2.token_seq[5:].eq(-1).all()
    assert v2.cu_q.tolist() == [0, 1, 2, 3, 4, 5, 5, 5, 5]
    # every bucket's views are slices of one arena sized for the largest bucket
    assert v2.input_ids.data_ptr() == inputs.arena.data_ptr()
    small = inputs.views(BucketKey(4, None, True))
    assert small.input_ids.data_ptr() == v2.input_ids.data_ptr() and small.input_ids.numel() == 4


def test_slot_mapping_follows_block_tables():
    rig = Rig()
    b = rig.batch("3@20+1*2", seed=5)
    bs = rig.cache.spec.block_size
    pos, slots = b.positions.tolist(), b.slot_mapping.tolist()
    assert pos[:3] == [20, 21, 22]
    for t, (p, s) in enumerate(zip(pos[:3], slots[:3])):
        assert s == b.block_tables[0][p // bs] * bs + p % bs
    assert b.kv_lens[0] == 23 and all(0 not in row for row in b.block_tables)  # block 0 is the null block


def test_piecewise_instruction_order_alternates_graph_and_runner():
    rig = Rig(mode="piecewise")
    b = rig.batch("8+8", seed=1)
    rig.graph(b)
    steps = rig.ex.graphs[rig.ex.key_for(b)].steps
    kinds = ["runner" if isinstance(s, AttentionRunner) else "graph" for s in steps]
    n = rig.lm.num_layers
    assert kinds == ["graph", "runner"] * n + ["graph"]  # the last piece ends with the LM head
    assert [s.layer for s in steps if isinstance(s, AttentionRunner)] == list(range(n))


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-llama"])
def test_piecewise_matches_eager_for_prefill_mixes(model):
    rig = Rig(model, mode="piecewise")
    for i, text in enumerate(["16+16", "8*4", "4*8", "20+12@64", "26+2@40+1*4"]):
        b = rig.batch(text, seed=i)
        assert rel(rig.graph(b), rig.eager(b)) < 1e-5, text
    assert len(rig.ex.graphs) == 1  # one piecewise graph (key: 32 tokens) served every mix


def test_runner_with_stale_metadata_gives_wrong_result():
    rig = Rig(mode="piecewise")
    a, b = rig.batch("16+16", seed=1), rig.batch("4*8", seed=2)
    rig.graph(a)
    rig.ex.refresh_runner_metadata = False  # the bug: runners keep the capture batch's plan
    assert rel(rig.graph(b), rig.eager(b)) > 1e-2
    rig.ex.refresh_runner_metadata = True
    assert rel(rig.graph(b), rig.eager(b)) < 1e-5


def test_the_upload_replay_at_capture_keeps_the_baked_plan(monkeypatch):
    """On CUDA a capture ends with the graph's first launch (its upload, for the ledger), a replay that prepares
    the context again. The plan the graph baked in must be taken before it, or a narrow full graph is never
    flagged. The CPU has no upload: _memory_of is made to run it here as on CUDA."""
    import contextlib

    from gmtool.core import executor

    @contextlib.contextmanager
    def memory_of(entry, device, upload=None, held=None):
        yield
        if upload is not None:
            upload()

    monkeypatch.setattr(executor, "_memory_of", memory_of)
    narrow = Rig(mode="full")
    a, b = narrow.batch("16+16", seed=1), narrow.batch("8*4", seed=2)
    narrow.graph(a)
    entry = narrow.ex.graphs[narrow.ex.key_for(b)]
    assert entry.baked_plans and entry.stale_metadata(b) and not entry.stale_metadata(a)


def test_capture_uploads_whole_graphs_without_running_them():
    """A capture ends with the graphs' upload (the ledger's memory outside the pool). Steps that can upload
    alone (CUDA: cuGraphUpload) are not run; a step that cannot (a runner), or an upload the driver refused,
    makes the entry replay the capture's batch once instead."""
    from types import SimpleNamespace

    from gmtool.core.executor import CapturedGraph
    from gmtool.modes import GraphMode

    class Step:
        def __init__(self, ok=True, can=True):
            self.ok, self.uploads, self.replays = ok, 0, 0
            if not can:
                self.upload = None

        def upload(self):
            self.uploads += 1
            return self.ok

        def replay(self):
            self.replays += 1

    ctx = SimpleNamespace(prepare=lambda plan: None)
    batch = SimpleNamespace(plan=None)

    def entry(*steps):
        e = CapturedGraph(BucketKey(8, 8, True), GraphMode.FULL, "test", list(steps), ctx, launch_path="python: test")
        e.upload(batch)
        return [(s.uploads, s.replays) for s in steps]

    assert entry(Step(), Step()) == [(1, 0), (1, 0)]
    assert entry(Step(), Step(ok=False)) == [(1, 1), (1, 1)]  # a refusal: one replay of every step
    assert entry(Step(ok=False), Step()) == [(1, 1), (0, 1)]
    assert entry(Step(), Step(can=False)) == [(0, 1), (0, 1)]


def test_narrow_full_graph_for_prefill_is_flagged_and_wide_key_is_safe():
    narrow = Rig(mode="full")
    a, b = narrow.batch("16+16", seed=1), narrow.batch("8*4", seed=2)
    narrow.graph(a)
    out = narrow.graph(b)
    entry = narrow.ex.graphs[narrow.ex.key_for(b)]
    assert entry.stale_metadata(b) and not entry.stale_metadata(a)
    assert rel(out, narrow.eager(b)) > 1e-2
    wide = Rig(mode="full", wide_key=True)
    for i, text in enumerate(["16+16", "20+12@64", "30+2"]):
        bb = wide.batch(text, seed=i)
        assert rel(wide.graph(bb), wide.eager(bb)) < 1e-5
    assert len(wide.ex.graphs) == 1  # same (32 tokens, 2 seqs) key, three different splits, no stale plan
    assert not any(e.baked_plans for e in wide.ex.graphs.values())


def test_tape_refuses_host_sync_during_capture():
    be = CpuTapeBackend()
    x = torch.ones(3)
    be.begin()
    with pytest.raises(CaptureError, match="host sync"):
        x.sum().item()
    be.abort()


@pytest.mark.parametrize(
    "read, why",
    [
        (lambda x: x.tolist(), "Tensor.tolist"),
        (lambda x: x.numpy(), "Tensor.numpy"),
        (lambda x: x[x > 1], "boolean mask"),
        (lambda x: x.masked_fill(x > 1, 0)[x > 0], "boolean mask"),
        (lambda x: torch.repeat_interleave(x, x), "sized by a tensor's values"),
        (lambda x: torch.masked_select(x, x > 1), "sized by a tensor's values"),
        (lambda x: torch.unique(x), "sized by a tensor's values"),
    ],
)
def test_tape_refuses_what_a_cuda_capture_would_wait_for(read, why):
    """What reads a tensor's values on the host, or sizes an output by them, fails a CUDA capture: the tape
    must refuse it too, or a model the CPU passes breaks on the GPU. The backend is usable after."""
    be = CpuTapeBackend()
    x = torch.arange(4)
    be.begin()
    with pytest.raises(CaptureError, match=why):
        read(x)
    be.abort()
    x.tolist(), torch.repeat_interleave(x, x)  # outside a capture: allowed
    be.begin()
    torch.repeat_interleave(x, x, output_size=6)  # its size given: no sync, captured
    x[torch.tensor([0, 2])]  # an index tensor, not a mask
    x[x > 2] = 0  # one value through a mask: ATen makes it a masked_fill_, no sync
    be.end()
    be.begin()
    with pytest.raises(CaptureError, match="boolean mask"):
        x[x > -1] = torch.arange(4)  # values for each selected element: their count is the mask's
    be.abort()


def test_out_of_memory_at_capture_end_stays_out_of_memory(monkeypatch):
    """capture_end's OutOfMemory is the sweep's OOM row (the mode stops there), not a plain capture error."""
    from gmtool.errors import OutOfMemory

    rig = Rig()
    rig.graph(rig.batch("1*4"))

    def end():
        raise OutOfMemory("out of memory while capturing")

    monkeypatch.setattr(rig.ex.backend, "end", end)
    with pytest.raises(OutOfMemory, match="out of memory while capturing"):
        rig.graph(rig.batch("1*8"))
    assert rig.ex.backend._tape is None


@pytest.mark.parametrize("raised", [IndexError("index 9 is out of bounds"), KeyboardInterrupt()])
def test_a_capture_that_raises_leaves_the_backend_usable(raised):
    """Whatever a forward raises under capture (a model's IndexError, a Triton compile error, Ctrl-C), the capture
    ends: a tape left recording would take in every later op of the process, and the next capture would fail."""
    from torch.utils._python_dispatch import _get_current_dispatch_mode

    rig = Rig()
    rig.graph(rig.batch("1*4"))  # the first capture warms the backend up
    record = rig.ex.forward_impl.record

    def failing(ex, entry, fn):
        fn()
        raise raised

    rig.ex.forward_impl.record = failing
    if isinstance(raised, KeyboardInterrupt):
        with pytest.raises(KeyboardInterrupt):
            rig.graph(rig.batch("1*8"))
    else:
        with pytest.raises(CaptureError, match="bucket .*8.* failed: IndexError: index 9 is out of bounds"):
            rig.graph(rig.batch("1*8"))
    assert _get_current_dispatch_mode() is None and rig.ex.backend._tape is None
    rig.ex.forward_impl.record = record
    b = rig.batch("1*16", seed=3)
    assert rel(rig.graph(b), rig.eager(b)) < 1e-5


def test_tape_replays_an_op_that_returns_a_list_of_one():
    be = CpuTapeBackend()
    x = torch.arange(6.0).reshape(3, 2)
    out = torch.zeros(3, 2)
    be.begin()
    (y,) = torch.split(x * 1, 4)  # one piece: aten.split returns a list of one tensor
    out.copy_(y + 1)
    del y
    g: TapeGraph = be.end()
    x.add_(100)
    g.replay()
    assert torch.equal(out, x + 1)


def test_tape_replay_reruns_over_the_same_tensors():
    be = CpuTapeBackend()
    x = torch.arange(4.0)
    out = torch.zeros(4)
    be.begin()
    y = x * 2 + 1
    out.copy_(y.relu())
    g: TapeGraph = be.end()
    x.copy_(torch.tensor([-5.0, 1.0, 2.0, 3.0]))
    g.replay()
    assert out.tolist() == [0.0, 3.0, 5.0, 7.0]


def test_fx_piecewise_splits_at_attention_and_matches_eager():
    rig = Rig(mode="piecewise", piecewise_impl="fx")
    fx = rig.ex.forward_impl.active.fx
    for i, text in enumerate(["16+16", "8*4", "20+12@64"]):
        b = rig.batch(text, seed=i)
        assert rel(rig.graph(b), rig.eager(b)) < 1e-5, text
    entry = rig.ex.graphs[rig.ex.key_for(b)]
    n = rig.lm.num_layers
    assert fx.splits == [(n + 1, n)]  # traced once for the 32-token shape: n attention submodules
    # n + 1 pieces, then the LM head's own graph (the pieces capture themselves; the head is captured after them)
    assert (entry.pieces, entry.runners) == (n + 2, n) and entry.piecewise_impl == "fx"
    assert entry.compile_s is not None and entry.compile_s > 0
    # each runner's op call bound once (K/V write, then attention): replays skip the submodule and the dispatcher
    assert all(s.launch is not None for s in entry.steps if getattr(s, "is_runner", False))


def test_fx_piecewise_runner_reads_current_metadata():
    rig = Rig(mode="piecewise", piecewise_impl="fx")
    a, b = rig.batch("16+16", seed=1), rig.batch("4*8", seed=2)
    rig.graph(a)
    rig.ex.refresh_runner_metadata = False
    assert rel(rig.graph(b), rig.eager(b)) > 1e-2
    rig.ex.refresh_runner_metadata = True
    assert rel(rig.graph(b), rig.eager(b)) < 1e-5


def test_fx_falls_back_to_runtime_split_when_tracing_fails(monkeypatch):
    rig = Rig(mode="piecewise", piecewise_impl="fx")
    fx = rig.ex.forward_impl.active.fx

    def broken(*args, **kwargs):
        raise RuntimeError("cannot trace this model")

    monkeypatch.setattr(fx, "compiled", broken)
    b = rig.batch("16+16", seed=1)
    assert rel(rig.graph(b), rig.eager(b)) < 1e-5
    entry = rig.ex.graphs[rig.ex.key_for(b)]
    assert entry.piecewise_impl.startswith("breakable (fx could not trace") and entry.runners == rig.lm.num_layers


def test_fx_fallback_is_for_a_model_it_cannot_trace_not_for_a_shape_that_fails(monkeypatch):
    """Out of memory at a later bucket is the run's (an OOM row), and a trace failure once a shape has traced
    is that shape's (an error row): neither turns fx into the runtime split for the rest of the run."""
    rig = Rig(mode="piecewise", piecewise_impl="fx")
    fx = rig.ex.forward_impl.active.fx
    rig.graph(rig.batch("16+16", seed=1))
    real = fx.forward

    def failing(error):
        def forward(*args, **kwargs):
            raise error

        return forward

    monkeypatch.setattr(fx, "forward", failing(torch.OutOfMemoryError("CUDA out of memory. Tried 2 GiB")))
    with pytest.raises(torch.OutOfMemoryError):
        rig.graph(rig.batch("4+4", seed=2))
    monkeypatch.setattr(fx, "forward", failing(ValueError("a guard dynamo cannot build")))
    with pytest.raises(CaptureError, match="fx could not trace this shape: a guard dynamo cannot build"):
        rig.graph(rig.batch("4+4", seed=2))
    monkeypatch.setattr(fx, "forward", real)
    b = rig.batch("8+8", seed=3)
    assert rel(rig.graph(b), rig.eager(b)) < 1e-5
    assert rig.ex.graphs[rig.ex.key_for(b)].piecewise_impl == "fx" and rig.ex.forward_impl.reason is None


def test_graph_copies_its_own_inputs():
    """Copy-in is the graph's first node: prepare only writes the staging arena; the replay reads it."""
    rig = Rig()
    a, b = rig.batch("1*4", seed=1), rig.batch("1*4", seed=2)
    rig.graph(a)
    key = rig.ex.key_for(b)
    entry = rig.ex.prepare(b)
    views = rig.ex.inputs.views(key)
    assert entry.copies_inputs and views.input_ids.tolist() == a.input_ids.tolist()  # not copied yet
    entry.replay(b)
    assert views.input_ids.tolist() == b.input_ids.tolist()
    assert rel(views.logits[:4].clone(), rig.eager(b)) < 1e-5


@pytest.mark.parametrize("mode", ["full", "piecewise", "auto"])
def test_release_leaves_no_graph_alive_through_an_entry_a_caller_holds(mode):
    """A loop's last `entry` outlives the executor's release: it must not keep its graphs (and their pool) alive,
    or a VMM strategy cannot unmap, and the process cannot start another one."""
    import gc
    import weakref

    rig = Rig(mode=mode)
    b = rig.batch("8*4", seed=1)
    rig.graph(b)
    parts = getattr(rig.ex, "parts", {"": rig.ex}).values()
    held = [e for ex in parts for e in ex.graphs.values()]
    graphs = [weakref.ref(s) for e in held for s in e.steps if isinstance(s, TapeGraph)]
    assert held and graphs
    rig.ex.release()
    gc.collect()
    assert all(e.steps == [] for e in held) and all(g() is None for g in graphs)


@pytest.mark.parametrize("mode", ["full", "piecewise"])
def test_capture_runs_with_the_gc_frozen_and_leaves_it_as_it_was(mode):
    """A full collection walks every object the process holds (0.2 s with a built model here); a capture's
    forwards freeze them first, so one that falls inside a capture walks only what the capture made."""
    import gc

    rig = Rig(mode=mode)
    seen = []
    real = rig.ex.forward_impl.record
    rig.ex.forward_impl.record = lambda ex, entry, fn: seen.append(gc.get_freeze_count()) or real(ex, entry, fn)
    assert gc.get_freeze_count() == 0
    rig.graph(rig.batch("1*4", seed=1))
    assert seen and seen[0] > 1000  # the model and its modules, at least
    assert gc.get_freeze_count() == 0
    # a caller that froze the GC itself keeps its frozen objects frozen
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        rig.graph(rig.batch("1*8", seed=2))
        assert gc.get_freeze_count() > frozen - 1000  # (a few die by reference count; thawed, it would be 0)
    finally:
        gc.unfreeze()
