"""Local checkpoint directories (--model DIR): loaded as transformers' from_pretrained loads them (without
accelerate), to the weights transformers gives; a folder with a config and no weights runs on random weights
and says so; damaged or mismatched weights are refused in one line that names the file or folder."""

import json
import re
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
    d.mkdir(parents=True)
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
    assert not any("max_position_embeddings" in n for n in doc["notes"]), doc["notes"]
    raw = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**raw, "max_position_embeddings": 32}))
    args = ["capture", "--model", str(d), *QUICK, "--max-kv-len", "40", "--out", str(tmp_path / "o2")]
    r = CliRunner().invoke(app, args)
    assert r.exit_code == 0, (r.output, r.exception)
    notes = json.loads((tmp_path / "o2/results.json").read_text())["notes"]
    assert "--max-kv-len 40 is past the model's max_position_embeddings (32)" in " ".join(notes), notes


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
        match=r"ckpt: model.norm.weight has shape \(3,\), but the config gives \(64,\)",
    ):
        load_model(str(d), CPU, torch.float32)


def test_an_index_naming_an_absent_shard_is_refused(saved, tmp_path):
    d = copy_of(saved, tmp_path, "config.json")
    (d / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"lm_head.weight": "part-2.safetensors"}})
    )
    with pytest.raises(GmtoolError, match="names the weight file part-2.safetensors, which is not in"):
        load_model(str(d), CPU, torch.float32)


def _converted_types() -> list[str]:
    """The causal-LM architectures whose saved checkpoints transformers converts on load (per-expert weights
    fused, a multimodal model's language_model prefix moved, ...)."""
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    from tests.arch_configs import causal_lm_types

    return [t for t in causal_lm_types() if get_checkpoint_conversion_mapping(t)]


@pytest.mark.parametrize("model_type", _converted_types())
def test_a_checkpoint_that_transformers_converts_on_load_loads_as_transformers_loads_it(model_type, tmp_path):
    """save_pretrained writes these in their older key layout (Mixtral's experts.N.w1, Qwen3-MoE's
    experts.N.gate_proj, Gemma 3's language_model.model.*), and from_pretrained converts them back: every such
    checkpoint of a family gmtool runs must load to transformers' own weights (a 1:1 copy of the stored keys
    refused them all)."""
    from transformers import AutoModelForCausalLM

    from gmtool.model import attention, checkpoint, loading
    from tests.arch_configs import tiny_config

    attention.register()
    try:
        torch.manual_seed(0)
        AutoModelForCausalLM.from_config(loading._config_from_dict(tiny_config(model_type))).save_pretrained(tmp_path)
        cfg = loading._config_from_dict(json.loads((tmp_path / "config.json").read_text()))
        loading._check_supported(cfg)  # a family gmtool refuses is refused before any weights: nothing to load
    except Exception as e:  # noqa: BLE001 (transformers' own tiny-config failures, gmtool's refusals)
        pytest.skip(f"{model_type}: not built here: {type(e).__name__}: {(str(e).splitlines() or [''])[0]}")
    files = checkpoint.weight_files(tmp_path)
    model, notes = checkpoint.load_pretrained(tmp_path, files, cfg, torch.float32, CPU, attention.ATTN_NAME)
    assert notes == []
    ref = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.float32).state_dict()
    sd = model.state_dict()
    assert sd.keys() == ref.keys()
    assert all(torch.equal(sd[k], ref[k]) for k in ref)


def test_a_stored_head_that_differs_from_its_tied_embedding_unties_them_as_transformers_does(saved, tmp_path):
    """tie_word_embeddings with an lm_head.weight stored beside the embedding, and different from it: transformers
    keeps both (a copy into one shared storage let the embedding win, and the logits were another model's)."""
    d = copy_of(saved, tmp_path, "config.json", "model.safetensors")
    cfg = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps(cfg | {"tie_word_embeddings": True}))
    weights = load_file(d / "model.safetensors")
    head = torch.randn_like(weights["model.embed_tokens.weight"])
    save_file(weights | {"lm_head.weight": head}, d / "model.safetensors")
    model = load_model(str(d), CPU, torch.float32).model
    assert torch.equal(model.get_output_embeddings().weight, head)
    assert torch.equal(model.get_input_embeddings().weight, weights["model.embed_tokens.weight"])


def test_model_safetensors_wins_over_an_index_beside_it_and_an_empty_or_escaping_index_is_refused(saved, tmp_path):
    """transformers' order: model.safetensors before the index of shards (a stale index and its shards beside a
    newer single file were read instead of it)."""
    d = copy_of(saved, tmp_path, "config.json", "model.safetensors")
    stale = load_file(d / "model.safetensors")
    (d / "old.safetensors").write_bytes(b"\x00" * 64)  # a stale shard, damaged: not read, so not refused
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {k: "old.safetensors" for k in stale}}))
    got = load_model(str(d), CPU, torch.float32).model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in saved[1].items())
    (d / "model.safetensors").unlink()
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {}}))
    with pytest.raises(GmtoolError, match="names no weight file"):
        load_model(str(d), CPU, torch.float32)
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"lm_head.weight": "../x.safetensors"}}))
    with pytest.raises(GmtoolError, match=r"names \.\./x\.safetensors, outside"):
        load_model(str(d), CPU, torch.float32)


def test_weights_that_are_no_weights_are_refused_by_what_they_are(saved, tmp_path):
    """A link to nothing (a cache snapshot copied without its blobs) is not 'no weights, random ones'; NaN in a
    stored weight, an adapter folder and a weight file given as --model are each said as what they are."""
    d = copy_of(saved, tmp_path, "config.json")
    (d / "model.safetensors").symlink_to(tmp_path / "blobs" / "gone")
    with pytest.raises(GmtoolError, match="model.safetensors is a link to .*gone, which does not exist"):
        load_model(str(d), CPU, torch.float32)
    (d / "model.safetensors").unlink()
    weights = load_file(saved[0] / "model.safetensors")
    weights["model.norm.weight"] = weights["model.norm.weight"].clone()
    weights["model.norm.weight"][3] = float("nan")
    save_file(weights, d / "model.safetensors")
    with pytest.raises(GmtoolError, match="the stored weight model.norm.weight holds NaN or infinite values"):
        load_model(str(d), CPU, torch.float32)
    with pytest.raises(GmtoolError, match="is a weight file: give the checkpoint folder"):
        load_model(str(d / "model.safetensors"), CPU, torch.float32)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text("{}")
    shutil.copy(d / "model.safetensors", adapter / "adapter_model.safetensors")
    with pytest.raises(GmtoolError, match="is a PEFT adapter"):
        load_model(str(adapter), CPU, torch.float32)
    shutil.copy(d / "config.json", adapter / "config.json")
    with pytest.raises(GmtoolError, match="is a PEFT adapter"):
        load_model(str(adapter), CPU, torch.float32)


def test_a_config_file_is_read_as_a_folder_would_be(saved, tmp_path, monkeypatch):
    """Beside weights it says they are not read; quantized it is refused as the folder is; code of its own
    (auto_map) is never run, nor asked about, and a run of transformers' own classes says so."""
    import transformers

    from gmtool.memory import estimate

    d = copy_of(saved, tmp_path, "config.json", "model.safetensors")
    lm = load_model(str(d / "config.json"), CPU, torch.float32)
    assert lm.source == "config" and any("random weights (give its folder" in n for n in lm.notes), lm.notes
    cfg = json.loads((d / "config.json").read_text())
    (tmp_path / "q.json").write_text(json.dumps(cfg | {"quantization_config": {"quant_method": "gptq"}}))
    with pytest.raises(GmtoolError, match="is a quantized checkpoint"):
        load_model(str(tmp_path / "q.json"), CPU, torch.float32)
    (d / "config.json").write_text(json.dumps(cfg | {"auto_map": {"AutoConfig": "configuration_x.XConfig"}}))

    def asked(*a, **k):
        raise AssertionError("AutoConfig.from_pretrained reads auto_map (and may ask to run the folder's code)")

    monkeypatch.setattr(transformers.AutoConfig, "from_pretrained", asked)
    assert estimate._model_config(str(d)).model_type == cfg["model_type"]
    lm = load_model(str(d), CPU, torch.float32)
    assert any("auto_map" in n and "not run" in n for n in lm.notes), lm.notes


@pytest.mark.parametrize("spec", ["{tmp}/mycfg", "./tiny-qwen3", "../models/tiny-qwen3"])
def test_a_model_named_as_a_path_is_a_path_never_a_profile(spec, saved, tmp_path):
    """An absolute path without .json reached past the profiles folder (a traceback on a file of no profile's
    shape); ./name ran the built-in profile of that name where the user named a folder."""
    shutil.copy(saved[0] / "config.json", tmp_path / "mycfg.json")
    with pytest.raises(GmtoolError, match="no such checkpoint folder or config.json here"):
        load_model(spec.format(tmp=tmp_path), CPU, torch.float32)


def test_indexes_fp16_overflow_and_legacy_bin_files_are_read_as_transformers_reads_them(saved, tmp_path):
    """An index without "metadata" (transformers reads it first: a KeyError) and one naming a file with a NUL are
    one line each; a weight past float16's range says so, not "the stored weight holds NaN"; a .bin in the
    legacy (non-zip) format, which transformers reads, loads."""
    d = copy_of(saved, tmp_path, "config.json")
    weights = load_file(saved[0] / "model.safetensors")
    save_file(weights, d / "m.safetensors")
    index = {"weight_map": {k: "m.safetensors" for k in weights}}
    (d / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(GmtoolError, match='has no "metadata" object, which transformers reads'):
        load_model(str(d), CPU, torch.float32)
    (d / "model.safetensors.index.json").write_text(json.dumps(index | {"metadata": {}}))
    got = load_model(str(d), CPU, torch.float32).model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in saved[1].items())
    (d / "model.safetensors.index.json").write_text(json.dumps({"weight_map": {"a": "x\0.safetensors"}}))
    with pytest.raises(GmtoolError, match="is not a weight index"):
        load_model(str(d), CPU, torch.float32)

    big = copy_of(saved, tmp_path / "big", "config.json")
    save_file(weights | {"model.norm.weight": weights["model.norm.weight"] * 0 + 1e6}, big / "model.safetensors")
    with pytest.raises(GmtoolError, match="is not finite in float16 .*try --dtype bf16 or fp32"):
        load_model(str(big), CPU, torch.float16)

    legacy = copy_of(saved, tmp_path / "legacy", "config.json")
    torch.save(dict(weights), legacy / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    got = load_model(str(legacy), CPU, torch.float32).model.state_dict()
    assert all(torch.equal(got[k], v) for k, v in saved[1].items())


def test_a_hugging_face_cache_snapshot_loads_and_is_named_by_its_repository(saved, tmp_path, monkeypatch):
    """A cache snapshot links every file, shards and index too, into ../../blobs: the index's shards were refused
    as 'outside' the folder (links followed), and the model was named by its commit. `--model .` had no name, and
    a folder named like a built-in profile replaced it without a word."""
    from transformers import AutoModelForCausalLM

    sharded = tmp_path / "sharded"
    AutoModelForCausalLM.from_pretrained(saved[0]).save_pretrained(sharded, max_shard_size="100KB")
    repo = tmp_path / "hub" / "models--org--tiny"
    (repo / "blobs").mkdir(parents=True)
    snap = repo / "snapshots" / "abc123"
    snap.mkdir(parents=True)
    for i, f in enumerate(sorted(sharded.iterdir())):
        blob = repo / "blobs" / f"h{i}"
        shutil.copy(f, blob)
        (snap / f.name).symlink_to(f"../../blobs/h{i}")
    lm = load_model(str(snap), CPU, torch.float32)
    assert lm.name == "org/tiny" and lm.source == "checkpoint"
    assert all(torch.equal(lm.model.state_dict()[k], v) for k, v in saved[1].items())
    monkeypatch.chdir(saved[0])
    assert load_model(".", CPU, torch.float32).name == saved[0].name
    monkeypatch.chdir(tmp_path)
    shutil.copytree(saved[0], tmp_path / "tiny-llama")
    lm = load_model("tiny-llama", CPU, torch.float32)
    assert lm.source == "checkpoint" and any("not the built-in profile of that name" in n for n in lm.notes)


def test_an_unreadable_weight_file_or_folder_is_one_line_saying_permission_denied(saved, tmp_path, monkeypatch, capsys):
    """Permission bits do not bind root (CI may be root): the denial is made by patching what reads the files."""
    from pathlib import Path

    from gmtool.cli import main

    d = copy_of(saved, tmp_path, "config.json", "model.safetensors")
    real_open, real_is_file = Path.open, Path.is_file

    def deny_open(self, *a, **k):
        if self.name == "model.safetensors":  # safetensors would say "No such file or directory"
            raise PermissionError(13, "Permission denied", str(self))
        return real_open(self, *a, **k)

    monkeypatch.setattr(Path, "open", deny_open)
    with pytest.raises(GmtoolError, match=r"cannot read weight file .*model.safetensors: permission denied"):
        load_model(str(d), CPU, torch.float32)
    monkeypatch.setattr(Path, "open", real_open)

    def deny_is_file(self):  # a folder of mode 000: its config.json cannot even be looked at
        if self == d / "config.json":
            raise PermissionError(13, "Permission denied", str(self))
        return real_is_file(self)

    monkeypatch.setattr(Path, "is_file", deny_is_file)
    monkeypatch.setattr(sys, "argv", ["gmtool", "capture", "--model", str(d), *QUICK, "--out", str(tmp_path / "o")])
    with pytest.raises(SystemExit) as e:
        main.main()
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert e.value.code == 2 and len(lines) == 1, lines
    assert lines[0] == f"error: {d / 'config.json'}: permission denied"


@pytest.mark.parametrize("fmt", ["safetensors", "bin"])
def test_quantized_weights_are_refused_whatever_the_config_says(saved, tmp_path, fmt):
    """float8 or int8 weights beside a config without quantization_config (or with compressed-tensors'
    compression_config) would be cast to --dtype unscaled: another model, reported ok. Integer buffers pass."""
    d = copy_of(saved, tmp_path, "config.json")
    weights = load_file(saved[0] / "model.safetensors")

    def write(w):
        if fmt == "safetensors":
            save_file(w, d / "model.safetensors")
        else:
            torch.save(w, d / "pytorch_model.bin")

    write({**weights, "model.rotary_emb.position_ids": torch.arange(8)})  # an int buffer: not a weight, dropped
    load_model(str(d), CPU, torch.float32)
    name = "model.layers.0.mlp.up_proj.weight"
    for dtype, stored in ((torch.float8_e4m3fn, "F8_E4M3|float8_e4m3fn"), (torch.int8, "I8|int8")):
        write({**weights, name: weights[name].to(dtype)})
        with pytest.raises(GmtoolError, match=rf"{name} is stored as ({stored}), a quantized checkpoint's weight"):
            load_model(str(d), CPU, torch.float32)
    blocks = "model.layers.0.mlp.experts.down_proj_blocks"  # gpt-oss's MXFP4 experts, beside a plain config
    write({**weights, blocks: torch.zeros(4, 8, dtype=torch.uint8)})
    with pytest.raises(GmtoolError, match=rf"{blocks} is stored as (U8|uint8), a quantized checkpoint's weight"):
        load_model(str(d), CPU, torch.float32)
    write(weights)
    raw = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**raw, "compression_config": {"format": "float-quantized"}}))
    with pytest.raises(GmtoolError, match=r"quantized checkpoint \(its config's compression_config\)"):
        load_model(str(d), CPU, torch.float32)


def test_a_checkpoint_run_in_another_dtype_than_its_own_says_so(saved, tmp_path):
    d = copy_of(saved, tmp_path, "config.json", "model.safetensors")
    assert not any("is stored in" in n for n in load_model(str(d), CPU, torch.float32).notes)
    raw = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**raw, "dtype": "bfloat16"}))
    assert "ckpt is stored in bfloat16: run in float32 (--dtype)" in load_model(str(d), CPU, torch.float32).notes


def test_a_config_naming_a_class_other_than_its_model_types_says_which_runs(saved, tmp_path):
    d = copy_of(saved, tmp_path, "config.json")
    assert not any("the config names" in n for n in load_model(str(d), CPU, torch.float32).notes)
    raw = json.loads((d / "config.json").read_text())
    (d / "config.json").write_text(json.dumps({**raw, "architectures": ["MyFancyForCausalLM"]}))
    notes = load_model(str(d), CPU, torch.float32).notes
    assert "the config names MyFancyForCausalLM; its model_type's class Qwen3ForCausalLM is run" in notes, notes


def test_weights_not_yet_fetched_or_unpacked_and_a_cache_root_say_what_to_do(saved, tmp_path):
    import gzip

    d = copy_of(saved, tmp_path, "config.json")
    pointer = "version https://git-lfs.github.com/spec/v1\noid sha256:00\nsize 123\n"
    (d / "model.safetensors").write_text(pointer)
    with pytest.raises(GmtoolError, match=r"model.safetensors is a Git LFS pointer, not the weights: fetch them"):
        load_model(str(d), CPU, torch.float32)
    (d / "model.safetensors").write_bytes(gzip.compress((saved[0] / "model.safetensors").read_bytes()))
    with pytest.raises(GmtoolError, match=r"model.safetensors is gzip-compressed: decompress it"):
        load_model(str(d), CPU, torch.float32)
    root = tmp_path / "models--org--name"
    (root / "snapshots" / "abc").mkdir(parents=True)
    with pytest.raises(GmtoolError, match=r"is a Hugging Face cache folder: give one of its snapshots/<commit>"):
        load_model(str(root), CPU, torch.float32)


def test_a_bin_file_that_is_no_torch_file_is_refused_by_name(saved, tmp_path):
    """transformers' own error was "weights only load failed" with advice to load unsafely, "EOFError", or "pop
    from empty list" for a safetensors file under a .bin name."""
    d = copy_of(saved, tmp_path, "config.json")
    state = {k: v.contiguous() for k, v in load_model(str(saved[0]), CPU, torch.float32).model.state_dict().items()}
    torch.save(state, d / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    load_model(str(d), CPU, torch.float32)  # a legacy (non-zip) torch file still loads
    torch.save(state, d / "pytorch_model.bin", _use_new_zipfile_serialization=False, pickle_protocol=4)
    with pytest.raises(GmtoolError, match=r"pytorch_model.bin is a legacy torch pickle of protocol 4, which the"):
        load_model(str(d), CPU, torch.float32)  # torch's weights-only loader cannot read it (transformers' error)
    for content, says in [
        (b"<html>404 Not Found</html>", "neither a torch archive nor a legacy torch pickle"),
        (b"", "it is empty"),
        ((saved[0] / "model.safetensors").read_bytes(), "is a safetensors file, not the torch archive its name says"),
    ]:
        (d / "pytorch_model.bin").write_bytes(content)
        with pytest.raises(GmtoolError, match=rf"pytorch_model.bin(:)? .*{re.escape(says)}"):
            load_model(str(d), CPU, torch.float32)


def test_a_generation_config_that_is_no_json_object_is_named_not_the_weights(saved, tmp_path):
    d = copy_of(saved, tmp_path, "config.json", "model.safetensors")
    (d / "generation_config.json").write_text("{not json")  # transformers ignores it: so does gmtool
    load_model(str(d), CPU, torch.float32)
    (d / "generation_config.json").write_text("[1, 2]")  # transformers failed: "cannot load the weights"
    with pytest.raises(GmtoolError, match=r"generation_config.json holds an array, not a JSON object: fix or remove"):
        load_model(str(d), CPU, torch.float32)


def test_an_unknown_model_type_with_code_of_its_own_says_that_code_is_never_run():
    from gmtool.model.loading import _config_from_dict

    with pytest.raises(GmtoolError, match=r"does not know model_type 'internlm2'$"):
        _config_from_dict({"model_type": "internlm2"})
    with pytest.raises(GmtoolError, match=r"'internlm2' \(its auto_map names code of its own, which gmtool never"):
        _config_from_dict({"model_type": "internlm2", "auto_map": {"AutoConfig": "configuration_internlm2.X"}})
