"""--fuse's RoPE table (gmtool.model.rotary_table): the module's own cos/sin for every position the run holds,
gathered by position in one kernel; used only where it gives the module's bits."""

import pytest
import torch

from gmtool.model import rotary_table
from gmtool.model.fused import fuse_layers, unfused

from .helpers import Rig, rel


def _rotary(rig):
    return rig.lm.model.model.rotary_emb


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-llama"])
def test_the_table_gives_the_module_s_values_bit_for_bit(model):
    rig = Rig(model=model)
    rotary = _rotary(rig)
    table, why = rotary_table.build(rotary, 160, torch.float32, torch.device("cpu"))
    assert why is None and table.positions == 160
    x = torch.empty(1)
    for ids in (torch.tensor([[0, 159, 7, 7, 80]]), torch.randint(0, 160, (3, 5))):
        want, got = rotary(x, ids), table(x, ids)
        assert all(w.shape == g.shape and torch.equal(w, g) for w, g in zip(want, got))


def test_fuse_gathers_rope_from_the_table_and_the_logits_stay_the_same_bits(monkeypatch):
    rig = Rig()
    batches = [rig.batch("1*4", seed=1), rig.batch("5+3@20", seed=2)]
    plain = fuse_layers(rig.lm.model, "torch")  # RoPE recomputed per step
    plain.remove()
    fused = fuse_layers(rig.lm.model, "torch", rope_positions=160)
    rotary = _rotary(rig)
    assert fused.counts["rope_positions"] == 160 and "table of 160 positions" in fused.summary
    assert isinstance(rotary.__dict__.get("forward"), rotary_table.RotaryTable)

    def recomputed(*a, **k):
        raise AssertionError("the rotary module recomputed cos/sin")

    for b in batches:  # each pair back to back: a batch's pass writes K/V that another may read
        fused.remove()
        plain.apply()
        want = rig.eager(b)
        plain.remove()
        fused.apply()
        with monkeypatch.context() as m:
            m.setattr(type(rotary), "forward", recomputed)
            assert torch.equal(rig.eager(b), want)
    with unfused(fused):
        assert "forward" not in rotary.__dict__  # the module's own forward again


def test_a_rope_that_follows_the_sequence_length_is_left_to_the_module():
    rig = Rig()
    rotary = _rotary(rig)
    rotary.rope_type = "dynamic"
    fused = fuse_layers(rig.lm.model, "torch", rope_positions=160)
    assert fused.counts["rope_positions"] == 0 and "forward" not in rotary.__dict__
    assert any("rope type 'dynamic'" in s for s in fused.skipped)


def test_a_table_that_differs_from_the_module_is_not_used(monkeypatch):
    rig = Rig()
    rotary = _rotary(rig)
    forward = type(rotary).forward
    calls = []

    def drifting(self, x, position_ids):  # the values depend on more than the position: a table cannot hold them
        calls.append(1)
        cos, sin = forward(self, x, position_ids)
        return cos + len(calls), sin

    monkeypatch.setattr(type(rotary), "forward", drifting)
    table, why = rotary_table.build(rotary, 160, torch.float32, torch.device("cpu"))
    assert table is None and "differs" in why


@pytest.mark.parametrize(
    "model, why",
    [
        ("gemma3_text", "a rope type per layer type"),  # rope_type is a dict; the forward takes the layer type
        ("deepseek_v2", "does not return a (cos, sin) pair"),  # complex frequencies, one tensor
    ],
)
def test_a_rotary_module_a_table_cannot_answer_is_left_to_it(model, why, tmp_path):
    from tests.arch_configs import write_config

    rig = Rig(model=str(write_config(model, tmp_path)), buckets=(8,), max_kv_len=32)
    b = rig.batch("4@8+1@9", seed=1)
    fused = fuse_layers(rig.lm.model, "torch", rig.lm.layout, rope_positions=32)  # raised before: no table here
    rotary = _rotary(rig)
    assert fused.counts["rope_positions"] == 0 and "forward" not in rotary.__dict__
    assert any(why in s for s in fused.skipped), fused.skipped
    out = rig.eager(b)
    with unfused(fused):
        assert rel(rig.eager(b), out) < 1e-5


def test_a_forward_that_takes_more_than_the_positions_is_left_to_the_module():
    rig = Rig()
    rotary = _rotary(rig)
    forward = type(rotary).forward

    class PerLayer(type(rotary)):  # a str rope type, and a forward that takes the layer type too
        def forward(self, x, position_ids, layer_type=None):
            return forward(self, x, position_ids)

    rotary.__class__ = PerLayer
    table, why = rotary_table.build(rotary, 160, torch.float32, torch.device("cpu"))
    assert table is None and "layer_type" in why


def test_an_x_of_another_dtype_gets_the_module_s_own_values():
    rig = Rig()
    rotary = _rotary(rig)
    table, _ = rotary_table.build(rotary, 160, torch.float32, torch.device("cpu"))
    ids = torch.tensor([[0, 159, 7]])
    for x in (torch.empty(1, dtype=torch.float64), torch.empty(1, dtype=torch.bfloat16)):
        want, got = rotary(x, ids), table(x, ids)
        assert all(w.dtype == g.dtype == x.dtype and torch.equal(w, g) for w, g in zip(want, got))
        assert table.rows(x, ids) is None  # nor does a kernel read the table's rows for it
    rows = table.rows(torch.empty(1), ids)  # the table's own dtype: its rows, for a kernel to read
    assert rows.cos_sin is table.cos_sin and rows.positions.tolist() == [0, 159, 7]
    assert all(torch.equal(g, w[0]) for g, w in zip(rows.gathered(), table(torch.empty(1), ids)))
