"""gmtool verify on the CPU tape: a clean soak stays clean under poison, and each injected bug is caught, with the
buffer it reads or the input it got wrong and the first layer output where the replay leaves eager."""

import json
import re

import pytest
import torch
from typer.testing import CliRunner

from gmtool.cli.main import app
from gmtool.core.compositions import parse_composition
from gmtool.verify.capturable import Hazard, find_hazards
from gmtool.verify.dyndims import dynamic_dims
from gmtool.verify.faults import FAULTS, parse_fault
from gmtool.verify.poison import Buffer
from gmtool.verify.run import VerifyConfig, build_bench
from gmtool.verify.soak import Soak, SoakOptions
from gmtool.verify.taps import LayerTaps

runner = CliRunner()


@pytest.fixture(scope="module")
def rig():
    cfg = VerifyConfig(device="cpu", dtype="fp32", modes="full,piecewise,full-narrow")
    bench = build_bench(cfg)
    taps = LayerTaps(bench.lm, bench.cfg.policy().largest, bench.device)
    yield cfg, bench, taps
    taps.remove()


def soak(rig, mode="full", fault=None, steps=9, check_every=3, seed=0):
    cfg, bench, taps = rig
    opts = SoakOptions(steps, check_every, seed, parse_fault(fault, bench.lm.num_layers))
    return Soak(bench, taps, mode, None, "default", opts).run()


@pytest.mark.parametrize("mode", ["full", "piecewise"])
def test_a_correct_soak_is_clean_under_every_poison(rig, mode):
    res = soak(rig, mode)
    assert res.mismatch is None
    # every third step, and each graph's first two replays
    assert res.steps == 9 and 3 <= res.checks < 9 and res.graphs >= 3 and res.blocks_reused > 0
    # every buffer was poisoned (full graphs have no attention buffer between pieces)
    assert set(res.poison_skipped) == (set() if mode == "piecewise" else {Buffer.ATTN_OUT_TAIL})


def test_the_poison_does_not_change_a_correct_replay(rig):
    """The same step replayed clean and with every buffer poisoned gives the same bits; one buffer alone
    changes nothing either (what attribution relies on)."""
    s = Soak(rig[1], rig[2], "piecewise", None, "default", SoakOptions(4, 100, 0))
    batch = s.sched.next_batch()
    while batch.num_tokens == s.ex.key_for(batch).num_tokens:  # a step with padding lanes
        s.ex.step(batch)
        s.sched.commit()
        batch = s.sched.next_batch()
    s.ex.step(batch)  # captured
    live = s.sched.live()
    clean = s._replay(batch, live, 3, set())
    poisoned = s._replay(batch, live, 3, None)
    for a, b in zip(clean, poisoned):
        assert torch.equal(a, b)
    assert s._buffers_read(batch, live, 3) == []
    s.ex.release()


def test_a_graph_reading_a_padding_lane_is_caught_and_named(rig):
    res = soak(rig, fault="pad-read", check_every=1, seed=3)
    m = res.mismatch
    assert m is not None and m.step == 0 and m.composition == "11" and m.key == "t16xs1"  # five padding lanes
    assert m.buffers_read == [Buffer.PAD_INPUT_IDS]
    assert m.first_divergence["module"] == "model.layers.0.mlp"
    assert not m.input_faults


def test_localization_names_the_layer_the_bug_is_in(rig):
    m = soak(rig, fault="pad-read:1", check_every=1).mismatch
    assert m.first_divergence["module"] == "model.layers.1.mlp" and m.first_divergence["layer"] == 1
    assert m.first_divergence["rel_err_same_shape"] > 0.1  # graph-only: same-shape eager does not have it
    pw = soak(rig, "piecewise", fault="pad-read:1", check_every=1).mismatch
    assert pw.first_divergence["module"] == "model.layers.1.mlp" and pw.first_divergence["piece"] == 2


def test_a_family_with_other_module_names_is_tapped_and_localized(tmp_path):
    """Falcon keeps its layers in `h`, calls its attention `self_attention` and its final norm `ln_f`: verify's
    taps and its pad-read fault find them by role (both raised AttributeError, where capture ran the model)."""
    (tmp_path / "config.json").write_text(
        '{"model_type": "falcon", "hidden_size": 32, "num_attention_heads": 4, "num_hidden_layers": 2, '
        '"vocab_size": 256}'
    )
    cfg = VerifyConfig(model=str(tmp_path), device="cpu", dtype="fp32", modes="full,piecewise")
    bench = build_bench(cfg)
    taps = LayerTaps(bench.lm, bench.cfg.policy().largest, bench.device)
    try:
        assert taps.modules == [
            "transformer.word_embeddings",
            *[f"transformer.h.{i}{part}" for i in (0, 1) for part in (".self_attention", ".mlp", "")],
            "transformer.ln_f",
        ]
        assert [m.endswith("self_attention") for m in taps.modules] == taps.attention
        rig = (cfg, bench, taps)
        assert soak(rig, "piecewise").mismatch is None
        m = soak(rig, fault="stale-slot-mapping", steps=20, check_every=1).mismatch
        assert m is not None and m.first_divergence["module"] == "transformer.h.0.self_attention"
        m = soak(rig, fault="pad-read:1", check_every=1).mismatch  # the fault finds Falcon's MLP too
        assert m is not None and m.first_divergence["module"] == "transformer.h.1.mlp"
    finally:
        taps.remove()


def test_a_multimodal_model_is_tapped_in_its_language_model(tmp_path):
    """Gemma 3's multimodal class holds its text decoder beside a vision tower: verify taps the text decoder's
    layers (it refused the model, finding no decoder layers) and catches a fault there."""
    from tests.arch_configs import write_config

    cfg = VerifyConfig(model=str(write_config("gemma3", tmp_path)), device="cpu", dtype="fp32", modes="full")
    bench = build_bench(cfg)
    taps = LayerTaps(bench.lm, bench.cfg.policy().largest, bench.device)
    try:
        assert taps.modules[1].startswith("model.language_model.layers.0."), taps.modules
        m = soak((cfg, bench, taps), fault="stale-slot-mapping", steps=20, check_every=1).mismatch
        assert m is not None and m.first_divergence["module"].startswith("model.language_model.layers.0.")
    finally:
        taps.remove()


def test_a_soak_runs_an_eager_step_of_another_batch_before_its_checked_replay(rig, monkeypatch):
    """Decode attention reading a seq-lens buffer only the eager pass fills: the checked step's eager reference
    would refresh it; an eager step of another batch (a decoy) between the reference and the replay, as an
    engine's eager step of other requests, leaves the stale lengths for the replay to show."""
    from tests.test_judge import _seq_lens_only_eager_fills

    _seq_lens_only_eager_fills(monkeypatch)
    m = soak(rig, "full", steps=30, check_every=3).mismatch
    assert m is not None and "differs" in m.reason, m
    # localized with the decoy too, and named: right just after the batch's own eager pass, wrong after another's
    assert m.first_divergence is not None and "self_attn" in m.first_divergence["module"], m
    assert any(s.startswith("state only an eager pass refreshes") for s in m.suspects), m.suspects


def test_an_unchecked_step_s_own_fault_is_a_finding_when_its_checked_rerun_is_right(rig, monkeypatch):
    """A step that staged wrong inputs (or raised) is checked at once; where the re-run comes out right (it
    loads in another order), the soak still stops on it, saying so, not 'clean' after a few steps."""
    from gmtool.verify import soak as soak_module

    real, calls = soak_module.input_faults, []

    def faults(ex, key, batch, staged=False):
        if staged:
            calls.append(1)
            if len(calls) == 2:
                return ["cu_q holds other values than this batch's"]
        return real(ex, key, batch, staged)

    monkeypatch.setattr(soak_module, "input_faults", faults)
    res = soak(rig, "full", steps=60, check_every=3)
    m = res.mismatch
    assert m is not None and (m.step + 1) % 3 != 0, m  # the second unchecked step is the faulty one
    assert m.reason.startswith("an unchecked step staged inputs that are not its batch's: cu_q holds"), m.reason
    assert "its checked re-run was right" in m.reason and res.steps == m.step + 1, res


def test_a_wrong_replay_that_does_not_reproduce_says_so(rig, monkeypatch):
    """The checked replay's logits come out wrong once (what a race or an earlier step's leftover does), and its
    re-runs are right: the finding says it did not reproduce, not that the graph computes from a frozen value."""
    from gmtool.verify import soak as soak_module

    real, calls = soak_module.replay_once, []

    def once_wrong(ex, batch, before_replay=None, after_replay=None, **kw):
        def after(entry):
            if after_replay is not None:
                after_replay(entry)
            calls.append(1)
            if len(calls) == 2:
                ex.inputs.logits.add_(1.0)

        return real(ex, batch, before_replay, after, **kw)

    monkeypatch.setattr(soak_module, "replay_once", once_wrong)
    m = soak(rig, "full", steps=9, check_every=1).mismatch
    assert m is not None and m.step == 1 and "differs" in m.reason, m
    assert m.first_divergence is None and m.suspects[0].startswith("did not reproduce: re-run under"), m.suspects
    assert not any(s.startswith("no buffer identified") for s in m.suspects), m.suspects


@pytest.mark.parametrize("fault,field", [("stale-positions", "positions"), ("stale-slot-mapping", "slot_mapping")])
def test_a_stale_input_field_is_named(rig, fault, field):
    m = soak(rig, fault=fault, steps=20, check_every=1).mismatch
    assert m is not None
    assert m.input_faults == [f"{field} holds other values than this batch's"]
    assert m.first_divergence["module"] == "model.layers.0.self_attn"  # where positions / slots are first used


def test_stale_slots_after_block_reuse_are_caught_on_a_later_check(rig):
    """Checked every 5th step: the stale slot mapping is caught once a steady decode repeats a token count, after
    freed blocks were handed out again."""
    res = soak(rig, fault="stale-slot-mapping", steps=60, check_every=5)
    m = res.mismatch
    assert m is not None and m.step > 5 and res.blocks_reused > 0
    assert "slot_mapping holds other values than this batch's" in m.input_faults


def test_a_graph_reading_an_unused_kv_block_is_caught_and_named(rig):
    m = soak(rig, fault="stale-block-table", steps=30, check_every=1).mismatch
    assert m is not None
    assert Buffer.KV_UNUSED_BLOCKS in m.buffers_read
    assert "block_tables padding lanes point to blocks other than the null block" in m.input_faults


def test_padding_left_from_an_earlier_batch_is_named(rig):
    m = soak(rig, fault="skip-pad-zero", steps=20, check_every=1).mismatch
    assert m is not None and any("padding lanes" in f for f in m.input_faults)


def test_a_graph_reading_its_own_memory_before_writing_it_is_named(rig, monkeypatch):
    """Replays skip RMSNorm's rsqrt: the graph reads an intermediate it did not write on this replay (what a
    graph reading freed pool memory does). The tape makes every intermediate afresh at each replay, so such a
    read has nothing to read: verify reports the first step, with graph memory among the suspects."""
    from gmtool.core.backends import cpu as tape

    real = tape.TapeGraph.replay

    def replay_without_rsqrt(self):
        steps, self._steps = self._steps, [st for st in self._steps if not st[0].__name__.startswith("rsqrt")]
        try:
            real(self)
        finally:
            self._steps = steps

    monkeypatch.setattr(tape.TapeGraph, "replay", replay_without_rsqrt)
    m = soak(rig, steps=2, check_every=1).mismatch
    assert m is not None and m.step == 0 and "replay failed" in m.reason
    assert Buffer.GRAPH_MEMORY in m.buffers_read


def test_full_narrow_freezes_the_plan_and_verify_says_so(rig):
    res = soak(rig, "full-narrow", steps=20, check_every=1)
    assert res.expected_unsafe and res.mismatch is not None
    assert any("attention plan frozen at capture" in s for s in res.mismatch.suspects)


def test_a_fault_injected_into_full_narrow_is_found_not_expected(rig):
    """full-narrow is expected to replay a prefill graph's frozen plan wrongly; an injected fault it shows is
    what the user asked verify to find: a finding (the verdict is not clean), and the early stop is said."""
    res = soak(rig, "full-narrow", fault="share-output-across-buckets", steps=20, check_every=1)
    assert res.mismatch is not None and not res.expected_unsafe
    said = f"stopped at the first wrong replay, at step {res.mismatch.step} ({res.mismatch.step + 1} of 20 steps run)"
    assert said in res.notes, res.notes  # numbered as the mismatch is


# -- capturability ---------------------------------------------------------------------------------------------
class _Sync(torch.nn.Module):
    def forward(self, x):
        scale = x.abs().max().item()
        return x / scale + torch.tensor([1.0])


class _Toy(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.block = torch.nn.Sequential(torch.nn.Linear(4, 4), _Sync())

    def forward(self, x):
        return self.block(x)


def test_capturability_names_item_and_a_host_tensor_with_their_module_path():
    toy, x = _Toy(), torch.ones(2, 4)
    found = {(f.hazard, f.op, f.module) for f in find_hazards(toy, lambda: toy(x), torch.device("cpu"))}
    assert (Hazard.HOST_SYNC, "Tensor.item()", "block.1") in found
    assert (Hazard.HOST_TENSOR, "aten.lift_fresh.default (torch.tensor(...) of host data)", "block.1") in found
    assert len(found) == 2  # the Linear and the division are fine; item() is not counted twice


def test_capture_refuses_a_model_with_a_host_sync_naming_the_op(tmp_path, monkeypatch):
    from transformers.models.qwen3 import modeling_qwen3

    real = modeling_qwen3.Qwen3MLP.forward
    monkeypatch.setattr(modeling_qwen3.Qwen3MLP, "forward", lambda self, x: real(self, x) * (x.sum() > 0).item())
    r = runner.invoke(
        app, ["capture", "--device", "cpu", "--buckets", "2", "--num-iters", "1", "--out", str(tmp_path / "o")]
    )
    assert r.exit_code == 1
    assert "cannot be captured as a CUDA graph: Tensor.item() (host sync) in model.layers.0.mlp" in str(r.exception)


# -- dynamic dimensions ----------------------------------------------------------------------------------------
def test_the_tape_diff_names_the_host_plan_baked_into_full_narrow(rig):
    _, bench, _ = rig
    a, b = (bench.batch(parse_composition(t, i)) for i, t in enumerate(("8+8", "4+12")))
    narrow = dynamic_dims(bench, "full-narrow", a, b)
    assert narrow.key == "t16" and not narrow.clean
    first = narrow.baked[0]
    assert first.op == "aten.slice.Tensor" and first.module == "model.layers.0.self_attn"
    assert (first.value_a, first.value_b) == (8, 4)  # the first sequence's length, frozen
    assert dynamic_dims(bench, "full", a, b).clean  # the wide key's attention reads lengths from the device


def test_gmtools_decode_graphs_bake_in_nothing(rig):
    _, bench, _ = rig
    a, b = (bench.batch(parse_composition(t, i)) for i, t in enumerate(("1*4@9", "1*4@23")))
    res = dynamic_dims(bench, "full", a, b)
    assert res.key == "d4" and res.clean and res.ops[0] == res.ops[1] > 100


def test_the_decode_pair_differs_in_its_count_of_sequences_and_shows_a_frozen_count(rig, monkeypatch):
    """verify's decode pair holds one sequence fewer in its second batch: an attention that takes the batch size
    from the capture's host plan is named, where two batches of one count showed nothing."""
    from gmtool.verify.run import dyn_dim_batches
    from tests.test_judge import _bake_decode_batch_size

    cfg, bench, _ = rig
    (kind, a, b), *_ = dyn_dim_batches(bench, cfg)
    assert kind == "decode" and a.num_seqs == b.num_seqs + 1 and a.num_tokens > 2
    assert dynamic_dims(bench, "full", a, b).clean
    _bake_decode_batch_size(monkeypatch)
    res = dynamic_dims(bench, "full", a, b)
    assert not res.clean and res.baked[0].module == "model.layers.0.self_attn", res


# -- the command -----------------------------------------------------------------------------------------------
def test_verify_finds_an_injected_bug_and_says_how_to_reproduce_it(tmp_path):
    out = tmp_path / "v"
    r = runner.invoke(
        app,
        [
            "verify",
            "--device",
            "cpu",
            "--modes",
            "full",
            "--steps",
            "6",
            "--check-every",
            "2",
            "--inject",
            "skip-pad-zero",
            "--out",
            str(out),
        ],
    )
    assert r.exit_code == 3, r.output
    doc = json.loads((out / "verify.json").read_text())
    m = doc["runs"][0]["mismatch"]
    assert m["step"] == 1 and m["first_divergence"]["module"] == "model.layers.0.self_attn"
    assert m["suspects"][0] == (
        "slot_mapping padding lanes point outside the null block (padding writes K/V into live blocks)"
    )
    assert "--seed 0 --steps 2 --check-every 2" in m["repro"] and "--inject skip-pad-zero" in m["repro"]
    assert doc["exit_code"] == 3 and doc["verdict"].startswith("verify: WRONG REPLAY FOUND")
    assert doc["capturability"] == [] and all(d["clean"] for d in doc["dynamic_dims"])
    assert "WRONG REPLAY FOUND" in r.output


@pytest.mark.parametrize(
    "args,msg",
    [
        (["--modes", "eager"], "is not a graph mode"),
        (["--strategy", "vmm"], "only 'default' runs"),
        (["--inject", "nope"], "unknown --inject"),
        (["--inject", "pad-read:7"], "the model has layers 0..1"),
        (["--steps", "0"], "must be positive"),
    ],
)
def test_bad_input_is_refused_before_anything_is_written(tmp_path, args, msg):
    from gmtool.errors import GmtoolError

    r = runner.invoke(app, ["verify", "--device", "cpu", "--out", str(tmp_path / "o"), *args])
    assert isinstance(r.exception, GmtoolError) and msg in str(r.exception)
    assert not (tmp_path / "o").exists()


def test_bad_input_exits_2_in_one_line(tmp_path):
    import subprocess
    import sys

    r = subprocess.run(
        [sys.executable, "-m", "gmtool", "verify", "--device", "cpu", "--modes", "eager"],
        capture_output=True,
        text=True,
        cwd=tmp_path,
        env={**__import__("os").environ, "PYTHONPATH": str(__import__("pathlib").Path.cwd())},
    )
    assert r.returncode == 2 and "is not a graph mode" in r.stderr and len(r.stderr.strip().splitlines()) == 1


def test_a_bucket_whose_capture_raises_on_wrong_inputs_is_a_finding_not_a_crash(rig):
    """skip-pad-zero, checked every 10 steps: the stale padding would make a replay (or a new bucket's capture
    warm-up) read out of range between checks. The staged inputs are checked on every step, so the soak checks
    and localizes that step at once instead of raising (on CUDA: instead of an illegal address)."""
    m = soak(rig, fault="skip-pad-zero", steps=60, check_every=10).mismatch
    assert m is not None and m.step < 10
    assert any("padding lanes" in s for s in m.input_faults), m.input_faults
    assert any("padding lanes" in s for s in m.suspects), m.suspects


def test_a_soak_stops_at_its_time_limit_and_says_so(rig):
    cfg, bench, taps = rig
    res = Soak(bench, taps, "piecewise", None, "default", SoakOptions(10**6, 10, 0, time_limit_s=1.0)).run()
    assert 0 < res.steps < 10**6 and res.mismatch is None and res.wall_s < 30
    assert res.notes == [f"stopped at the time limit (1 s) after {res.steps} of 1000000 steps"]


def test_auto_soaks_clean_through_full_and_piecewise_graphs(rig):
    """auto: uniform decode batches replay full graphs, prefill and mixed ones piecewise graphs, all under one
    soak, one arena and one poisoner (each part's attention buffer poisoned for its own pieces)."""
    res = soak(rig, "auto", steps=30, check_every=3)
    assert res.mismatch is None and 10 <= res.checks < 30 and res.blocks_reused > 0
    assert res.served_by.get("full", 0) > 0 and res.served_by.get("piecewise", 0) > 0
    assert sum(res.served_by.values()) == 30
    assert any(k.startswith("d") for k in res.keys) and any(k.startswith("t") for k in res.keys)
    assert res.poison_skipped == {}  # piecewise's attention buffer is there to poison


@pytest.mark.parametrize(
    "fault,key,where,piece,suspect",
    [
        # a piecewise prefill graph reads a padding lane: the lane and the layer are named, with the piece
        ("pad-read:1", "t16", "model.layers.1.mlp", 2, "input_ids padding lanes: the result changes"),
        # a full decode graph froze the kv lengths of its capture: caught in the decode graph, at the attention
        ("freeze-seq-lens", "d1", "model.layers.0.self_attn", None, "a value frozen at capture?"),
        # the arena both parts share: a stale field, named as the input it holds wrong
        ("stale-slot-mapping", "t16", "model.layers.0.self_attn", 1, "slot_mapping holds other values"),
    ],
)
def test_auto_catches_and_localizes_injected_faults_in_either_part(rig, fault, key, where, piece, suspect):
    res = soak(rig, "auto", fault=fault, steps=30, check_every=1, seed=3 if fault == "pad-read:1" else 0)
    m = res.mismatch
    assert m is not None and m.key == key, m
    assert m.first_divergence["module"] == where and m.first_divergence["piece"] == piece
    assert any(suspect in s for s in m.suspects), m.suspects


def test_verify_accepts_auto_and_analyses_its_parts_once(tmp_path):
    out = tmp_path / "v"
    r = runner.invoke(
        app,
        ["verify", "--device", "cpu", "--modes", "full,auto", "--steps", "12", "--check-every", "4", "--out", str(out)],
    )
    assert r.exit_code == 0, r.output
    doc = json.loads((out / "verify.json").read_text())
    assert [run["mode"] for run in doc["runs"]] == ["full", "auto"]
    # auto's decode graphs are full's (analysed once), its prefill graphs piecewise's
    assert [(d["mode"], d["kind"]) for d in doc["dynamic_dims"]] == [
        ("full", "decode"),
        ("full", "prefill"),
        ("piecewise", "prefill"),
    ]


@pytest.mark.parametrize("fault", FAULTS)
def test_every_injected_fault_is_caught_under_auto(rig, fault):
    m = soak(rig, "auto", fault=fault, steps=30, check_every=1).mismatch
    assert m is not None and m.suspects and m.step < 10


def test_a_graph_output_handed_out_from_pool_memory_is_caught_and_named(rig):
    """share-output-across-buckets: the logits are handed out through a weak reference into graph memory
    instead of the persistent output buffer (as engines' weak references to graph outputs do). The pool counts
    that memory free, so another bucket's replay overwrites it; verify poisons graph memory between the replay
    and the read, and names the output. The same poison leaves a correct soak clean (the tests above)."""
    m = soak(rig, "full", fault="share-output-across-buckets", steps=30, check_every=1).mismatch
    assert m is not None and m.step < 5
    assert any(s.startswith("output:") for s in m.suspects), m.suspects
    assert any("graph-private memory" in s for s in m.suspects), m.suspects


def test_share_output_is_refused_for_piecewise(rig):
    from gmtool.errors import GmtoolError

    with pytest.raises(GmtoolError, match="it is modeled on full graphs"):
        soak(rig, "piecewise", fault="share-output-across-buckets", steps=3, check_every=1)


def test_buffers_read_are_ranked_by_how_far_each_moves_the_result():
    """A graph reading stale metadata reads several poisoned buffers through it: the one it reads directly (NaN
    in the result) comes first, then the others by how far they move the result; one within tolerance is not
    read."""
    from types import SimpleNamespace

    from gmtool.verify.soak import Soak

    clean = (torch.ones(2, 4), torch.ones(3))
    moved = {
        Buffer.PAD_INPUT_IDS: (torch.ones(2, 4) * 1.5, torch.ones(3)),
        Buffer.KV_SLOT_TAILS: (torch.full((2, 4), float("nan")), torch.ones(3)),
        Buffer.KV_NULL_BLOCK: (torch.ones(2, 4) * 40.0, torch.ones(3)),
        Buffer.PAD_POSITIONS: (torch.ones(2, 4) * (1 + 1e-7), torch.ones(3)),
    }

    def replay(batch, live, step, only):
        return clean if not only else moved.get(next(iter(only)), clean)

    fake = SimpleNamespace(
        _replay=replay,
        poisoner=SimpleNamespace(skipped={}, clean=lambda entry, live: None),
        ex=SimpleNamespace(prepare=lambda batch: None),
        tols=(1e-3, 1e-1),
    )
    assert Soak._buffers_read(fake, None, [], 0) == [
        str(Buffer.KV_SLOT_TAILS),
        str(Buffer.KV_NULL_BLOCK),
        str(Buffer.PAD_INPUT_IDS),
    ]


def test_the_reproduce_command_is_one_verify_accepts():
    """A fault caught in the staging arena is found between checks (step 6 of --check-every 10): the command
    that reproduces it ran --steps 7 --check-every 10, which verify refuses."""
    cfg = VerifyConfig(device="cpu", modes="full", steps=200, check_every=10, inject="stale-slot-mapping")
    argv = cfg.repro("full", "default", 7).split()[2:]
    opts = {argv[i].lstrip("-").replace("-", "_"): argv[i + 1] for i in range(0, len(argv), 2)}
    assert opts["steps"] == "7" and opts["check_every"] == "7"
    for k in ("steps", "check_every", "seed", "max_num_seqs", "max_kv_len", "block_size"):
        opts[k] = int(opts[k])
    VerifyConfig(**opts)  # raises GmtoolError on a refused command
    assert "--steps 20 --check-every 10" in cfg.repro("full", "default", 20)
    assert "--attention" not in cfg.repro("full", "default", 20)
    torch_attention = VerifyConfig(device="cpu", modes="full", attention="torch", inject="stale-slot-mapping")
    assert " --attention torch" in torch_attention.repro("full", "default", 20)  # on CUDA, auto would run Triton


def test_a_clean_verdict_names_what_full_narrow_was_expected_to_show():
    """full-narrow's baked-in values and wrong replay are expected (exit 0), but the verdict said 'no baked-in
    value' under a table showing 20 of them."""
    from gmtool.verify.report import finish_document

    dd = {"mode": "full-narrow", "kind": "prefill", "key": "t16", "clean": False, "expected_unsafe": True}
    run = {"mode": "full-narrow", "strategy": "default", "steps": 5, "checks": 1, "expected_unsafe": True}
    doc = {
        "capturability": [],
        "dynamic_dims": [{**dd, "baked": [{}] * 20}],
        "runs": [{**run, "mismatch": {"step": 4}}],
    }
    doc = finish_document(doc, None, 1.0)
    assert doc["exit_code"] == 0 and doc["findings"] == []
    assert doc["verdict"].endswith(
        "no baked-in value in the modes that should be safe; full-narrow, expected unsafe, showed 20 baked-in "
        "value(s) (prefill) and a wrong replay at step 4"
    ), doc["verdict"]
    clean = finish_document({"capturability": [], "dynamic_dims": [], "runs": [{**run, "mismatch": None}]}, None, 1.0)
    assert clean["verdict"].endswith("no op that breaks capture, no baked-in value")


def test_a_longrope_model_is_clean_and_its_padding_positions_are_not_poisoned(tmp_path):
    """longrope's factors follow the step's largest position, padding lanes' included (transformers' rule): the
    model reads them, so verify's poison of them reported a wrong replay of a model capture found exact. They are
    left unpoisoned, with the reason, and the run's notes say what the rule means for a request's logits."""
    from gmtool.profiles import load_model_profile

    raw = dict(load_model_profile("tiny-llama")["config"])
    raw.pop("rope_scaling")
    raw["rope_parameters"] = {
        "rope_type": "longrope",
        "short_factor": [1.0] * 4,
        "long_factor": [4.0] * 4,
        "original_max_position_embeddings": 32,  # inside verify's CPU contexts: both factor sets are replayed
        "rope_theta": 10000.0,
    }
    (tmp_path / "longrope.json").write_text(json.dumps(raw))
    args = ["--model", str(tmp_path / "longrope.json"), "--modes", "full", "--steps", "40", "--check-every", "5"]
    r = runner.invoke(app, ["verify", "--device", "cpu", "--out", str(tmp_path / "o"), *args])
    assert r.exit_code == 0, r.output
    doc = json.loads((tmp_path / "o" / "verify.json").read_text())
    assert "longrope" in doc["runs"][0]["poison_skipped"]["positions padding lanes"], doc["runs"][0]
    assert any(n.startswith("longrope:") for n in doc["notes"]), doc["notes"]
    assert "note: longrope:" in r.output  # the model's notes are printed, as capture prints them


def test_auto_with_max_tokens_soaks_and_checks_steps_above_the_largest_bucket(tmp_path):
    """--max-tokens opens auto's eager path to the soak: steps above the largest bucket (16) run eagerly on their
    exact shape and are checked like any replay; the run says how many of each kind it checked."""
    out = tmp_path / "v"
    argv = ["verify", "--device", "cpu", "--modes", "auto", "--max-tokens", "32", "--steps", "30", "--check-every"]
    r = runner.invoke(app, [*argv, "3", "--out", str(out)])
    assert r.exit_code == 0, r.output
    run = json.loads((out / "verify.json").read_text())["runs"][0]
    assert run["served_by"].get("eager", 0) > 0 and run["checked_by"].get("eager", 0) > 0, run
    assert sum(run["checked_by"].values()) == run["checks"] and 10 <= run["checks"] < 30
    assert any(int(k[1:].split("x")[0]) > 16 for k in run["keys"]), run["keys"]
    assert "steps served by eager" in " ".join(r.output.split())


def test_a_stale_plan_in_autos_eager_steps_is_caught(monkeypatch):
    """An eager step above the largest bucket that keeps its first batch's attention plan (a cached context not
    refreshed) is a wrong replay like a graph's: caught at a checked eager step, with --max-tokens in the
    command that reproduces it."""
    from gmtool.core.auto import EagerStep
    from gmtool.model.attention import forward_context

    def stale(self, batch, refresh_metadata=True):
        self.check_inputs()
        with forward_context(self.ctx), torch.no_grad():  # no ctx.prepare(batch.plan): the first batch's plan
            self.executor.forward(self.ctx.views)

    monkeypatch.setattr(EagerStep, "replay", stale)
    cfg = VerifyConfig(device="cpu", dtype="fp32", modes="auto", max_tokens=32)
    bench = build_bench(cfg)
    taps = LayerTaps(bench.lm, bench.cfg.policy().max_tokens, bench.device)
    try:
        res = Soak(bench, taps, "auto", None, "default", SoakOptions(60, 1, 0)).run()
    finally:
        taps.remove()
    m = res.mismatch
    assert m is not None and int(m.key[1:].split("x")[0]) > 16, m
    assert m.suspects[0].startswith("no graph ran this step (auto runs steps above"), m.suspects
    assert "--max-tokens 32" in cfg.repro("auto", "default", m.step + 1)


def test_max_tokens_above_the_buckets_needs_auto():
    from gmtool.errors import GmtoolError

    with pytest.raises(GmtoolError, match="only auto serves steps above it"):
        VerifyConfig(device="cpu", modes="full,piecewise", max_tokens=32)
    assert VerifyConfig(device="cpu", modes="full", max_tokens=16).max_tokens == 16  # no step above: nothing to say


def test_a_replay_that_overwrites_another_live_requests_kv_is_caught(rig):
    """Right inputs, a stray write: a K/V slot of a live request outside the batch (one the scheduler left out
    of this step) changed by the replay, as a kernel writing past its rows would, is caught though this step's
    logits and K/V are right. The soak's own traffic schedules every running request at each step here, so one
    more live request holds a block reserved for it."""
    from gmtool.core.executor import CapturedGraph

    cfg, bench, taps = rig
    s = Soak(bench, taps, "full", None, "default", SoakOptions(12, 1, 0, None))
    bs, held, live, replay = bench.cache.spec.block_size, s.sched.free.pop(0), s.sched.live, CapturedGraph.replay
    s.sched.live = lambda: live() + [([held], bs)]  # a request waiting for its turn, holding one full block

    def replay_and_stray(self, batch, *a, **k):
        replay(self, batch, *a, **k)
        bench.cache.k[0].view(-1, *bench.cache.k[0].shape[2:])[held * bs + 1] += 1.0

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(CapturedGraph, "replay", replay_and_stray)
        m = s.run().mismatch
    assert m is not None and m.step == 0, m
    assert "overwrote the K/V of 1 slot live requests hold" in m.reason, m.reason
    assert s.run().mismatch is None  # the same soak without the stray write: clean


def test_the_prefill_pair_has_a_cached_prefix_and_shows_a_frozen_fresh_prefill_branch(rig, monkeypatch):
    from gmtool.verify.run import dyn_dim_batches
    from tests.test_judge import _fresh_prefill_fast_path

    cfg, bench, _ = rig
    kind, a, b = dyn_dim_batches(bench, cfg)[1]
    assert kind == "prefill" and all(kv == q for q, kv in a.plan) and not all(kv == q for q, kv in b.plan)
    assert dynamic_dims(bench, "full", a, b).clean
    _fresh_prefill_fast_path(monkeypatch)
    assert not dynamic_dims(bench, "full", a, b).clean


def test_the_decode_pair_reaches_past_a_sliding_window_and_shows_a_frozen_start_block(monkeypatch):
    """A windowed decode that skips the blocks below the shortest context's window, that block taken from the
    host plan at capture: verify's decode pair had contexts of at most 3 blocks, inside tiny-gemma2's 24-token
    window, and showed nothing. Its second batch now sits at the longest context the cache holds."""
    from gmtool.model import attention as A
    from gmtool.verify.run import dyn_dim_batches

    cfg = VerifyConfig(device="cpu", dtype="fp32", model="tiny-gemma2", modes="full")
    bench = build_bench(cfg)
    (kind, a, b), *_ = dyn_dim_batches(bench, cfg)
    assert kind == "decode" and max(b.kv_lens) == cfg.max_kv_len
    assert dynamic_dims(bench, "full", a, b).clean
    real = A.TorchAttention.decode

    def decode(self, ctx, q, kc, vc, scale, out, opts=A.PLAIN):
        if opts.window is None or not ctx.plan:
            return real(self, ctx, q, kc, vc, scale, out, opts)
        first = max(0, min(kv for _, kv in ctx.plan) - opts.window) // kc.shape[1]  # frozen at capture
        tables = ctx.views.block_tables.clone()
        tables[:, :first] = 0  # "below every window": read as the null block
        return A._into(A.decode_attention(q, kc, vc, tables, ctx.views.kv_lens, scale, opts), out)

    monkeypatch.setattr(A.TorchAttention, "decode", decode)
    assert not dynamic_dims(bench, "full", a, b).clean


def _auto_run(tmp_path, *more):
    out = tmp_path / "v"
    args = ["verify", "--device", "cpu", "--modes", "auto", "--max-tokens", "32", "--out", str(out), *more]
    r = runner.invoke(app, args)
    return r, json.loads((out / "verify.json").read_text())


def test_an_eager_step_whose_load_skips_its_copy_is_caught(tmp_path, monkeypatch):
    """auto's eager step above the largest bucket skips its copy-in when the arena already holds its key (the
    last eager step had its shape): it runs on that step's device inputs. Found by the device inputs the replay
    read, on a checked step (whose load is not doubled before its decoy, which would hide it) or an unchecked one."""
    from gmtool.core.executor import GraphExecutor
    from gmtool.core.inputs import PersistentInputs

    real_init, real_load = GraphExecutor.__init__, PersistentInputs.load

    def init(self, *a, **kw):
        real_init(self, *a, **kw)
        self.inputs.graph_arena = True

    def load(self, batch, key, copy=True):
        eager_key = key.num_tokens > 16  # above the largest bucket: auto's eager steps, exact shapes
        skip = copy and getattr(self, "graph_arena", False) and eager_key and self.holds(key)
        return real_load(self, batch, key, copy=copy and not skip)

    monkeypatch.setattr(GraphExecutor, "__init__", init)
    monkeypatch.setattr(PersistentInputs, "load", load)
    r, doc = _auto_run(tmp_path, "--steps", "300", "--check-every", "5")
    m = doc["runs"][0]["mismatch"]
    assert r.exit_code == 3 and m is not None, r.output
    assert re.search(r"device inputs (the replay read are not this|that are not its) batch's", m["reason"]), m


def test_auto_serving_a_prefill_with_its_full_graphs_is_caught(tmp_path, monkeypatch):
    """auto's rule, checked apart from its dispatch: a prefill or mixed batch served by the decode part's full
    graphs is a finding even where its numbers come out right (the graph is keyed by tokens x sequences)."""
    from gmtool.core.auto import AutoExecutor

    real = AutoExecutor.part_for
    monkeypatch.setattr(AutoExecutor, "part_for", lambda self, b: real(self, b) and self.parts["decode"])
    r, doc = _auto_run(tmp_path, "--steps", "60", "--check-every", "5")
    m = doc["runs"][0]["mismatch"]
    assert r.exit_code == 3 and m is not None and "with full, not piecewise" in m["reason"], (r.output, m)


def test_auto_serving_a_prefill_with_its_full_graphs_is_caught_on_an_unchecked_step(tmp_path, monkeypatch):
    """The dispatch is checked on every step, not only every --check-every'th: a shape that turns up only between
    checks was served wrongly unseen."""
    from gmtool.core.auto import AutoExecutor
    from gmtool.verify import soak as soak_module

    monkeypatch.setattr(soak_module, "FIRST_CHECKS", 0)  # a new graph's first replays are checked: not here
    real, calls = AutoExecutor.part_for, []

    def part_for(self, b):
        calls.append(1)
        return real(self, b) and (self.parts["decode"] if len(calls) > 3 else real(self, b))

    monkeypatch.setattr(AutoExecutor, "part_for", part_for)
    r, doc = _auto_run(tmp_path, "--steps", "60", "--check-every", "60")
    m = doc["runs"][0]["mismatch"]
    assert r.exit_code == 3 and m is not None and "with full, not piecewise" in m["reason"], (r.output, m)
    assert 0 < m["step"] < 59, m  # an unchecked step (the 60th is the one checked)


def test_the_poisoned_kv_tail_starts_at_the_first_slot_past_each_length(rig):
    """A graph reading one slot past a request's length (an off-by-one kv_len) must read poison, not a clean 0."""
    s = Soak(rig[1], rig[2], "full", None, "default", SoakOptions(4, 100, 0))
    bs = rig[1].cache.spec.block_size
    unused, tails = s.poisoner._kv_spans([([5, 9], bs + 3), ([7], 0)])
    want = [9 * bs + i for i in range(3, bs)] + [7 * bs + i for i in range(bs)]
    assert tails.tolist() == want
    assert not {5, 7, 9} & set(unused.tolist()) and len(unused) > 0


def test_an_injected_fault_nothing_caught_is_said_in_the_verdict(tmp_path):
    """freeze-seq-lens under piecewise prefill (its attention reads the lengths from the host plan, not the frozen
    copy): the verdict was a plain "clean", as if the self-test had passed."""
    out = tmp_path / "v"
    args = ["verify", "--device", "cpu", "--modes", "piecewise", "--inject", "freeze-seq-lens", "--steps", "20"]
    r = runner.invoke(app, [*args, "--check-every", "2", "--buckets", "1,2,4", "--out", str(out)])
    doc = json.loads((out / "verify.json").read_text())
    assert r.exit_code == 0 and not doc["findings"]
    assert doc["verdict"].endswith("but the injected freeze-seq-lens was never caught: these soaks ran nothing it "
                                   "changes (as freeze-seq-lens under piecewise prefill, whose attention reads the "
                                   "lengths from its host plan), or verify missed it")  # fmt: skip
    clean = runner.invoke(app, ["verify", "--device", "cpu", "--modes", "piecewise", "--steps", "4", "--check-every",
                                "2", "--buckets", "1,2,4", "--out", str(tmp_path / "c")])  # fmt: skip
    assert clean.exit_code == 0 and "never caught" not in clean.output


@pytest.mark.parametrize("fault", ["freeze-seq-lens", "share-output-across-buckets"])
def test_a_graph_that_serves_only_steps_between_checks_is_still_checked(tmp_path, fault):
    """Seed 2 at --check-every 3: auto's decode graphs (d4) served 5 of 80 steps, none of them checked, and the
    graph frozen at capture (or handing out its pool's logits) went unseen: verify said clean. Each graph's first
    replays are checked now; the second is the first after its capture's batch."""
    out = tmp_path / "v"
    args = ["verify", "--device", "cpu", "--modes", "auto", "--steps", "80", "--check-every", "3", "--seed", "2"]
    r = runner.invoke(app, [*args, "--buckets", "1,2,4,8", "--inject", fault, "--out", str(out)])
    m = json.loads((out / "verify.json").read_text())["runs"][0]["mismatch"]
    assert r.exit_code == 3 and m is not None and m["key"] == "d4", (r.output, m)


def test_a_mode_whose_soak_missed_the_injected_fault_is_named_when_another_caught_it(tmp_path):
    """full caught freeze-seq-lens, piecewise's four prefill steps ran nothing it changes: the verdict named
    full's catch and piecewise's clean soak went unsaid."""
    out = tmp_path / "v"
    args = ["verify", "--device", "cpu", "--modes", "full,piecewise", "--inject", "freeze-seq-lens", "--steps", "4"]
    r = runner.invoke(app, [*args, "--check-every", "2", "--buckets", "1,2,4,8", "--out", str(out)])
    doc = json.loads((out / "verify.json").read_text())
    assert r.exit_code == 3 and [x["mismatch"] is None for x in doc["runs"]] == [False, True], r.output
    assert (
        "the injected freeze-seq-lens was never caught in piecewise under default: these soaks ran nothing it "
        "changes, or verify missed it"
    ) in doc["notes"]


def test_a_wrong_replay_of_a_step_that_fills_its_bucket_names_a_row_read_from_another_token(tmp_path):
    """pad-read on a checked step with no padding lane (8 tokens in bucket 8): nothing poisoned changes the
    result, and the one suspect named a value frozen at capture, where the graph reads another token's row."""
    out = tmp_path / "v"
    args = ["verify", "--device", "cpu", "--modes", "full", "--inject", "pad-read", "--steps", "40", "--seed", "0"]
    r = runner.invoke(app, [*args, "--check-every", "10", "--buckets", "1,2,4,8", "--out", str(out)])
    m = json.loads((out / "verify.json").read_text())["runs"][0]["mismatch"]
    assert r.exit_code == 3 and m["key"] == "t8xs1" and m["composition"] == "8", m
    assert (
        "This step fills its bucket, so no padding lane was poisoned: a row read from another token's"
        in (m["suspects"][0])
    )


def test_verify_soaks_fx_split_piecewise_graphs_where_asked_and_says_where_it_fell_back(monkeypatch):
    """--piecewise-impl fx reaches verify's soaks (it was a capture and compare option only). Where fx cannot
    trace the model, the graphs are split at run time instead: verify then says it soaked other graphs than
    the ones asked for."""
    from gmtool.core import forwards
    from gmtool.verify.run import run_verify

    traced = []
    real = forwards.FxSplit.warmup
    monkeypatch.setattr(forwards.FxSplit, "warmup", lambda self, ex, fn: traced.append(1) or real(self, ex, fn))
    cfg = VerifyConfig(device="cpu", modes="piecewise,auto", piecewise_impl="fx", steps=12, check_every=4)
    assert cfg.sweep.piecewise_impl == "fx"  # auto alone would be refused by the sweep's decode-only check
    doc = run_verify(cfg)
    assert doc["exit_code"] == 0 and len(doc["runs"]) == 2, doc["verdict"]
    assert traced and not any("split by" in n for n in doc["notes"]), doc["notes"]
    # the dynamic-dimension captures record the fx pieces' ops: their recorder, entered around the compiled call,
    # made torch.compile skip the code, and every later fx split (the soaks') fell back to the run-time split
    pieces = [d for d in doc["dynamic_dims"] if d["mode"] == "piecewise"]
    assert pieces and all(d["ops"][0] == d["ops"][1] > 100 for d in pieces), pieces

    def untraceable(self, ex, fn):
        raise RuntimeError("dynamo met an op it cannot trace")

    monkeypatch.setattr(forwards.FxSplit, "warmup", untraceable)
    doc = run_verify(VerifyConfig(device="cpu", modes="full,piecewise", piecewise_impl="fx", steps=6, check_every=3))
    assert doc["exit_code"] == 0, doc["verdict"]
    fell = [n for n in doc["notes"] if "split by" in n]
    assert fell == [
        "piecewise under default: piecewise graphs split by breakable (fx could not trace: dynamo met an op it "
        "cannot trace), not fx"
    ]
    # the dynamic-dimension captures record the split the capture fell back to (they recorded nothing: the
    # recorder waited inside fx pieces that never ran, and the analysis read clean)
    pieces = [d for d in doc["dynamic_dims"] if d["mode"] == "piecewise"]
    assert pieces and all(d["compared"] and d["ops"][0] == d["ops"][1] > 100 for d in pieces), pieces


def test_fx_splits_do_not_pile_up_in_dynamos_cache_across_verify_runs(monkeypatch):
    """Each fx split's compiled entries sat on one shared code object, each holding its model: past dynamo's
    accumulated limit (256, about 36 verify runs in one process) every later split fell back to the run-time one.
    Each split now has a code object of its own, and its executor's release frees its entries."""
    from torch._dynamo.eval_frame import _debug_get_cache_entry_list

    from gmtool.model.fx_split import FxPiecewise
    from gmtool.verify.run import run_verify

    # the config's own patch: monkeypatch's restore left the name undefined in dynamo's config module
    limit = "accumulated_recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else None
    made = []
    real_init = FxPiecewise.__init__
    monkeypatch.setattr(FxPiecewise, "__init__", lambda self, *a, **k: made.append(self) or real_init(self, *a, **k))
    with torch._dynamo.config.patch({limit or "accumulated_cache_size_limit": 8}):
        for _ in range(2):  # one verify traces 7 entries: a shared code object hit 8 in the second
            cfg = VerifyConfig(device="cpu", modes="piecewise,auto", piecewise_impl="fx", steps=6, check_every=3)
            doc = run_verify(cfg)
            assert doc["exit_code"] == 0 and not any("split by" in n for n in doc["notes"]), doc["notes"]
    assert len(made) >= 4 and len({id(fx._code) for fx in made}) == len(made)
    assert all(_debug_get_cache_entry_list(fx._code) == [] for fx in made)  # every executor (auto's too) released


def test_a_dynamic_dimension_analysis_that_recorded_no_op_is_not_called_clean():
    from gmtool.verify.report import dyndims_table, finish_document

    dd = {"mode": "piecewise", "kind": "decode", "key": "d4", "compositions": ["1*4", "1*3"], "ops": [0, 0]}
    dd |= {"baked": [], "diverged_at": None, "note": None, "graph_nodes": None, "clean": True, "compared": False}
    run = {"mode": "piecewise", "strategy": "default", "steps": 5, "checks": 2, "expected_unsafe": False}
    doc = {"capturability": [], "dynamic_dims": [{**dd, "expected_unsafe": False}], "runs": [{**run, "mismatch": None}]}
    doc = finish_document(doc, None, 1.0)
    assert doc["verdict"].endswith("; but dynamic dimensions compared nothing in piecewise decode"), doc["verdict"]
    assert (
        "dynamic dimensions: a capture recorded no op in piecewise decode: nothing was compared there" in doc["notes"]
    )
    assert "NOT COMPARED" in str([c._cells for c in dyndims_table(doc).columns])


def test_verify_takes_piecewise_impl_only_with_a_mode_it_splits_and_reproduces_with_it():
    from gmtool.errors import GmtoolError

    with pytest.raises(GmtoolError, match="--piecewise-impl fx splits piecewise graphs, and --modes full has none"):
        VerifyConfig(device="cpu", modes="full", piecewise_impl="fx")
    with pytest.raises(GmtoolError, match="unknown --piecewise-impl 'cuts'"):
        VerifyConfig(device="cpu", modes="piecewise", piecewise_impl="cuts")
    cfg = VerifyConfig(device="cpu", modes="full,piecewise,auto", piecewise_impl="fx")
    for mode in ("piecewise", "auto"):
        argv = cfg.repro(mode, "default", 20).split()[2:]
        assert "--piecewise-impl fx" in " ".join(argv)
        opts = {argv[i].lstrip("-").replace("-", "_"): argv[i + 1] for i in range(0, len(argv), 2)}
        for k in ("steps", "check_every", "seed", "max_num_seqs", "max_kv_len", "block_size"):
            opts[k] = int(opts[k])
        assert VerifyConfig(**opts).sweep.piecewise_impl == "fx"
    assert "--piecewise-impl" not in cfg.repro("full", "default", 20)  # refused with full alone
    assert "--piecewise-impl" not in VerifyConfig(device="cpu", modes="piecewise").repro("piecewise", "default", 20)


def test_a_soaks_own_notes_reach_the_documents_notes():
    """A soak's notes (a fallback split, skipped decoys, a stop) were in verify.json's runs only: the terminal
    prints the document's notes."""
    from gmtool.verify.report import finish_document

    run = {"mode": "full", "strategy": "vmm", "steps": 5, "checks": 1, "expected_unsafe": False, "mismatch": None}
    doc = {"capturability": [], "dynamic_dims": [], "runs": [{**run, "notes": ["stopped at the time limit"]}]}
    doc = finish_document(doc, None, 1.0)
    assert "full under vmm: stopped at the time limit" in doc["notes"]


def test_dynamic_dimensions_of_an_fx_split_record_its_lm_head(monkeypatch):
    """fx captures the LM head as one more graph after its pieces: the op recorder, entered inside the pieces,
    left the head out, so a value baked into it went unseen."""
    from gmtool.core import forwards
    from gmtool.verify.dyndims import recorded_ops

    real = forwards.lm_head

    def marked(ex, views):
        torch.ones(3, 5, 7).sum()  # a shape no other op of the forward has
        real(ex, views)

    monkeypatch.setattr(forwards, "lm_head", marked)
    cfg = VerifyConfig(device="cpu", modes="piecewise", piecewise_impl="fx", steps=4, check_every=2)
    bench = build_bench(cfg)
    ops, _, _ = recorded_ops(bench, "piecewise", bench.batch(parse_composition("1*4", 0)))
    assert any(("shape", (3, 5, 7)) in op.args for op in ops), [op.name for op in ops[-5:]]


def test_fx_dynamic_dimensions_with_a_node_reader_trace_none_of_its_hooks():
    """On CUDA the recorder samples the graph's nodes at every module change, through the tracker's global hooks.
    dynamo traced those hooks into the fx split, guarded on the recorder's switch: the capture recompiled, traced
    the sampler's driver calls, and verify ended on a CaptureError. A C call stands in for the driver here."""
    import ctypes

    from gmtool.verify.dyndims import recorded_ops

    class Sampler:
        calls = 0

        def sample(self):
            Sampler.calls += 1
            ctypes.c_int(0)  # dynamo cannot trace it

    class Reader:
        notes: set = set()

        def sampler(self, tracker):
            return Sampler()

        def entry_nodes(self, entry, sampler):
            return []

    cfg = VerifyConfig(device="cpu", modes="piecewise", piecewise_impl="fx", steps=4, check_every=2)
    bench = build_bench(cfg)
    held = []
    try:
        ops, _, _ = recorded_ops(
            bench, "piecewise", bench.batch(parse_composition("1*4", 0)), reader=Reader(), held=held
        )
        impl = held[0].forward_impl
        assert impl.label == "fx" and len(ops) > 100 and Sampler.calls > 0
        assert len(impl.active.fx.splits) == 1  # traced once, at the warm-up: nothing recompiled under capture
    finally:
        for ex in held:
            ex.release()
