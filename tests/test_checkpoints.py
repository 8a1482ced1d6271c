"""Local checkpoint directories (--model DIR): loaded without accelerate, with the weights as saved; a folder
with a config and no weights runs on random weights and says so; damaged or mismatched weights are refused in
one line that names the file."""

import json
import shutil
import subprocess
import sys

import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from gmtool.cli.main import app
from gmtool.errors import GmtoolError
from gmtool.model.loading import load_model
from gmtool.profiles import load_model_profile
from tests.helpers import Rig

CPU = torch.device("cpu")
QUICK = ["--device", "cpu", "--buckets", "2", "--num-iters", "1", "--num-iters-warmup", "0"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """tiny-qwen3 built by transformers alone (its own attention, seed 7), written by save_pretrained."""
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = dict(load_model_profile("tiny-qwen3")["config"])
    torch.manual_seed(7)
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(raw.pop("model_type"), **raw))
    d = tmp_path_factory.mktemp("ckpt")
    model.save_pretrained(d)
    return d, {k: v.clone() for k, v in model.state_dict().items()}


def copy_of(saved, tmp_path, *names):
    d = tmp_path / "ckpt"
    d.mkdir()
    for name in names:
        shutil.copy(saved[0] / name, d / name)
    return d


def test_a_saved_checkpoint_loads_its_weights(saved):
    lm = load_model(str(saved[0]), CPU, torch.float32)
    assert lm.source == "checkpoint" and lm.notes == []
    got = lm.model.state_dict()
    assert got.keys() == saved[1].keys() and all(torch.equal(got[k], v) for k, v in saved[1].items())


def test_a_saved_checkpoint_gives_the_saved_models_logits(saved):
    ckpt, ref = Rig(model=str(saved[0]), buckets=(4,)), Rig(buckets=(4,))
    batch = ref.batch("1*2+2")
    random_weights = ref.eager(batch)
    ref.lm.model.load_state_dict(saved[1])
    expected = ref.eager(batch)
    assert not torch.allclose(random_weights, expected)  # the weights decide the logits
    assert torch.equal(ckpt.eager(ckpt.batch("1*2+2")), expected)


def test_capture_runs_a_checkpoint(saved, tmp_path):
    r = CliRunner().invoke(app, ["capture", "--model", str(saved[0]), *QUICK, "--out", str(tmp_path / "o")])
    assert r.exit_code == 0, (r.output, r.exception)
    doc = json.loads((tmp_path / "o/results.json").read_text())
    assert doc["model"]["source"] == "checkpoint" and doc["records"]
    assert all(r["status"] == "ok" for r in doc["records"])


def test_a_sharded_checkpoint_loads(saved, tmp_path):
    from transformers import AutoModelForCausalLM

    d = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(saved[0]).save_pretrained(d, max_shard_size="100KB")
    assert (d / "model.safetensors.index.json").is_file() and not (d / "model.safetensors").exists()
    got = load_model(str(d), CPU, torch.float32).model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in saved[1].items())


def test_a_config_only_folder_runs_on_random_weights_and_says_so(saved, tmp_path):
    d = copy_of(saved, tmp_path, "config.json")
    r = CliRunner().invoke(app, ["capture", "--model", str(d), *QUICK, "--out", str(tmp_path / "o")])
    assert r.exit_code == 0, (r.output, r.exception)
    doc = json.loads((tmp_path / "o/results.json").read_text())
    assert doc["model"]["source"] == "config"
    assert any("no weights" in n and "random weights" in n for n in doc["notes"]), doc["notes"]


def test_a_corrupt_weight_file_is_one_line_naming_it(saved, tmp_path):
    d = copy_of(saved, tmp_path, "config.json")
    (d / "model.safetensors").write_bytes((saved[0] / "model.safetensors").read_bytes()[:5000])  # cut short
    p = subprocess.run(
        [sys.executable, "-m", "gmtool", "capture", "--model", str(d), *QUICK, "--out", str(tmp_path / "o")],
        capture_output=True,
        text=True,
        timeout=300,
    )
    lines = [ln for ln in p.stderr.splitlines() if ln.strip()]
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    assert f"cannot read weight file {d / 'model.safetensors'}" in lines[0]
    assert not (tmp_path / "o").exists()


def test_weights_that_do_not_fit_the_config_are_refused(saved, tmp_path):
    d = copy_of(saved, tmp_path, "config.json", "model.safetensors")
    weights = load_file(d / "model.safetensors")
    save_file({k: v for k, v in weights.items() if "layers.1.mlp.up_proj" not in k}, d / "model.safetensors")
    with pytest.raises(
        GmtoolError,
        match=r"1 weights of the model are in no weight file \(first: "
        r"model.layers.1.mlp.up_proj.weight\)",
    ):
        load_model(str(d), CPU, torch.float32)
    weights["model.norm.weight"] = torch.ones(3)
    save_file(weights, d / "model.safetensors")
    with pytest.raises(
        GmtoolError,
        match=r"model.safetensors: model.norm.weight has shape \(3,\), but the config "
        r"gives \(64,\)",
    ):
        load_model(str(d), CPU, torch.float32)


def test_an_index_naming_an_absent_shard_is_refused(saved, tmp_path):
    d = copy_of(saved, tmp_path, "config.json")
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "part-2.safetensors"}})
    )
    with pytest.raises(GmtoolError, match="names the weight file part-2.safetensors, which is not in"):
        load_model(str(d), CPU, torch.float32)
