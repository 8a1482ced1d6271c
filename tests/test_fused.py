"""--fuse on the CPU: the fused layers compute what the Hugging Face layers do, share their weights, can be
switched off again, and run through every graph mode."""

import json

import pytest
import torch

from gmtool.model.fused import fuse_layers, unfused

from .helpers import Rig, rel
from .test_architectures import MUST_RUN
from .test_cli_capture import gm


@pytest.mark.parametrize("model", ["tiny-qwen3", "tiny-llama"])
def test_fused_layers_match_hf_layers(model):
    rig = Rig(model=model)
    batches = [rig.batch("1*4", seed=1), rig.batch("5+3@20", seed=2)]  # decode, and prefill with a prefix
    hf_first = rig.eager(batches[1])
    fused = fuse_layers(rig.lm.model, "torch")
    assert fused.counts["attention"] == rig.lm.num_layers and fused.counts["mlp"] == rig.lm.num_layers
    assert fused.counts["rmsnorm"] == 2 * rig.lm.num_layers + 1 and not fused.skipped
    assert fused.counts["residual_adds"] == 2 * rig.lm.num_layers and "forward" in rig.lm.model.model.__dict__
    with pytest.raises(ValueError, match="input_ids and position_ids only"):  # HF-only arguments are refused
        rig.lm.model.model(
            input_ids=torch.zeros(1, 2, dtype=torch.long),
            position_ids=torch.zeros(1, 2, dtype=torch.long),
            inputs_embeds=torch.zeros(1, 2, 8),
        )
    for b in batches:  # each pair back to back: a batch's eager pass writes K/V that another may read
        out = rig.eager(b)
        with unfused(fused):
            assert rel(out, rig.eager(b)) < 1e-5
    attn = rig.lm.model.model.layers[0].self_attn
    assert "forward" in attn.__dict__
    # q/k/v are views of one weight: fusing added no copy of the weights
    ptrs = {m.weight.untyped_storage().data_ptr() for m in (attn.q_proj, attn.k_proj, attn.v_proj)}
    assert len(ptrs) == 1
    with unfused(fused):
        assert "forward" not in attn.__dict__
        assert torch.equal(rig.eager(batches[1]), hf_first)  # the HF forwards, bit for bit
    assert "forward" in attn.__dict__


def test_fused_layers_replay_like_eager():
    rig = Rig(buckets=(4, 8))
    fuse_layers(rig.lm.model, "torch")
    for text, seed in (("1*4", 1), ("1*7", 2), ("1*3", 3)):
        b = rig.batch(text, seed)
        assert rel(rig.graph(b), rig.eager(b)) < 1e-5


def test_residual_stream_needs_fused_attention_in_every_layer():
    rig = Rig()
    rig.lm.model.config.partial_rotary_factor = 0.5  # attention left to HF: the base forward must stay HF's
    fused = fuse_layers(rig.lm.model, "torch")
    assert fused.counts["attention"] == 0 and fused.counts["residual_adds"] == 0
    assert "forward" not in rig.lm.model.model.__dict__ and "not the plain pre-norm block" in fused.summary
    b = rig.batch("1*4", seed=1)
    out = rig.eager(b)
    with unfused(fused):
        assert rel(out, rig.eager(b)) < 1e-5


def test_unfusable_mlp_is_left_alone():
    rig = Rig()
    rig.lm.model.config.hidden_act = "gelu"
    fused = fuse_layers(rig.lm.model, "torch")
    assert fused.counts["mlp"] == 0 and "MLP activation gelu" in fused.summary
    assert "forward" not in rig.lm.model.model.layers[0].mlp.__dict__


@pytest.mark.parametrize("extra", [[], ["--piecewise-impl", "fx"]])
def test_compare_with_fuse(tmp_path, extra):
    out = tmp_path / "fused"
    code, _, stderr = gm(
        "compare",
        "eager,full,piecewise",
        "--fuse",
        "--device",
        "cpu",
        "--buckets",
        "2,4",
        "--num-iters",
        "1",
        "--num-iters-warmup",
        "0",
        "--format",
        "quiet",
        "--out",
        str(out),
        *extra,
    )
    assert code == 0, stderr
    doc = json.loads((out / "results.json").read_text())
    assert doc["config"]["fuse"] is True
    assert any(n.startswith("--fuse: 2 attention blocks") for n in doc["notes"])
    rows = [r for r in doc["records"] if r["mode"] != "eager"]
    assert rows and all(r["status"] == "ok" and r["max_rel_err"] < 1e-4 for r in rows)
    if extra:
        assert {r["piecewise_impl"] for r in rows if r["mode"] == "piecewise"} == {"fx"}


# each feature family: what --fuse leaves, named (the fused attention passes the layer's window, cap and sinks on)
FEATURE_FUSE = {
    "tiny-gemma2": (2, {"MLP activation gelu_pytorch_tanh", "residual add not fused into RMSNorm for Gemma2Model"}),
    "tiny-gpt-oss": (
        0,
        {
            "a rotary embedding other than rotate-half over the whole head (GptOssAttention)",
            "residual add not fused into RMSNorm for GptOssModel",
        },
    ),
    "tiny-deepseek-v2": (
        0,
        {"attention without q/k/v/o projections", "residual add not fused into RMSNorm for DeepseekV2Model"},
    ),
}


@pytest.mark.parametrize("model", FEATURE_FUSE)
def test_fuse_covers_feature_families_exactly_or_names_why(model):
    rig = Rig(model=model, buckets=(4, 32), max_kv_len=64)
    b = rig.batch("20+3@30", seed=2)  # crosses tiny-gemma2's window (24)
    fused = fuse_layers(rig.lm.model, "torch", rig.lm.layout)
    attention, skipped = FEATURE_FUSE[model]
    assert fused.counts["attention"] == attention and set(fused.skipped) == skipped
    out = rig.eager(b)
    with unfused(fused):
        assert rel(out, rig.eager(b)) < 1e-5


def test_a_partial_rotary_set_in_rope_parameters_is_left_alone(tmp_path):
    """transformers 5 keeps partial_rotary_factor in rope_parameters (GLM, StableLM, Nemotron): the fused
    attention, which rotates the whole head, must not take those layers (it failed on cos/sin's shape)."""
    from tests.arch_configs import write_config

    rig = Rig(model=str(write_config("glm", tmp_path)), buckets=(8,), max_kv_len=32)
    b = rig.batch("4@8+1@9", seed=1)
    fused = fuse_layers(rig.lm.model, "torch", rig.lm.layout)
    assert fused.counts["attention"] == 0 and "partial rotary embedding" in fused.skipped
    out = rig.eager(b)
    with unfused(fused):
        assert rel(rig.eager(b), out) < 1e-5


# what --fuse fused before, and computed another model with (its eager and its graphs agreed with each other)
COMPUTES_MORE = {
    "cohere": "a rotary embedding other than rotate-half",  # an interleaved rotate_half (ERNIE 4.5, Helium too)
    "hunyuan_v1_dense": "query_layernorm",  # q/k norms after RoPE, under other names
    "bitnet": "attn_sub_norm",  # a norm before o_proj
    "dory": "suv_gate",  # learned scales and a norm inside the MLP
    "smollm3-nope": "a layer without RoPE",  # SmolLM3's NoPE layers (every 4th in the published models)
    "flint": "RoPE applied under a condition",  # RoPE on its sliding-window layers only
    "exaone4-hybrid": "RoPE applied under a condition",  # no RoPE on its global layers (rel err 0.46 fused)
}
# a tiny config changed to show the case: (its model type, the fields changed)
CASES = {
    "smollm3-nope": ("smollm3", {"no_rope_layers": [1, 0]}),  # layer 1 without RoPE
    "exaone4-hybrid": ("exaone4", {"layer_types": ["sliding_attention", "full_attention"]}),
}


@pytest.mark.parametrize("model", COMPUTES_MORE)
def test_a_block_that_computes_more_than_the_fused_forward_is_left_to_the_model(model, tmp_path):
    from tests.arch_configs import tiny_config, write_config

    if model in CASES:
        model_type, changes = CASES[model]
        path = tmp_path / f"{model_type}.json"
        path.write_text(json.dumps(tiny_config(model_type) | changes))
    else:
        path = write_config(model, tmp_path)
    rig = Rig(model=str(path), buckets=(8,), max_kv_len=32)
    b = rig.batch("4@8+1@9", seed=1)
    fused = fuse_layers(rig.lm.model, "torch", rig.lm.layout)
    assert any(COMPUTES_MORE[model] in s for s in fused.skipped), fused.skipped
    out = rig.eager(b)
    with unfused(fused):
        assert rel(rig.eager(b), out) < 1e-5


@pytest.mark.parametrize("model_type", sorted(MUST_RUN))
def test_fuse_computes_what_the_model_does(model_type, tmp_path):
    """Every architecture that must run: --fuse's layers (and its RoPE table) against the Hugging Face layers on
    one mix. Eager and graphs both run the fused layers, so their agreement cannot see a fused block that
    computes another model: this can."""
    from tests.arch_configs import write_config

    rig = Rig(model=str(write_config(model_type, tmp_path)), buckets=(8,), max_kv_len=32)
    b = rig.batch("4@8+1@9", seed=1)
    fused = fuse_layers(rig.lm.model, "torch", rig.lm.layout, rope_positions=32)
    out = rig.eager(b)
    with unfused(fused):
        assert rel(rig.eager(b), out) < 1e-5, (fused.counts, fused.skipped)


def test_rope_under_a_condition_is_read_from_the_forward_s_syntax():
    from gmtool.model.fused import _rope_under_a_condition

    def apply_rotary_pos_emb(q, k, cos, sin):
        return q, k

    class Always(torch.nn.Module):
        def forward(self, q, k, cos, sin):
            with torch.no_grad():  # a with is not a condition
                q, k = apply_rotary_pos_emb(q, k, cos, sin)
            return q, k

    class Sometimes(torch.nn.Module):
        sliding_window = None

        def forward(self, q, k, cos, sin):
            if self.sliding_window is not None:
                q, k = apply_rotary_pos_emb(q, k, cos, sin)
            return q, k

    class Either(torch.nn.Module):
        def forward(self, q, k, cos, sin, rotate=True):
            return apply_rotary_pos_emb(q, k, cos, sin) if rotate else (q, k)

    assert not _rope_under_a_condition(Always())
    assert _rope_under_a_condition(Sometimes()) and _rope_under_a_condition(Either())


def test_only_parts_that_hold_weights_count_as_more_than_the_fused_forward():
    """A child without parameters (a function the kernels hub attaches) leaves the block fused; one with
    weights (a gate, a norm the fused forward lacks) does not."""
    rig = Rig()
    layers = rig.lm.model.model.layers
    for layer in layers:
        layer.self_attn.kernel_fn = torch.nn.Identity()
    fused = fuse_layers(rig.lm.model, "torch")
    assert fused.counts["attention"] == len(layers)
    fused.remove()
    layers[0].self_attn.gate = torch.nn.Linear(4, 4)
    fused = fuse_layers(rig.lm.model, "torch")
    assert fused.counts["attention"] == len(layers) - 1 and any("gate" in s for s in fused.skipped)


def test_fuse_on_a_model_none_of_whose_layers_match_says_nothing_was_fused():
    """Phi's layers (no RMSNorm, a dense MLP, a partial rotary) match none of the fused patterns: the note listed
    '0 attention blocks (...), 0 MLPs (...), 0 RMSNorms' as if something had been fused."""
    from gmtool.model.fused import FusedLayers

    fused = FusedLayers()
    fused.skipped.append("a layer of type PhiDecoderLayer")
    assert fused.summary == (
        "--fuse: nothing fused, the model's own layers run as without it: a layer of type PhiDecoderLayer"
    )
    fused.counts["mlp"] = 2
    assert fused.summary.startswith("--fuse: 0 attention blocks")
