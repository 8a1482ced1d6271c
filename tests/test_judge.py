"""The judge must be able to fail: each test breaks one thing a graph must do and checks that the sweep's own
check (what users see) reports it, or checks one piece of the error arithmetic against a case built to fool it."""

import json

import pytest
import torch
from typer.testing import CliRunner

from gmtool.core.backends import cpu as tape
from gmtool.measure.check import EagerReference, ReplayCheck, checked_replay, written_kv
from gmtool.cli.main import app
from gmtool.config import SweepConfig
from gmtool.measure.sweep import Sweep
from gmtool.measure.timing import rel_err_per_seq, summarize, tolerances_for
from tests.helpers import Rig

runner = CliRunner()


def _capture(tmp_path, *args):
    out = tmp_path / "run"
    r = runner.invoke(
        app, ["capture", "--device", "cpu", "--num-iters", "2", "--num-iters-warmup", "0", "--out", str(out), *args]
    )
    rows = json.loads((out / "results.json").read_text())["records"] if (out / "results.json").exists() else []
    return r.exit_code, r.output, rows


def _no_replay(monkeypatch):
    monkeypatch.setattr(tape.TapeGraph, "replay", lambda self: None)


def _drop_kv_write_from_tape(monkeypatch):
    """Capture runs index_copy_ (the KV write) but leaves it off the tape: replays never write K/V."""
    real = tape._Tape.__torch_dispatch__

    def dispatch(self, func, types, args=(), kwargs=None):
        n = len(self.ops)
        out = real(self, func, types, args, kwargs)
        if func.__name__.startswith("index_copy"):
            del self.ops[n:]
        return out

    monkeypatch.setattr(tape._Tape, "__torch_dispatch__", dispatch)


# -- blind spot 1: a graph that is never replayed ----------------------------------------------------------
def test_sanity_the_same_sweep_passes_with_a_working_replay(tmp_path):
    code, out, rows = _capture(tmp_path, "--buckets", "1,2,4", "--compositions", "1*1,1*2,1*4")
    graph = [r for r in rows if r["mode"] == "full"]
    assert code == 0, out
    assert len(graph) == 3 and all(r["status"] == "ok" for r in graph)
    assert all(r["kv_rel_err"] <= 1e-5 and r["kv_rel_err_same_shape"] <= 1e-5 for r in graph)


def test_a_graph_that_is_never_replayed_is_unsafe(tmp_path, monkeypatch):
    """Each bucket replays only the batch it was captured with: the output buffer already holds its logits."""
    _no_replay(monkeypatch)
    code, out, rows = _capture(tmp_path, "--buckets", "1,2,4", "--compositions", "1*1,1*2,1*4")
    graph = [r for r in rows if r["mode"] == "full"]
    assert code == 3, out
    assert len(graph) == 3 and all(r["status"] == "UNSAFE" and r["latency_ms"] is None for r in graph)
    assert "UNSAFE" in out


def test_a_graph_that_is_never_replayed_is_unsafe_with_default_compositions(tmp_path, monkeypatch):
    _no_replay(monkeypatch)
    code, _, rows = _capture(tmp_path, "--buckets", "2,4")
    graph = [r for r in rows if r["mode"] == "full"]
    assert code == 3 and graph and all(r["status"] == "UNSAFE" for r in graph)


# -- blind spot 2: a graph that never writes K/V -----------------------------------------------------------
def test_a_graph_that_never_writes_kv_is_unsafe_in_decode(tmp_path, monkeypatch):
    _drop_kv_write_from_tape(monkeypatch)
    code, _, rows = _capture(tmp_path, "--buckets", "4,8")
    graph = [r for r in rows if r["mode"] == "full"]
    assert code == 3 and len(graph) >= 6
    assert all(r["status"] == "UNSAFE" and r["kv_rel_err"] is None for r in graph)  # NaN K/V: infinite, null


def test_a_graph_that_never_writes_kv_is_unsafe_in_mixed_prefill_bf16(tmp_path, monkeypatch):
    _drop_kv_write_from_tape(monkeypatch)
    code, _, rows = _capture(
        tmp_path, "--scenario", "mixed", "--dtype", "bf16", "--buckets", "16", "--compositions", "8+1*8,4@20+1*12,16"
    )
    graph = [r for r in rows if r["mode"] == "full"]
    assert code == 3 and len(graph) == 3 and all(r["status"] == "UNSAFE" for r in graph)


def test_the_kv_comparison_itself_sees_a_missing_write():
    """checked_replay reports the K/V error, not only the logits' (which the NaN in the slots also spoils)."""
    rig = Rig(buckets=(8,))
    batch = rig.batch("1*6", seed=3)
    ref = EagerReference(rig.eager(batch).clone(), written_kv(rig.cache, batch))
    entry, check, _ = checked_replay(rig.ex, batch, ref)
    assert check.kv_rel_err < 1e-5 and check.kv_rel_err_same_shape < 1e-5 and check.failure(1e-5, 1e-3) is None
    rig.ex.graphs.clear()
    with pytest.MonkeyPatch.context() as mp:
        _drop_kv_write_from_tape(mp)
        entry, check, _ = checked_replay(rig.ex, batch, ref)
    assert check.kv_rel_err == float("inf") and check.failure(1e-5, 1e-3) is not None


def test_failure_names_the_kv_when_only_the_kv_differs():
    check = ReplayCheck(0.0, 0.0, float("nan"), 0.0, False)
    assert "K/V" in check.failure(1e-5, 1e-3)
    check = ReplayCheck(0.0, 0.0, 0.0, 2e-5, False)
    assert "K/V" in check.failure(1e-5, 1e-3)
    assert ReplayCheck(0.0, 1e-6, 1e-4, 1e-6, False).failure(1e-5, 1e-3) is None
    assert "stale" in ReplayCheck(0.0, 0.0, 0.0, 0.0, True).failure(1e-5, 1e-3)
    assert "unpadded" in ReplayCheck(float("nan"), 0.0, 0.0, 0.0, False).failure(1e-5, 1e-3)


# -- blind spot 3: keys that share a token count -----------------------------------------------------------
def test_keys_sharing_a_token_count_get_their_own_graphs(tmp_path):
    code, out, rows = _capture(
        tmp_path, "--scenario", "prefill", "--mode", "full", "--buckets", "32", "--compositions", "16+16,8*4,1*8+8*3"
    )
    graph = [r for r in rows if r["mode"] == "full"]
    assert code == 0, out
    assert [r["key"] for r in graph] == ["t32xs2", "t32xs4", "t32xs11"]
    assert all(r["status"] == "ok" and r["capture_s"] is not None for r in graph)  # each captured its own


def test_graph_lookup_by_num_tokens_only_is_caught_not_a_crash(tmp_path, monkeypatch):
    """A graph cache that finds graphs by num_tokens alone serves the first key's graph to the others: the
    sweep must report those replays as wrong, never end in a KeyError."""
    from gmtool.core.executor import GraphExecutor

    class ByTokens(dict):
        def get(self, key, default=None):
            return next((v for k, v in self.items() if k.num_tokens == key.num_tokens), default)

    real = GraphExecutor.__init__

    def init(self, *a, **kw):
        real(self, *a, **kw)
        self.graphs = ByTokens()

    monkeypatch.setattr(GraphExecutor, "__init__", init)
    code, out, rows = _capture(
        tmp_path, "--scenario", "prefill", "--mode", "full", "--buckets", "32", "--compositions", "16+16,8*4,1*8+8*3"
    )
    graph = [r for r in rows if r["mode"] == "full"]
    assert code == 3, out
    assert [r["status"] for r in graph] == ["ok", "UNSAFE", "UNSAFE"]


# -- the error arithmetic ----------------------------------------------------------------------------------
def test_latency_summary_is_the_median_not_the_mean():
    s = summarize([1.0, 1.0, 1.0, 1.0, 100.0])
    assert s.median == 1.0 and s.min == 1.0 and s.n == 5


def test_one_wrong_sequence_of_eight_is_the_error():
    ref = torch.randn(8, 64, dtype=torch.float64)
    out = ref.clone()
    out[5] *= 1.5  # relative error 0.5 in one sequence, 0 in the others: the mean would be 0.0625
    assert rel_err_per_seq(out, ref) == pytest.approx(0.5)
    out[2, 0] = float("nan")
    assert rel_err_per_seq(out, ref) == float("inf")


def test_same_shape_error_is_measured_against_eager_not_a_second_replay(tmp_path):
    """full-narrow replays the capture-time plan: a second replay agrees with it, eager does not."""
    code, out, rows = _capture(
        tmp_path,
        "--scenario",
        "prefill",
        "--mode",
        "full-narrow",
        "--buckets",
        "32",
        "--compositions",
        "16+16,8*4,20+12@40",
    )
    graph = [r for r in rows if r["mode"] == "full-narrow"]
    tol_same, _ = tolerances_for(torch.float32)
    assert [r["status"] for r in graph] == ["ok", "UNSAFE", "UNSAFE"]
    assert graph[0]["max_rel_err_same_shape"] <= tol_same
    assert all(r["max_rel_err_same_shape"] > 1e-2 and r["stale_metadata"] for r in graph[1:])
    assert code == 0, out  # full-narrow's UNSAFE rows are the finding it exists to show


def test_sweep_records_carry_the_kv_error():
    cfg = SweepConfig(device="cpu", buckets="2", modes=("full", "piecewise"), num_iters=1, num_iters_warmup=0)
    res = Sweep(cfg).run()
    rows = [r.to_dict() for r in res.records if r.mode != "eager"]
    assert rows and all(r["status"] == "ok" and r["kv_rel_err"] is not None for r in rows)


def test_a_sweep_notes_what_each_mode_s_captures_cost(monkeypatch):
    """Per graph mode (auto: its two parts together): how many graphs, their capture_s summed, the eager warm-up,
    and compile-ahead's pass where it ran (here pretended for full graphs: the CPU compiles nothing)."""
    from gmtool.core.auto import parts_of
    from gmtool.core.executor import GraphExecutor
    from gmtool.measure import sweep
    from gmtool.measure.sweep import capture_cost_note
    from gmtool.modes import GraphMode

    cfg = SweepConfig(device="cpu", buckets="2,4", modes=("full", "piecewise", "auto"), num_iters=1, num_iters_warmup=0)
    captured, released, real, release = [], {}, GraphExecutor.capture, sweep._release

    def capture(self, key, batch):
        entry = real(self, key, batch)
        captured.append((id(self), entry.capture_s, entry.warmup_s))
        self.compile_ahead_s = 1.25 if self.mode == "full" else None
        return entry

    monkeypatch.setattr(GraphExecutor, "capture", capture)
    monkeypatch.setattr(
        sweep, "_release", lambda executors, **kw: (released.update(executors), release(executors, **kw))
    )
    res = Sweep(cfg).run()
    counted = 0
    for mode in ("full", "piecewise", "auto"):
        ids = {id(p) for p in parts_of(released[mode])}
        mine = [c for c in captured if c[0] in ids]
        counted += len(mine)
        (note,) = [n for n in res.notes if n.startswith(f"capture cost, {mode}: ")]
        assert note.startswith(
            f"capture cost, {mode}: {len(mine)} graphs captured in {sum(c[1] for c in mine):.2f} s, "
        )
        assert f"{sum(c[2] for c in mine):.2f} s of eager warm-up" in note
        assert ("compiled ahead of the first in 1.25 s" in note) == (mode != "piecewise")  # auto's full part
    assert counted == len(captured) == 6  # two buckets a mode; every capture in one mode's note

    class Bare:
        graphs, compile_ahead_s = {}, None

    assert capture_cost_note(GraphMode.FULL, Bare()) is None  # nothing captured: nothing to say

    # fx: a shape's warm-up traces it; those seconds are said as tracing, not as eager warm-up
    from types import SimpleNamespace

    e = SimpleNamespace(capture_s=0.01, warmup_s=1.0, compile_s=0.9)
    lm = SimpleNamespace(early_compile=None)
    fx = SimpleNamespace(graphs={1: e, 2: e}, compile_ahead_s=None, compile_ahead_note=None, device=cfg.torch_device)
    fx.lm = lm
    note = capture_cost_note(GraphMode.PIECEWISE, fx)
    assert note == (
        "capture cost, piecewise: 2 graphs captured in 0.02 s, 0.20 s of eager warm-up, 1.80 s tracing (and "
        "compiling) the shapes (each row's compile_s)"
    )
    # the decode attention's kernels compiled during the build (gmtool.kernels.early_compile): said, with its wait
    from gmtool.kernels.early_compile import EarlyCompile, geometry, raw_config

    lm.early_compile = EarlyCompile(geometry(cfg, raw_config("qwen3-0.6b")), seconds=3.5, waited_s=0.25)
    assert capture_cost_note(GraphMode.PIECEWISE, fx).endswith(
        "; the decode attention kernels of 2 bucket sizes compiled (or loaded) during the model's build, 3.50 s "
        "beside it, 0.25 s waited at its end"
    )


def test_capture_mode_eager_is_refused(tmp_path):
    import subprocess
    import sys

    p = subprocess.run(
        [
            sys.executable,
            "-m",
            "gmtool.cli.main",
            "capture",
            "--device",
            "cpu",
            "--mode",
            "eager",
            "--out",
            str(tmp_path / "o"),
        ],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 2 and "captures nothing" in p.stderr and "Traceback" not in p.stderr
    assert not (tmp_path / "o").exists()


def test_a_run_failure_outside_any_row_exits_1_and_bad_input_exits_2(monkeypatch, capsys, tmp_path):
    """Exit 2 is for what the user can fix in the command; a failure while measuring is exit 1."""
    import sys

    from gmtool.cli.main import main
    from gmtool.errors import OutOfMemory
    from gmtool.measure.workbench import Workbench

    def build(cfg, num_blocks=None):
        raise OutOfMemory("KV cache of 9 blocks does not fit: lower --max-kv-len or --kv-cache-gb")

    monkeypatch.setattr(Workbench, "build", classmethod(lambda cls, cfg, num_blocks=None: build(cfg)))
    monkeypatch.setattr(
        sys, "argv", ["gmtool", "capture", "--device", "cpu", "--buckets", "2", "--out", str(tmp_path / "o")]
    )
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 1 and "does not fit" in capsys.readouterr().err
    monkeypatch.setattr(sys, "argv", ["gmtool", "capture", "--device", "cpu", "--buckets", "2,x"])
    with pytest.raises(SystemExit) as e:
        main()
    assert e.value.code == 2 and "malformed bucket" in capsys.readouterr().err


# -- what the poisoning and the tolerances are for ----------------------------------------------------------
def _drop_writes_into(mp, tensors):
    """Capture runs every op, but the tape leaves off the writes into these tensors' storage (in place, or an
    out= argument, as the LM head writes the logits): replays of the graph never write them."""
    ptrs = {t.untyped_storage().data_ptr() for t in tensors}
    real = tape._Tape.__torch_dispatch__

    def dispatch(self, func, types, args=(), kwargs=None):
        n = len(self.ops)
        out = real(self, func, types, args, kwargs)
        dst = (kwargs or {}).get("out")
        if dst is None and func.__name__.split(".")[0].endswith("_"):
            dst = args[0] if args else None
        if isinstance(dst, torch.Tensor) and dst.untyped_storage().data_ptr() in ptrs:
            del self.ops[n:]
        return out

    mp.setattr(tape._Tape, "__torch_dispatch__", dispatch)


def _reference(rig, batch):
    return EagerReference(rig.eager(batch).clone(), written_kv(rig.cache, batch))


def test_a_graph_that_never_writes_its_logits_is_unsafe():
    """Its K/V are right and capture left this batch's logits in the output buffer: only poisoning the outputs
    before the replay shows that the replay wrote none."""
    rig = Rig(buckets=(8,))
    batch = rig.batch("1*6", seed=3)
    ref = _reference(rig, batch)
    with pytest.MonkeyPatch.context() as mp:
        _drop_writes_into(mp, [rig.ex.inputs.logits])
        _, check, _ = checked_replay(rig.ex, batch, ref)
    assert check.kv_rel_err < 1e-5 and check.max_rel_err == float("inf")
    assert check.failure(1e-5, 1e-3) is not None


def test_a_graph_that_writes_k_but_not_v_is_unsafe():
    """Capture wrote this batch's V into its slots: only poisoning V as well as K shows the replay wrote none."""
    rig = Rig(buckets=(8,))
    batch = rig.batch("1*6", seed=3)
    ref = _reference(rig, batch)
    with pytest.MonkeyPatch.context() as mp:
        _drop_writes_into(mp, rig.cache.v)
        _, check, _ = checked_replay(rig.ex, batch, ref)
    assert not check.kv_rel_err <= 1e-3 and check.failure(1e-5, 1e-3) is not None


def test_a_replay_off_by_1e_4_is_unsafe_in_fp32(tmp_path, monkeypatch):
    """An fp32 replay runs the kernels of its same-shape eager pass: 1e-4 is no rounding, it is stale data. The
    sweep must judge it with fp32's tight tolerance (1e-5), not with bf16's (5e-3) or the unpadded one (1e-3)."""
    from gmtool.core.executor import CapturedGraph

    real = CapturedGraph.replay

    def replay(self, batch, refresh_metadata=True):
        real(self, batch, refresh_metadata)
        self.ctx.views.logits.mul_(1 + 1e-4)

    monkeypatch.setattr(CapturedGraph, "replay", replay)
    code, out, rows = _capture(tmp_path, "--buckets", "2", "--compositions", "1*2,1*1")
    graph = [r for r in rows if r["mode"] == "full"]
    assert code == 3, out
    assert len(graph) == 2 and all(r["status"] == "UNSAFE" for r in graph)
    assert all("same computation run eagerly" in r["error"] for r in graph)
    assert all(
        r["tolerance_same_shape"] == 1e-5 and r["max_rel_err_same_shape"] == pytest.approx(1e-4, rel=1e-2)
        for r in graph
    )


def test_failure_applies_each_tolerance_to_its_own_comparison():
    """Same-shape comparisons get the tight tolerance (identical kernels); unpadded ones the loose one (GEMMs of
    another shape round differently)."""
    tol_same, tol = 1e-5, 1e-3
    assert ReplayCheck(1e-4, 0.0, 1e-4, 0.0, False).failure(tol_same, tol) is None
    assert "same computation" in ReplayCheck(1e-4, 1e-4, 0.0, 0.0, False).failure(tol_same, tol)
    assert "unpadded" in ReplayCheck(2e-3, 0.0, 0.0, 0.0, False).failure(tol_same, tol)
    assert "K/V" in ReplayCheck(0.0, 0.0, 0.0, 1e-4, False).failure(tol_same, tol)
    assert "K/V" in ReplayCheck(0.0, 0.0, 2e-3, 0.0, False).failure(tol_same, tol)


def test_a_replay_that_raises_is_unsafe_not_a_crash():
    """A graph replayed past its shape's bounds raises on the tape: the check says so, the sweep goes on."""
    rig = Rig(buckets=(8,))
    batch = rig.batch("1*6", seed=3)
    ref = _reference(rig, batch)
    entry = rig.ex.prepare(batch)  # captured

    def replay(*args, **kwargs):
        raise RuntimeError("index 9 is out of bounds for dimension 0 with size 8\nwhere it happened")

    entry.replay = replay
    _, check, _ = checked_replay(rig.ex, batch, ref)
    assert check.replay_error == "RuntimeError: index 9 is out of bounds for dimension 0 with size 8"
    assert check.failure(1e-5, 1e-3).startswith("replay failed: RuntimeError: index 9")


# -- blind spot: stale inputs too small for the tolerances ---------------------------------------------------
def _executor_inputs_fault(monkeypatch, fault):
    """fault(inputs) patches one graph executor's PersistentInputs (the eager reference's stay right)."""
    from gmtool.core.executor import GraphExecutor

    init = GraphExecutor.__init__

    def faulty(self, *a, **k):
        init(self, *a, **k)
        fault(self.inputs)

    monkeypatch.setattr(GraphExecutor, "__init__", faulty)


def _stale_kv_lens(inputs):
    """Copy-in keeps the kv_lens a key's first batch had: a later batch of the key attends one token short."""
    load, seen = inputs.load, set()

    def stale_load(batch, key, copy=True):
        kept = inputs.staged(key)[1][1].copy()
        load(batch, key, copy=False)
        if key in seen:
            inputs.staged(key)[1][1] = kept
        seen.add(key)
        if copy:
            inputs.copy_in(key)
        return inputs.views(key)

    inputs.load = stale_load


def test_a_stale_kv_length_under_the_tolerance_is_unsafe(tmp_path, monkeypatch):
    """One token short of a 100-token context moves bf16 logits by about 1/100, under the unpadded comparison's
    0.1, and the same-shape eager pass loads the same stale lengths: only the device inputs, compared with the
    batch itself, show it. It passed as ok. (Captured from the first mix, not a sibling: a sibling's halved
    contexts would leave lengths the numbers catch, and this is the check for those they cannot.)"""
    monkeypatch.setattr(Sweep, "_capture_from_sibling", lambda self, ex, key, batch: None)
    _executor_inputs_fault(monkeypatch, _stale_kv_lens)
    code, out, rows = _capture(tmp_path, "--dtype", "bf16", "--buckets", "4", "--compositions", "1*4@100,1*4@101")
    second = next(r for r in rows if r["mode"] == "full" and r["composition"] == "1*4@101")
    assert code == 3 and second["status"] == "UNSAFE", out
    assert "device inputs the replay read are not this batch's: kv_lens holds other values" in second["error"]
    assert second["max_rel_err"] <= second["tolerance"]  # the numbers alone would have passed it


def test_padding_left_from_the_previous_batch_is_unsafe(tmp_path, monkeypatch):
    """Padding lanes not rewritten keep the previous batch's slots: the replay writes a padding token's K/V into
    a live block. The logits moved by 8e-4, under fp32's unpadded tolerance; it passed as ok."""

    def no_pad(inputs):
        inputs._pad = lambda *a: None

    _executor_inputs_fault(monkeypatch, no_pad)
    code, out, rows = _capture(tmp_path, "--buckets", "4", "--compositions", "1*4,1*3")
    second = next(r for r in rows if r["mode"] == "full" and r["composition"] == "1*3")
    assert code == 3 and second["status"] == "UNSAFE", out
    assert "slot_mapping padding lanes point outside the null block" in second["error"], second["error"]


def test_a_replay_that_overwrites_the_batchs_context_is_unsafe():
    """Right inputs, a wrong write: a context slot of the batch (not one of its new tokens) changed by the
    replay is named, whatever the logits say."""
    from gmtool.measure.check import context_slots

    rig = Rig(buckets=(8,))
    batch = rig.batch("1*4", seed=5)
    ref = EagerReference(rig.eager(batch).clone(), written_kv(rig.cache, batch))
    entry, check, _ = checked_replay(rig.ex, batch, ref)
    assert check.failure(1e-5, 1e-3) is None and check.context_changed == 0 and check.input_faults == []
    held = [s for s in context_slots(rig.cache, batch) if s not in set(batch.slot_mapping)]
    replay = type(entry).replay

    def replay_and_stray(self, *a, **k):
        replay(self, *a, **k)
        rig.cache.v[1].view(-1, *rig.cache.v[1].shape[2:])[held[0]] += 1.0

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(entry), "replay", replay_and_stray)
        _, check, _ = checked_replay(rig.ex, batch, ref)
    assert check.context_changed == 1
    assert "overwrote the K/V of 1 slot the batch's sequences hold" in check.failure(1e-5, 1e-3)


def test_a_model_whose_eager_output_is_not_finite_is_an_error_not_unsafe_graphs(tmp_path):
    """rope_theta 0 makes RoPE's angles NaN: eager's K/V are NaN, and every graph row compared with them read
    UNSAFE, blaming graphs for the model. It is one error per batch, naming the model."""
    from gmtool.profiles import load_model_profile

    model = tmp_path / "rt0"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({**load_model_profile("tiny-llama")["config"], "rope_theta": 0.0}))
    code, output, rows = _capture(tmp_path, "--model", str(model), "--buckets", "1", "--compositions", "1*1")
    assert code == 1 and "Traceback" not in output
    assert "eager forward's" in output and "NaN or inf" in output
    assert rows and all(r["status"] == "error" for r in rows) and not any(r["status"] == "UNSAFE" for r in rows)


def _bake_decode_batch_size(monkeypatch):
    """A decode attention that takes the batch size from the host plan of the step it was captured with: a full
    graph then serves every later batch with its capture batch's count of sequences."""
    from gmtool.model import attention as A

    def decode(self, ctx, q, kc, vc, scale, out, opts=A.PLAIN):
        b = len(ctx.plan)
        res = q.new_zeros(q.shape)
        res[:b] = A.decode_attention(q[:b], kc, vc, ctx.views.block_tables[:b], ctx.views.kv_lens[:b], scale, opts)
        return A._into(res, out)

    monkeypatch.setattr(A.TorchAttention, "decode", decode)


def _bake_chunk_rows(monkeypatch):
    """A varlen attention that computes only the rows its capture batch's plan held."""
    from gmtool.model import attention as A

    def masked(self, ctx, q, kc, vc, scale, out, opts=A.PLAIN):
        n = sum(q_len for q_len, _ in ctx.plan)
        res = A.masked_varlen_attention(q, kc, vc, ctx.views, ctx.num_seqs, scale, opts)
        res[n:] = 0
        return A._into(res, out)

    monkeypatch.setattr(A.TorchAttention, "masked", masked)


@pytest.mark.parametrize(
    "bake,args",
    [
        (_bake_decode_batch_size, ("--scenario", "decode", "--buckets", "2,4")),
        (_bake_chunk_rows, ("--scenario", "prefill", "--buckets", "16")),
    ],
)
def test_a_graph_that_froze_its_capture_batch_fails_with_the_default_mixes(tmp_path, monkeypatch, bake, args):
    """Each key is captured from a sibling of its first mix (another count of sequences or chunk lengths,
    shorter contexts): a value frozen from the capture batch fails the first row's check, with the default
    mixes alone, where the full prefill keys each serve one mix and a decode bucket's first mix is its fullest."""
    bake(monkeypatch)
    code, output, rows = _capture(tmp_path, "--mode", "full", *args)
    unsafe = [r for r in rows if r["mode"] == "full" and r["status"] == "UNSAFE"]
    assert code == 3 and unsafe, output
    assert all("(sibling of " in r["captured_with"] for r in rows if r["mode"] == "full")


def test_a_replay_that_writes_into_a_block_its_batch_does_not_hold_is_unsafe():
    """Right inputs, right logits and K/V, the batch's context untouched, and a K/V write into a block none of
    the batch's tokens is in (padding sent to a slot frozen at capture, a kernel writing past its rows): another
    request's cache. Every block but the batch's new tokens' and the null block must keep its sum."""
    rig = Rig(buckets=(8,))
    batch = rig.batch("1*4", seed=5)
    ref = EagerReference(rig.eager(batch).clone(), written_kv(rig.cache, batch))
    entry, check, _ = checked_replay(rig.ex, batch, ref)
    assert check.failure(1e-5, 1e-3) is None and check.stray_blocks == 0
    mine = {int(b) for t in batch.block_tables for b in t}
    other = next(b for b in range(1, rig.cache.num_blocks) if b not in mine)
    replay = type(entry).replay

    def replay_and_stray(self, *a, **k):
        replay(self, *a, **k)
        rig.cache.k[0][other, 3] += 1.0

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(type(entry), "replay", replay_and_stray)
        _, check, _ = checked_replay(rig.ex, batch, ref)
    assert check.stray_blocks == 1 and check.context_changed == 0
    assert "wrote K/V into 1 block none of the batch's new tokens is in" in check.failure(1e-5, 1e-3)


def _fresh_prefill_fast_path(monkeypatch):
    """A varlen attention that takes a fast path when the host plan says no sequence has a cached prefix: its
    lengths from the chunks alone (right for a fresh prefill, wrong after a prefix). Chosen on the host at
    capture, the branch is frozen into the graph."""
    import dataclasses

    from gmtool.model import attention as A

    real = A.TorchAttention.masked

    def masked(self, ctx, q, kc, vc, scale, out, opts=A.PLAIN):
        if not all(kv == n for n, kv in ctx.plan):
            return real(self, ctx, q, kc, vc, scale, out, opts)
        v = ctx.views
        within = torch.arange(v.positions.shape[0]) - v.cu_q[v.token_seq.clamp_min(0)]
        fast = dataclasses.replace(v, kv_lens=v.cu_q[1:] - v.cu_q[:-1], positions=within)
        return A._into(A.masked_varlen_attention(q, kc, vc, fast, ctx.num_seqs, scale, opts), out)

    monkeypatch.setattr(A.TorchAttention, "masked", masked)


def test_a_fast_path_frozen_on_fresh_prefills_fails_where_a_mix_has_a_cached_prefix(tmp_path, monkeypatch):
    """A full prefill key serves one mix: captured from that mix (or a sibling as fresh as it), a graph that
    froze "no cached prefix" was never checked on a batch with one. The sibling drops a chunk's prefix, so a
    mix with one meets a graph captured without."""
    _fresh_prefill_fast_path(monkeypatch)
    code, out, rows = _capture(tmp_path, "--mode", "full", "--buckets", "16", "--compositions", "8+8@24")
    assert code == 3 and rows[-1]["status"] == "UNSAFE", out


# -- blind spot: state only the eager pass refreshes --------------------------------------------------------
def _seq_lens_only_eager_fills(monkeypatch):
    """Decode attention reads the backend's own seq-lens buffer (as FlashInfer's and FlashAttention's metadata
    builders keep one), which only the eager runner's metadata build fills: a replay reads the last eager step's
    lengths. Right only where an eager pass of the very same batch ran just before the replay."""
    from gmtool.measure import workbench
    from gmtool.model import attention as A

    lens = torch.zeros(64, dtype=torch.int64)

    def decode(self, ctx, q, kc, vc, scale, out, opts=A.PLAIN):
        n = ctx.views.kv_lens.shape[0]
        return A._into(A.decode_attention(q, kc, vc, ctx.views.block_tables, lens[:n], scale, opts), out)

    real_eager_fn = workbench.Workbench.eager_fn

    def eager_fn(self, batch):
        lens.zero_()
        lens[: batch.num_seqs] = torch.as_tensor([kv for _, kv in batch.plan])
        return real_eager_fn(self, batch)

    monkeypatch.setattr(A.TorchAttention, "decode", decode)
    monkeypatch.setattr(workbench.Workbench, "eager_fn", eager_fn)


def _plan_only_eager_makes(monkeypatch):
    """A plan()/run() split kept in the backend: only the eager runner plans, so a piecewise prefill runner runs
    with the plan of the last eager step."""
    from gmtool.measure import workbench
    from gmtool.model import attention as A

    state = {"plan": ()}

    def planned(self, ctx, q, kc, vc, scale, out, opts=A.PLAIN):
        ctx.planned_with.append(ctx.signature)
        return A._into(A.planned_varlen_attention(q, kc, vc, ctx.views, state["plan"], scale, opts), out)

    real_eager_fn = workbench.Workbench.eager_fn

    def eager_fn(self, batch):
        fn, logits = real_eager_fn(self, batch)

        def run():
            state["plan"] = batch.plan
            fn()

        return run, logits

    monkeypatch.setattr(A.TorchAttention, "planned", planned)
    monkeypatch.setattr(workbench.Workbench, "eager_fn", eager_fn)


@pytest.mark.parametrize(
    "inject,args",
    [
        (_seq_lens_only_eager_fills, ["--mode", "full", "--buckets", "2,4"]),
        (_seq_lens_only_eager_fills, ["--mode", "piecewise", "--buckets", "2,4"]),
        (_plan_only_eager_makes, ["--mode", "piecewise", "--scenario", "prefill", "--buckets", "8,16"]),
    ],
    ids=["seq-lens-full", "seq-lens-piecewise", "plan-piecewise"],
)
def test_a_graph_reading_what_only_the_eager_pass_refreshes_is_unsafe(tmp_path, monkeypatch, inject, args):
    """The eager reference of a batch runs before its replay; an eager step of another batch (its sibling) then
    runs just before the replay, as an engine's would: the stale lengths or plan show."""
    inject(monkeypatch)
    code, out, rows = _capture(tmp_path, *args)
    graph = [r for r in rows if r["mode"] != "eager"]
    assert code == 3 and graph, out
    assert any(r["status"] == "UNSAFE" for r in graph), [(r["composition"], r["status"]) for r in graph]


def test_a_prefill_pad_lane_left_on_a_live_slot_is_unsafe_with_default_compositions(tmp_path, monkeypatch):
    """Prefill padding lanes given the first token's slot, not the null slot: the padding writes K/V over a real
    token's. Only a padded batch shows it, so a prefill bucket's default mixes hold one (the chunk after a cached
    prefix, a token short of the bucket); the others fill their bucket exactly."""
    from gmtool.core.inputs import PersistentInputs

    real = PersistentInputs._pad

    def pad(tok, seq, cu, bt, now, before):
        real(tok, seq, cu, bt, now, before)
        tok[2, now[0] :] = tok[2, 0]

    monkeypatch.setattr(PersistentInputs, "_pad", staticmethod(pad))
    code, out, rows = _capture(tmp_path, "--scenario", "prefill", "--mode", "piecewise", "--buckets", "8,16")
    unsafe = {r["composition"] for r in rows if r["status"] == "UNSAFE"}
    assert code == 3 and unsafe, out
    assert all("+" in c for c in unsafe), unsafe  # the padded mixes, chunk after prefix


def test_nan_an_unsafe_replay_spreads_over_the_cache_does_not_fail_later_mixes(tmp_path, monkeypatch):
    """The first replay writes NaN over every K/V block (a kernel writing past its rows): UNSAFE, naming the
    stray blocks. Later mixes' contexts read those blocks: their eager references would hold NaN and be refused
    as the model's fault. The cache is scrubbed after an unsafe replay, so they are checked, and pass."""
    from gmtool.core.kv_cache import PagedKVCache

    caches, replays = [], []
    real_init, real_replay = PagedKVCache.__init__, tape.TapeGraph.replay

    def init(self, *a, **kw):
        real_init(self, *a, **kw)
        caches.append(self)

    def replay(self):
        real_replay(self)
        replays.append(1)
        if len(replays) == 1:
            for t in caches[-1].k + caches[-1].v:
                t[1:].fill_(float("nan"))

    monkeypatch.setattr(PagedKVCache, "__init__", init)
    monkeypatch.setattr(tape.TapeGraph, "replay", replay)
    code, out, rows = _capture(tmp_path, "--buckets", "4,8", "--compositions", "1*8,1*6,1*4,1*3")
    graph = [(r["composition"], r["status"], r["error"]) for r in rows if r["mode"] == "full"]
    assert graph[0][1] == "UNSAFE" and "the replay overwrote the K/V of" in graph[0][2], graph
    assert [s for _, s, _ in graph[1:]] == ["ok"] * 3, graph
    # the same mix's next mode reads the context the unsafe replay overwrote: judged against eager over it
    replays.clear()
    out = tmp_path / "both"
    args = ["compare", "full,piecewise", "--device", "cpu", "--num-iters", "1", "--num-iters-warmup", "0"]
    r = runner.invoke(app, [*args, "--buckets", "8", "--compositions", "1*8", "--out", str(out)])
    rows = json.loads((out / "results.json").read_text())["records"]
    assert [(x["mode"], x["status"]) for x in rows] == [("full", "UNSAFE"), ("piecewise", "ok")], (r.output, rows)


def test_checks_without_a_decoy_are_counted_in_the_notes(tmp_path, monkeypatch):
    """Where no other batch fits beside the mix (its sibling, else one decode token), the check runs without the
    eager step of another batch, and the notes say how many did."""
    from gmtool.errors import GmtoolError
    from gmtool.measure.workbench import Workbench

    real, room = Workbench.batch, {"fits": None}

    def batch(self, comp, keep=()):  # room["fits"]: the one mix that fits beside another (None: any)
        if keep and room["fits"] is not None and comp.label != room["fits"]:
            raise GmtoolError("no room beside the mix")
        return real(self, comp, keep)

    monkeypatch.setattr(Workbench, "batch", batch)
    for run, fits in (("sibling", None), ("fallback", "1*1"), ("none", "")):
        room["fits"] = fits
        code, out, _ = _capture(tmp_path / run, "--buckets", "2,4", "--compositions", "1*4,1*2")
        notes = " ".join(json.loads((tmp_path / run / "run/results.json").read_text())["notes"])
        assert code == 0, out
        assert ("2 checked replays ran without an eager step of another batch" in notes) == (run == "none"), notes


def test_a_key_captured_at_its_check_is_captured_before_the_decoy(tmp_path, monkeypatch):
    """Every forward context plans when it is made (eager passes and captures), a replay does not: the capture of
    a key that no sibling could take is the batch's own forward, and run after the decoy it would refresh the plan
    the decoy left. So the key is captured first, then the decoy, then the checked replay."""
    from gmtool.errors import GmtoolError
    from gmtool.measure.workbench import Workbench
    from gmtool.model import attention as A

    state, real_post, real_batch = {"plan": ()}, A.ForwardContext.__post_init__, Workbench.batch

    def post(self):
        real_post(self)
        state["plan"] = self.plan

    def planned(self, ctx, q, kc, vc, scale, out, opts=A.PLAIN):
        ctx.planned_with.append(ctx.signature)
        return A._into(A.planned_varlen_attention(q, kc, vc, ctx.views, state["plan"], scale, opts), out)

    def batch(self, comp, keep=()):  # no sibling fits: keys are captured from the mix at its check
        if keep and comp.label != "1*1":
            raise GmtoolError("no room beside the mix")
        return real_batch(self, comp, keep)

    monkeypatch.setattr(A.ForwardContext, "__post_init__", post)
    monkeypatch.setattr(A.TorchAttention, "planned", planned)
    monkeypatch.setattr(Workbench, "batch", batch)
    code, out, rows = _capture(tmp_path, "--mode", "piecewise", "--buckets", "16", "--compositions", "8*2")
    assert [(r["mode"], r["status"]) for r in rows] == [("eager", "ok"), ("piecewise", "UNSAFE")], out
    assert rows[1]["captured_with"] == "8*2", rows[1]  # captured at its check: the decoy's plan shows


def test_auto_serving_a_prefill_with_full_graphs_is_unsafe_in_the_sweep(tmp_path, monkeypatch):
    from gmtool.core.auto import AutoExecutor

    real = AutoExecutor.part_for
    monkeypatch.setattr(AutoExecutor, "part_for", lambda self, b: real(self, b) and self.parts["decode"])
    code, out, rows = _capture(tmp_path, "--mode", "auto", "--scenario", "mixed", "--buckets", "8,16")
    why = {r["error"] for r in rows if r["status"] == "UNSAFE"}
    assert code == 3 and any("mixed batch of" in w and "with full, not piecewise" in w for w in why), why


@pytest.fixture(scope="module")
def loaded():
    """A decode batch of 3 sequences in bucket 8, loaded: five padding lanes of each token field, five of each
    sequence field."""
    rig = Rig(buckets=(8, 16))
    batch = rig.batch("1*3@20")
    key = rig.ex.key_for(batch)
    rig.ex.inputs.load(batch, key)
    assert key.num_tokens == 8 and batch.num_tokens == batch.num_seqs == 3
    return rig, batch, key


@pytest.mark.parametrize("lane", ["first", "last"])
@pytest.mark.parametrize(
    "field, value, says",
    [
        ("slot_mapping", 10**6, "slot_mapping padding lanes point outside the null block"),
        ("token_seq", 0, "token_seq padding lanes name a sequence"),
        ("kv_lens", 7, "kv_lens padding lanes are not 0"),
        ("cu_q", 0, "cu_q padding lanes do not hold the token count"),
        ("block_tables", 5, "block_tables padding lanes point to blocks other than the null block"),
    ],
)
def test_each_padding_lane_a_graph_reads_is_checked(loaded, field, value, says, lane):
    """Every padding lane, the first one past the batch included (where a batch that lost a sequence leaves its
    stale value): a check that skipped it let that value through."""
    from gmtool.measure.check import input_faults

    rig, batch, key = loaded
    assert input_faults(rig.ex, key, batch) == []
    t = getattr(rig.ex.inputs.views(key), field)
    first = {"slot_mapping": 3, "token_seq": 3, "kv_lens": 3, "cu_q": 4, "block_tables": 3}[field]
    i = first if lane == "first" else t.shape[0] - 1
    old = t[i].clone()
    t[i] = value
    try:
        faults = input_faults(rig.ex, key, batch)
    finally:
        t[i] = old
    assert any(f.startswith(says) for f in faults), faults


def test_block_table_columns_past_the_batch_s_width_are_checked(loaded):
    from gmtool.measure.check import input_faults

    rig, batch, key = loaded
    bt = rig.ex.inputs.views(key).block_tables
    w = batch.block_table_array.shape[1]
    assert w < bt.shape[1]
    bt[0, w] = 5
    try:
        assert input_faults(rig.ex, key, batch) == [
            "block_tables padding lanes point to blocks other than the null block"
        ]
    finally:
        bt[0, w] = 0
