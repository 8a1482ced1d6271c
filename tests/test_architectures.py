"""Every causal-LM architecture transformers ships, as a tiny random model (tests/arch_configs.py), through the
CPU backend's compare of eager, full and piecewise graphs on a mix of a chunked prefill across a sliding window
and a decode token: each one either replays equal to eager, or is refused in one line that names it (before its
weights are built where the refusal can be read from the config or the model's classes).

A tiny config that transformers' own config class rejects (its checks want sizes the tiny one lacks) is skipped,
saying so: that is the test's shortfall, not the architecture's."""

from __future__ import annotations

import pytest
import torch

from gmtool.config import SweepConfig
from gmtool.errors import GmtoolError
from gmtool.measure.sweep import Sweep
from gmtool.records import Status
from tests.arch_configs import WINDOW, causal_lm_types, tiny_config, write_config
from tests.helpers import against_transformers

# one mix: 4 new tokens after 8 cached cross the window (6), beside a decode token
COMPOSITIONS = "4@8+1@9"
MUST_RUN = {
    "llama",
    "qwen2",
    "qwen3",
    "qwen3_moe",
    "mistral",
    "mixtral",
    "gemma",
    "gemma2",
    "gemma3_text",
    "gpt_oss",
    "deepseek_v2",
    "deepseek_v3",
    "phi",
    "phi3",
    "olmo2",
    "granite",
    "cohere",
    "starcoder2",
    "gpt_neox",
    "stablelm",
    "smollm3",
    "glm",
    "gpt2",
    "codegen",  # partial rotary, interleaved
    "gptj",
    "gemma3n_text",  # a layer reusing an earlier layer's K/V
    "nanochat",  # final logit soft-cap without a family entry
    "vaultgemma",
    "cohere2_moe",  # logit scale
    "minicpm3",
}


def _attention_interface(model_type: str) -> bool:
    """transformers' modeling file for model_type calls the AttentionInterface (falcon does from 5.25)."""
    import importlib
    import inspect

    try:
        module = importlib.import_module(f"transformers.models.{model_type}.modeling_{model_type}")
    except ImportError:
        return False
    return "ALL_ATTENTION_FUNCTIONS" in inspect.getsource(module)


MUST_REFUSE = {
    "bloom": "AttentionInterface",
    "mpt": "AttentionInterface",
    "mamba": "state",
    "qwen3_next": "state",
    "bert": "non-causal",
    "llama4_text": "chunked",
    "llama4": "chunked",  # the family of its language config
    # DeepSeek sparse attention (DSA) and its kin: the indexer picks the keys
    "deepseek_v32": "sparse attention: a top-k indexer (DeepseekV32Indexer)",
    "glm_moe_dsa": "sparse attention: a top-k indexer (GlmMoeDsaIndexer)",
    "axk2": "sparse attention: a top-k indexer (AXK2Indexer)",
    "hy_v4": "sparse attention: a top-k indexer (HYV4Indexer)",
    "dots3_note_text": "sparse attention",
    "deepseek_v4": "compressed K/V: a compressor (DeepseekV4HCACompressor)",
    "doge": "adds a mask it computes itself",
    "gemma4_unified_assistant": "K/V another model computed",
    "modernbert-decoder": "a head before its output embeddings (lm_head: ModernBertDecoderPredictionHead)",
}
if not _attention_interface("falcon"):  # before transformers 5.25 its attention was its own
    MUST_REFUSE["falcon"] = "AttentionInterface"
# transformers' own model class fails to build even from its config class's defaults: its words are all there is
TRANSFORMERS_FAILS = {"cohere_compass_text", "dbrx", "lfm2_moe", "musicgen", "musicgen_melody"}


def _run(model_type: str, tmp_path):
    try:
        path = write_config(model_type, tmp_path)
    except Exception as e:  # noqa: BLE001 (transformers' config checks)
        pytest.skip(
            f"{model_type}: the tiny config is not one its config class accepts: "
            f"{(str(e).strip().splitlines() or [''])[-1].strip()}"
        )
    return _run_path(path)


@pytest.mark.parametrize("model_type", causal_lm_types())
def test_architecture_runs_or_is_refused(model_type, tmp_path):
    try:
        res = _run(model_type, tmp_path)
    except GmtoolError as e:
        msg = str(e)
        assert "\n" not in msg.strip(), msg
        assert model_type in msg or model_type.replace("-", "_") in msg.lower(), msg
        assert model_type not in MUST_RUN, f"{model_type} must run: {msg}"
        if model_type in MUST_REFUSE:
            assert MUST_REFUSE[model_type] in msg, msg
        # a refusal names what is missing, not how the probe fell over
        assert "failed on a 2-token probe" not in msg, msg
        assert ("model class fails to build" in msg) == (model_type in TRANSFORMERS_FAILS), msg
        return
    assert model_type not in MUST_REFUSE, f"{model_type} ran, but gmtool cannot compute it faithfully"
    assert not res.errors, res.errors
    rows = {(str(r.mode), r.composition): r.status for r in res.records}
    assert len(rows) == 3, rows
    assert all(s == Status.OK for s in rows.values()), rows
    # and eager is the model's own computation, not only the graphs' match (random weights: a feature whose
    # parameters start at zero can still hide, as Doge's dynamic mask does, which the probe refuses instead)
    ours, theirs = against_transformers(str(tmp_path / f"{model_type}.json"), also=_reads_the_text_model)
    torch.testing.assert_close(ours, theirs, atol=1e-4, rtol=1e-4)


def _reads_the_text_model(rig, batch):
    """What compare, verify and --tp read of a model that runs, beside the sweep: the floor's bytes, the
    per-layer taps, the split's refusal. A multimodal config holds the sizes in its text config (Gemma 3's:
    compare fell over on the floor after its sweep)."""
    from gmtool.measure.floor import step_bytes
    from gmtool.parallel.shard import tp_refusal
    from gmtool.verify.taps import LayerTaps

    assert step_bytes(rig.lm, batch) > 0
    try:
        taps = LayerTaps(rig.lm, batch.num_tokens, torch.device("cpu"))
    except GmtoolError as e:
        assert "per-layer taps find no decoder layers" in str(e), e
    else:
        assert taps.layers.count(rig.lm.num_layers - 1) >= 1, taps.modules  # the last layer is tapped
        taps.remove()
    assert tp_refusal(rig.lm.config, 2) is None or "--tp 2" in tp_refusal(rig.lm.config, 2)


def test_window_is_the_models():
    """The probed layout carries the model's own per-layer windows: Gemma 2 alternates (sliding first)."""
    from gmtool.model.loading import load_model
    import torch
    import tempfile
    from pathlib import Path

    with tempfile.TemporaryDirectory() as d:
        lm = load_model(str(write_config("gemma2", Path(d))), torch.device("cpu"), torch.float32)
    assert lm.layout.windows == [WINDOW, None]
    assert all(o.softcap == lm.config.attn_logit_softcapping for o in lm.layout.layers)


FEATURE_PROFILES = ["tiny-gemma2", "tiny-gpt-oss", "tiny-deepseek-v2"]


@pytest.mark.parametrize("model", FEATURE_PROFILES + ["tiny-qwen3", "mistral", "phi3", "gemma3_text", "cohere2"])
def test_gmtool_attention_computes_what_transformers_does(model, tmp_path):
    """One 40-token prompt (past every window) through gmtool's paged attention, and through the same model with
    transformers' own eager attention and masks: the last token's logits agree (windows, soft-caps, sinks, MLA
    head dims and the final logit soft-cap included). Eager-vs-graph checks cannot see this: both sides use
    gmtool's attention."""
    import torch

    from tests.helpers import against_transformers

    spec = model if model.startswith("tiny-") else str(write_config(model, tmp_path))  # window 6 (arch_configs)
    torch.testing.assert_close(*against_transformers(spec), atol=1e-4, rtol=1e-4)


@pytest.mark.parametrize("model", FEATURE_PROFILES)
def test_feature_profiles_replay_through_fx_pieces(model):
    """The FX split passes each layer's options through the opaque attention op (window, cap, sinks as arguments)."""
    from tests.helpers import Rig, rel

    rig = Rig(model=model, mode="piecewise", piecewise_impl="fx", buckets=(32,), max_kv_len=64)
    b = rig.batch("10+2@40+1@50", 2)
    assert rel(rig.graph(b), rig.eager(b)) < 1e-5


@pytest.mark.parametrize(
    "model_type, feature",
    [
        ("deepseek_v32", "sparse attention: a top-k indexer (DeepseekV32Indexer) picks the keys"),
        ("deepseek_v4", "compressed K/V: a compressor (DeepseekV4HCACompressor) pools blocks"),
        ("gemma4_unified_assistant", "every layer attends to K/V another model computed"),
    ],
)
def test_keys_the_attention_picks_itself_are_refused_before_weights(model_type, feature, tmp_path, monkeypatch):
    """Sparse (DSA indexer) and compressed attention, and a drafter with no K/V of its own, are refused from the
    attention modules' parts, on the meta-device skeleton: the model is built once, with no weights."""
    import torch

    from gmtool.model import loading

    builds = []
    real_build = loading._build
    monkeypatch.setattr(loading, "_build", lambda cfg, dtype: builds.append(1) or real_build(cfg, dtype))
    with pytest.raises(GmtoolError) as e:
        loading.load_model(str(write_config(model_type, tmp_path)), torch.device("cpu"), torch.float32)
    msg = str(e.value)
    assert msg.startswith(f"{model_type}: ") and feature in msg and "\n" not in msg, msg
    assert builds == [1], "refused after the weights were built"


def test_dsa_refusal_is_one_line_from_the_cli(tmp_path):
    """`gmtool compare` on DeepSeek V3.2: exit 2, the architecture and the missing feature, no traceback."""
    import subprocess
    import sys

    path = write_config("deepseek_v32", tmp_path)
    p = subprocess.run(
        [sys.executable, "-m", "gmtool", "compare", "eager,full,piecewise", "--device", "cpu", "--model", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 2 and "Traceback" not in p.stderr, p.stderr
    assert "deepseek_v32: " in p.stderr and "top-k indexer" in p.stderr, p.stderr


def test_a_logit_rule_gmtool_lacks_is_refused(tmp_path, monkeypatch):
    """The probe holds gmtool's logits to the causal LM's own forward: without its logit scale in the family
    table, Cohere 2 MoE is refused, naming that, rather than run with logits 16x too large."""
    import torch

    from gmtool.model import families
    from gmtool.model.loading import load_model

    monkeypatch.delitem(families.FAMILIES, "cohere2_moe")
    with pytest.raises(GmtoolError, match=r"^cohere2_moe: .*a rule to its logits that gmtool.model.families"):
        load_model(str(write_config("cohere2_moe", tmp_path)), torch.device("cpu"), torch.float32)


def test_layers_without_gmtool_attention_are_named(tmp_path):
    """Mllama's cross-attention layers (to image features) call no attention on a text-only forward: the refusal
    names their class, not only their indices."""
    import json

    from gmtool.model.loading import load_model
    from tests.arch_configs import tiny_config

    cfg = tiny_config("mllama")
    cfg["text_config"]["cross_attention_layers"] = [1]
    path = tmp_path / "mllama.json"
    path.write_text(json.dumps(cfg))
    with pytest.raises(GmtoolError, match=r"^mllama: layers \[1\] \(MllamaCrossAttentionDecoderLayer\) have no"):
        load_model(str(path), torch.device("cpu"), torch.float32)


def test_alibi_configs_are_refused_by_name(tmp_path):
    """Falcon with ALiBi: transformers (5.25 on) routes its attention through the interface but puts the bias in
    the mask, which gmtool's attention does not read; refused in one line that says so, not by a failed probe."""
    import json

    path = write_config("falcon", tmp_path)
    cfg = json.loads(path.read_text())
    cfg["alibi"] = True
    path.write_text(json.dumps(cfg))
    with pytest.raises(GmtoolError, match=r"^falcon: ALiBi position biases \(config alibi=True\)"):
        _run_path(path)


def _run_path(path):
    cfg = SweepConfig(
        model=str(path),
        device="cpu",
        dtype="fp32",
        scenario="prefill",
        buckets="8",
        compositions=COMPOSITIONS,
        modes=("eager", "full", "piecewise"),
        max_kv_len=32,
        num_iters=1,
        num_iters_warmup=0,
    )
    return Sweep(cfg).run()


@pytest.mark.parametrize(
    ("model_type", "table"),
    [("gpt2", ("transformer.wpe", 512)), ("opt", ("model.decoder.embed_positions", 512)), ("gemma3", None)],
)
def test_only_the_text_model_s_learned_position_table_bounds_max_kv_len(model_type, table):
    """GPT-2's wpe bounds --max-kv-len; OPT's table is read past its offset of 2 (514 rows hold 512 positions);
    a multimodal model's vision tower has a position table of its own (Gemma 3's 196 patches) that the text's
    positions never index, and that once refused every run above 196 tokens."""
    from gmtool.model import attention, families, loading

    attention.register()
    cfg = loading._config_from_dict(tiny_config(model_type))
    with torch.device("meta"):
        model = loading._build(cfg, torch.float32)
    assert families.learned_positions(model) == table


def test_non_finite_logits_of_the_models_own_forward_are_refused_as_such(tmp_path):
    """A bf16-trained model run in float16: its MLP's activations pass 65504 and the model's own logits are NaN.
    The refusal says so and names bf16, not a logit rule gmtool lacks."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from gmtool.model.loading import load_model
    from tests.arch_configs import tiny_config

    cfg = tiny_config("llama")
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(cfg.pop("model_type"), **cfg))
    with torch.no_grad():
        for layer in model.model.layers:
            layer.mlp.gate_proj.weight.mul_(2000.0)
            layer.mlp.up_proj.weight.mul_(2000.0)
    model.save_pretrained(tmp_path)
    with pytest.raises(GmtoolError, match=r"non-finite logits in float16 .*try --dtype bf16"):
        load_model(str(tmp_path), torch.device("cpu"), torch.float16)
    load_model(str(tmp_path), torch.device("cpu"), torch.float32)  # fine in float32: the refusal is float16's
