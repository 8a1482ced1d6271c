"""Build the Hugging Face causal LM that gmtool runs: a built-in profile with random weights, a local
checkpoint directory, or a config.json. Never a network access."""

from __future__ import annotations

import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from gmtool.switches import switched_off
from gmtool.model import attention, checkpoint, families, probe
from gmtool.errors import GmtoolError
from gmtool.profiles import load_model_profile, model_profiles

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")

DTYPES = {
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
    "fp16": torch.float16,
    "float16": torch.float16,
    "fp32": torch.float32,
    "float32": torch.float32,
}


def parse_dtype(name: str) -> torch.dtype:
    try:
        return DTYPES[name.lower()]
    except KeyError:
        raise GmtoolError(f"unknown dtype {name!r}: choose from bf16, fp16, fp32") from None


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if re.fullmatch(r"cuda(:\d+)?", name):
        if not torch.cuda.is_available():
            raise GmtoolError("--device cuda was asked for, but no CUDA device is available here")
        index, count = int(name.partition(":")[2] or 0), torch.cuda.device_count()
        if index >= count:  # torch.device accepts any index: the failure would come later, as a traceback
            raise GmtoolError(f"--device {name}: this machine has CUDA devices 0..{count - 1}")
        return torch.device(name)
    if name == "cpu":
        return torch.device("cpu")
    raise GmtoolError(f"unknown device {name!r}: use auto, cuda, cuda:N or cpu")


@dataclass
class LoadedModel:
    name: str
    model: torch.nn.Module
    config: object
    source: str  # profile | checkpoint | config
    fused: object = None  # gmtool.model.fused.FusedLayers when --fuse
    notes: list[str] = field(default_factory=list)  # what the run's notes say about how the model was loaded
    layout: probe.KVLayout | None = None  # read from the model's attention calls (gmtool.model.probe)
    tp: int = 1  # tensor-parallel ranks the projections are split over (gmtool.parallel.shard)
    whole_params: int | None = None  # the unsharded model's count, taken before a --tp split
    gemm_warmup: object = None  # gmtool.model.gemm_warmup.GemmWarmup: cuBLAS warming up while the build ends
    early_compile: object = None  # gmtool.kernels.early_compile.EarlyCompile: attention kernels compiled early

    @property
    def num_layers(self) -> int:
        return families.text_config(self.config).num_hidden_layers

    @property
    def num_heads(self) -> int:
        return self.layout.num_heads

    @property
    def num_kv_heads(self) -> int:
        return self.layout.num_kv_heads

    @property
    def rank_heads(self) -> int:
        """The attention heads this rank computes: all of them, or 1/tp under --tp."""
        return self.num_heads // self.tp

    @property
    def rank_kv_heads(self) -> int:
        return self.num_kv_heads // self.tp

    @property
    def head_dim(self) -> int:
        """K's head dim (V's is layout.v_head_dim)."""
        return self.layout.k_head_dim

    @property
    def vocab_size(self) -> int:
        return families.text_config(self.config).vocab_size

    @property
    def num_params(self) -> int:
        """The whole model's parameters, whatever this rank holds: runs at any --tp describe the same model."""
        return self.whole_params or sum(p.numel() for p in self.model.parameters())

    def forward_logits(self, input_ids, positions, logits_indices) -> torch.Tensor:
        """Packed tokens [1, T], explicit positions, no HF cache: gmtool's attention owns the KV cache."""
        return self.logits_of(self.forward_hidden(input_ids, positions, logits_indices))

    def forward_hidden(self, input_ids, positions, logits_indices: "torch.Tensor | int") -> torch.Tensor:
        """The final hidden state of the rows that become logits (the LM head's input). logits_indices: those rows'
        indices, or a count n: the first n rows, a view (a decode step's, whose every token is its sequence's last
        in order: no gather kernel in its graph)."""
        base = families.base_model(self.model)
        hidden = base(input_ids=input_ids[None], position_ids=positions[None], use_cache=False)[0][0]
        return hidden[:logits_indices] if isinstance(logits_indices, int) else hidden.index_select(0, logits_indices)

    def logits_of(self, hidden_rows: torch.Tensor) -> torch.Tensor:
        return families.postprocess_logits(self.config, self.model.get_output_embeddings()(hidden_rows))

    def logits_into(self, hidden_rows: torch.Tensor, out: torch.Tensor) -> None:
        """The LM head written straight into out (the persistent logits rows), its family's logit rule applied
        in place: under capture, no logits land in the graph's pool, whatever rows the key pads to. Any other
        head than a bias-free linear one of out's dtype and shape, as most are, is computed and copied in."""
        head = self.model.get_output_embeddings()
        w = getattr(head, "weight", None)
        if (
            type(head) is torch.nn.Linear
            and head.bias is None
            and w.dtype == out.dtype == hidden_rows.dtype
            and w.shape == (out.shape[-1], hidden_rows.shape[-1])
            and hidden_rows.shape[0] == out.shape[0]
        ):
            torch.matmul(hidden_rows, w.t(), out=out)  # out= with another shape would resize the persistent view
            families.postprocess_logits(self.config, out, in_place=True)
        else:
            out.copy_(self.logits_of(hidden_rows))

    @property
    def head_in_features(self) -> int:
        """The LM head's input width (OPT projects the final hidden state down to word_embed_proj_dim first)."""
        return self.model.get_output_embeddings().weight.shape[-1]


def _config_from_dict(d: dict, where: str = "the config"):
    from transformers import AutoConfig

    d = dict(d)
    model_type = d.pop("model_type", None)
    if not model_type:
        hint = (
            " (it looks like a gmtool model profile: name a built-in one without .json, or give a plain config.json)"
            if isinstance(d.get("config"), dict)
            else ""
        )
        raise GmtoolError(f"{where} has no model_type{hint}")
    if not isinstance(model_type, str):
        raise GmtoolError(f"{where}: model_type must be a string, got {model_type!r}")
    from transformers.models.auto.configuration_auto import CONFIG_MAPPING

    if model_type not in CONFIG_MAPPING:
        import transformers

        remote = " (its auto_map names code of its own, which gmtool never runs)" if d.get("auto_map") else ""
        raise GmtoolError(f"transformers {transformers.__version__} does not know model_type {model_type!r}{remote}")
    try:
        cfg = AutoConfig.for_model(model_type, **d)
    except Exception as e:  # the config's own checks (ValueError) and huggingface_hub's typed fields (its own error)
        said = " ".join(str(e).split())
        raise GmtoolError(
            f"the {model_type} config is invalid: {said[:200] + '...' if len(said) > 200 else said}"
        ) from None
    return _refuse_empty_sizes(cfg)


def _no_padding_warning(input_ids, attention_mask) -> None:
    return None


def _build(cfg, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    try:
        return AutoModelForCausalLM.from_config(cfg, dtype=dtype, attn_implementation=attention.ATTN_NAME)
    except KeyError as e:
        if e.args != (attention.ATTN_NAME,):
            raise _class_failed(cfg, e) from None
        raise GmtoolError(
            f"{families.architecture(cfg)}: its attention classes are picked by name (eager, sdpa, "
            "flash), not through transformers' AttentionInterface, so gmtool cannot route them to "
            "its paged KV cache"
        ) from None
    except ValueError as e:
        if "Unrecognized configuration class" in str(e):
            raise GmtoolError(
                f"{type(cfg).__name__} ({cfg.model_type}) is not a causal language model that "
                "transformers can build (AutoModelForCausalLM does not take it)"
            ) from None
        if "attn_implementation" not in str(e):  # the config's own sizes, not gmtool's attention
            raise _class_failed(cfg, e) from None
        raise GmtoolError(
            f"{families.architecture(cfg)} cannot be built with gmtool's attention: "
            f"{(str(e).strip().splitlines() or [''])[0]}"
        ) from None
    except ImportError as e:  # a part of the model (a vision tower) needs an optional package
        raise GmtoolError(
            f"{families.architecture(cfg)}: transformers needs a package that is not installed to build it: "
            f"{str(e).strip().split('. ')[0]}"
        ) from None
    except Exception as e:  # noqa: BLE001 (a foreign model's constructor: any failure is said in one line)
        raise _class_failed(cfg, e) from None


def _class_failed(cfg, e: Exception) -> GmtoolError:
    """transformers' model class failed inside its own constructor (some fail so on their config class's own
    defaults): said as that, with transformers' words, since no feature of gmtool's is involved."""
    return GmtoolError(
        f"{families.architecture(cfg)}: transformers' model class fails to build from this config, before gmtool "
        f"runs anything: {type(e).__name__}: {(str(e).strip().splitlines() or [''])[0]}"
    )


WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt")

POSITIVE_SIZES = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads")


def _refuse_empty_sizes(cfg):
    """A size of 0 or less, refused by name: transformers would build an empty model (torch warning of
    zero-element tensors even on the meta device the memory estimate builds on) or fail deep inside."""
    text = families.text_config(cfg)
    for name in POSITIVE_SIZES:
        value = getattr(text, name, None)
        if isinstance(value, int) and value <= 0:
            raise GmtoolError(f"the config's {name} must be positive, got {value}")
    return cfg


def _check_supported(cfg) -> None:
    """Refusals before any weights exist: the family table, then the attention classes of the model built on
    the meta device (no memory, no initialisation)."""
    why = families.load_refusal(cfg)
    if why:
        raise GmtoolError(why)
    with torch.device("meta"):
        skeleton = _build(cfg, torch.float32)
    why = probe.attention_refusal(families.architecture(cfg), skeleton)
    if why:
        raise GmtoolError(why)


def _read_config_json(path: Path) -> dict:
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:  # ValueError: not JSON, or not UTF-8
        raise GmtoolError(f"cannot read config file {path}: {str(e).splitlines()[0]}") from None
    if not isinstance(raw, dict):
        raise GmtoolError(f"config file {path} is not a JSON object")
    return raw


def read_config(spec: str) -> tuple[dict, str]:
    """--model's config as its JSON holds it (no transformers), and where it came from: "folder" (a checkpoint's
    config.json), "config" (a config file by any name) or "profile" (a built-in one). What is none of these is
    refused in one line."""
    path = Path(spec)
    if path.is_dir():
        if not (path / "config.json").is_file():
            if (path / "adapter_config.json").is_file():
                raise GmtoolError(f"{spec} is a PEFT adapter: merge it into its base model and give that folder")
            if (path / "snapshots").is_dir():
                raise GmtoolError(f"{spec} is a Hugging Face cache folder: give one of its snapshots/<commit> folders")
            raise GmtoolError(f"{spec} is a directory without config.json: not a Hugging Face checkpoint")
        return _read_config_json(path / "config.json"), "folder"
    if path.suffix in WEIGHT_SUFFIXES and path.is_file():
        raise GmtoolError(f"{spec} is a weight file: give the checkpoint folder that holds it and its config.json")
    if path.suffix == ".json" or path.is_file():
        if not path.is_file():
            raise GmtoolError(f"config file {spec} does not exist")
        return _read_config_json(path), "config"
    return load_model_profile(spec)["config"], "profile"


def _display_name(path: Path, spec: str) -> str:
    """What tables and results call the model: a profile's name, a folder's or file's own name (`.`'s too), and
    for a Hugging Face cache snapshot (models--org--name/snapshots/<commit>) the repository, not the commit."""
    if not path.exists():
        return spec
    whole = Path(os.path.normpath(path.absolute()))  # not resolved: a snapshot's files link into ../../blobs
    folder = whole if path.is_dir() else whole.parent
    if folder.parent.name == "snapshots" and folder.parent.parent.name.startswith("models--"):
        return folder.parent.parent.name.removeprefix("models--").replace("--", "/")
    return whole.name


def load_model(
    spec: str,
    device: torch.device,
    dtype: torch.dtype,
    seed: int = 0,
    gemm_rows: tuple[int, ...] = (),
    head_rows: tuple[int, ...] = (),
) -> LoadedModel:
    """A profile or a config file builds the model from its config on the device (random weights); a checkpoint
    folder is loaded as transformers loads it (gmtool.model.checkpoint). gemm_rows, head_rows: the row counts the
    captures' GEMMs and LM head will run, warmed up in a thread from here on (gmtool.model.gemm_warmup; on CUDA
    only): the caller joins lm.gemm_warmup before it sizes memory by what is free."""
    if not spec.strip():  # Path("") is the current directory
        raise GmtoolError("--model is empty: name a built-in profile, a checkpoint folder or a config.json")
    attention.register()
    if device.type == "cuda":
        from gmtool.kernels.triton_prep import prepare_triton_in_background

        prepare_triton_in_background()  # overlaps the model's build: Triton's first kernel needs it
    path = Path(spec)
    torch.manual_seed(seed)
    raw, source = read_config(spec)
    weights, notes = [], []
    if source == "folder":
        if spec in model_profiles():  # a bare name: the folder here wins, and says so
            notes.append(f"{spec}: the folder {path.absolute()} is read, not the built-in profile of that name")
        weights = checkpoint.weight_files(path)
        source = "checkpoint" if weights else "config"
        if not weights:
            notes.append(
                f"{path.name} holds a config and no weights ({', '.join(checkpoint.SINGLE_FILES)}): "
                "random weights, as for a built-in profile"
            )
    elif source == "config" and any((path.parent / n).exists() for n in checkpoint.PRECEDENCE):
        notes.append(
            f"{spec} is read as a config alone: random weights (give its folder, {path.parent}, for the weights "
            "beside it)"
        )
    if quant := next((k for k in ("quantization_config", "compression_config") if raw.get(k)), None):
        raise GmtoolError(
            f"{spec} is a quantized checkpoint (its config's {quant}): gmtool builds models in --dtype, not quantized"
        )
    if raw.get("auto_map"):
        notes.append(
            f"{spec}'s config names code of its own (auto_map): not run; transformers' own {raw.get('model_type')} "
            "classes are"
        )
    cfg = _config_from_dict(raw, f"the config of {spec}")
    _check_supported(cfg)
    if "longrope" in families.rope_types(cfg):
        notes.append(families.LONGROPE_NOTE)
    if weights:
        model, loaded = checkpoint.load_pretrained(path, weights, cfg, dtype, device, attention.ATTN_NAME)
        notes += loaded
        stored = str(raw.get("dtype") or raw.get("torch_dtype") or "")
        if DTYPES.get(stored.removeprefix("torch."), dtype) != dtype:  # engines run a checkpoint in its own
            notes.append(f"{path.name} is stored in {stored}: run in {str(dtype).removeprefix('torch.')} (--dtype)")
    else:
        with torch.device(device):
            model = _build(cfg, dtype)
    named = (raw.get("architectures") or [None])[0]
    if isinstance(named, str) and named != type(model).__name__:  # transformers builds by model_type, as here
        notes.append(f"the config names {named}; its model_type's class {type(model).__name__} is run")
    warmup = None
    if device.type == "cuda" and (gemm_rows or head_rows) and not switched_off("GMTOOL_GEMM_WARMUP"):
        from gmtool.model import gemm_warmup

        warmup = gemm_warmup.start(model, list(gemm_rows), list(head_rows))
    try:
        model.eval().requires_grad_(False)
        for m in model.modules():
            if hasattr(m, "warn_if_padding_and_no_attention_mask"):
                # a warning's check (pad token id among the input ids: a host sync) that would stop capture; gmtool's
                # packed batches have no padding for it to warn of
                m.warn_if_padding_and_no_attention_mask = _no_padding_warning
        lm = LoadedModel(_display_name(path, spec), model, cfg, source, notes=notes, gemm_warmup=warmup)
        lm.layout = probe.probe_layout(lm, families.architecture(cfg))
        if feats := lm.layout.features():
            lm.notes.append(f"attention: {'; '.join(feats)}")
    except BaseException:  # no model comes back: its warm-up ends first, not during the caller's next capture
        if warmup is not None:
            warmup.join()
        raise
    return lm
