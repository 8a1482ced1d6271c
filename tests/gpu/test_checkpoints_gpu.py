"""A checkpoint folder on CUDA: loaded by transformers' from_pretrained on the CPU, then moved to the device
(gmtool.model.checkpoint), with the GEMM warm-up started after it; its graphs replay like eager."""

import json

import pytest
import torch
from typer.testing import CliRunner

from gmtool.cli.main import app
from gmtool.model.loading import load_model
from gmtool.profiles import load_model_profile

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """tiny-qwen3 (tied embeddings off) and a tiny Mixtral, each written by save_pretrained (Mixtral's in the
    per-expert layout transformers converts on load)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from tests.arch_configs import tiny_config

    out = {}
    for name, raw in (
        ("qwen3", dict(load_model_profile("tiny-qwen3")["config"])),
        ("mixtral", tiny_config("mixtral")),
    ):
        torch.manual_seed(7)
        model = AutoModelForCausalLM.from_config(AutoConfig.for_model(raw.pop("model_type"), **raw))
        d = tmp_path_factory.mktemp(name)
        model.save_pretrained(d)
        out[name] = (d, {k: v.clone() for k, v in model.state_dict().items()})
    return out


@pytest.mark.parametrize("name", ["qwen3", "mixtral"])
def test_a_checkpoint_loads_onto_the_device_in_the_asked_dtype(saved, name):
    d, weights = saved[name]
    lm = load_model(str(d), torch.device("cuda"), torch.bfloat16, gemm_rows=(1, 2), head_rows=(1, 2))
    if lm.gemm_warmup is not None:
        lm.gemm_warmup.join()
    params = dict(lm.model.named_parameters())
    assert all(p.device.type == "cuda" and p.dtype == torch.bfloat16 for p in params.values())
    sd = lm.model.state_dict()
    if name == "qwen3":  # a layout kept as stored: each weight as saved, in bf16
        assert all(torch.equal(sd[k].cpu(), v.to(torch.bfloat16)) for k, v in weights.items())


def test_capture_runs_a_checkpoint_on_cuda(saved, tmp_path):
    d, _ = saved["qwen3"]
    args = ["capture", "--model", str(d), "--device", "cuda", "--buckets", "1,2,4", "--num-iters", "3"]
    r = CliRunner().invoke(app, [*args, "--num-iters-warmup", "1", "--out", str(tmp_path / "o")])
    assert r.exit_code == 0, (r.output, r.exception)
    doc = json.loads((tmp_path / "o" / "results.json").read_text())
    assert doc["model"]["source"] == "checkpoint" and doc["records"]
    assert all(rec["status"] == "ok" for rec in doc["records"]), [rec["status"] for rec in doc["records"]]
