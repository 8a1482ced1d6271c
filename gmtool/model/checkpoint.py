"""A local checkpoint's weights, loaded as transformers loads them.

transformers' own from_pretrained reads the folder (on the CPU: placing weights on a device would need
accelerate), then the model moves to the device. Its loading is the meaning of a checkpoint: which file wins
(model.safetensors over an index, safetensors over .bin), the key layouts it converts (Mixtral's and Qwen3-MoE's
per-expert weights into fused ones, a multimodal model's language_model prefix) and the tie it keeps or drops
(an lm_head.weight stored beside a tied embedding, and different from it, unties them). gmtool reads the folder
first, for what transformers would not say in one line: no weights at all, shards without their index, an index
naming an absent file, a weight file that cannot be read; and after the load it refuses weights the model lacks,
shapes the config does not give, and values that are not finite."""

from __future__ import annotations

import contextlib
import json
import os
import pickle
import zipfile
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from gmtool.errors import GmtoolError, first_line

SINGLE_FILES = ("model.safetensors", "pytorch_model.bin")
INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# transformers' order for a local folder: the first present decides what is read
PRECEDENCE = ("model.safetensors", "model.safetensors.index.json", "pytorch_model.bin", "pytorch_model.bin.index.json")
# what a damaged or foreign weight file raises while it is opened or read
READ_ERRORS = (SafetensorError, OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError)


def weight_files(ckpt: Path) -> list[Path]:
    """The weight files transformers would read from ckpt (the shards its index names, in order); [] when it
    holds none."""
    _refuse_broken_links(ckpt)
    name = next((n for n in PRECEDENCE if (ckpt / n).is_file()), None)
    if name in SINGLE_FILES:
        return [ckpt / name]
    if name in INDEX_FILES:
        return _shards(ckpt / name)
    # shards without their index (or weights under another name) would leave the run on random weights, told
    # only in results.json's notes: refused, as a checkpoint whose weights were asked for and not read
    # (a .bin is weights when named as transformers names them: training_args.bin and the like are not)
    stray = sorted(
        p.name
        for p in ckpt.iterdir()
        if p.is_file() and (p.suffix == ".safetensors" or p.suffix == ".bin" and p.name.startswith("pytorch_model"))
    )
    if stray:
        more = f" and {len(stray) - 1} more" if len(stray) > 1 else ""
        adapter = (ckpt / "adapter_config.json").is_file()
        raise GmtoolError(
            f"{ckpt} is a PEFT adapter ({stray[0]}{more}): merge it into its base model and give that folder"
            if adapter
            else f"{ckpt} holds {stray[0]}{more} but no {' or '.join(SINGLE_FILES)} or index of shards: add the "
            "index, or move them away to run on random weights"
        )
    return []


def _refuse_broken_links(ckpt: Path) -> None:
    """A weight file that is a link to nothing (a copied Hugging Face cache snapshot without its blobs) would
    otherwise count as no file, and the run would go on random weights."""
    for name in PRECEDENCE:
        p = ckpt / name
        if p.is_symlink() and not p.exists():
            raise GmtoolError(f"{p} is a link to {p.readlink()}, which does not exist")


def _shards(index: Path) -> list[Path]:
    ckpt = index.parent
    try:
        doc = json.loads(index.read_text())
    except OSError as e:
        raise GmtoolError(f"cannot read weight index {index}: {(e.strerror or str(e)).lower()}") from None
    except ValueError:
        doc = None
    try:
        shards = sorted(set(doc["weight_map"].values()))
        if not all(isinstance(s, str) and s and "\0" not in s for s in shards):
            raise TypeError
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        raise GmtoolError(
            f"{index} is not a weight index (a JSON object with a weight_map of names to file names)"
        ) from None
    if not shards:
        raise GmtoolError(f"{index} names no weight file (its weight_map is empty)")
    # by the names, not where links lead: a Hugging Face cache snapshot links every file into ../../blobs
    outside = next((s for s in shards if Path(s).is_absolute() or os.path.normpath(s).startswith("..")), None)
    if outside is not None:
        raise GmtoolError(f"{index} names {outside}, outside {ckpt}")
    absent = next((s for s in shards if not (ckpt / s).is_file()), None)
    if absent is not None:
        raise GmtoolError(f"{index} names the weight file {absent}, which is not in {ckpt}")
    if not isinstance(doc.get("metadata"), dict):  # transformers reads it before the weight map
        raise GmtoolError(f'{index} has no "metadata" object, which transformers reads: add "metadata": {{}}')
    return [ckpt / s for s in shards]


# a weight file that is not yet the weights: what it is and what to do
WRAPPED = (
    (b"version https://git-lfs", "a Git LFS pointer, not the weights: fetch them (git lfs pull)"),
    (b"\x1f\x8b", "gzip-compressed: decompress it"),
)


LEGACY_MAGIC = b"\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19"  # torch.save's magic number as pickled first in its non-zip format


def _check_readable(file: Path) -> None:
    """Open file as transformers will (a safetensors header and its size; a .bin archive's pickle, memory-mapped:
    no tensor read), so that a damaged one is refused by name. A legacy (non-zip) pickle cannot be mapped: opening
    it reads it whole, which transformers' load does once, and says so if it cannot."""
    try:
        with file.open("rb") as f:  # safetensors reports an unreadable file as "No such file or directory"
            head = f.read(64)
    except OSError as e:
        raise GmtoolError(f"cannot read weight file {file}: {(e.strerror or str(e)).lower()}") from None
    for magic, what in WRAPPED:  # what the safetensors or pickle reader would call "header too large"
        if head.startswith(magic):
            raise GmtoolError(f"{file} is {what}")
    if file.suffix != ".safetensors" and not zipfile.is_zipfile(file):
        if head[:1] == b"\x80" and head[2:14] == LEGACY_MAGIC:
            return
        if head[:1] == b"\x80" and head[2:3] == b"\x95" and head[11:23] == LEGACY_MAGIC:  # a framed pickle
            raise GmtoolError(
                f"{file} is a legacy torch pickle of protocol {head[1]}, which the weights-only loader transformers "
                "uses cannot read: save it again in torch.save's default format"
            )
        # else transformers' torch.load said "weights only load failed" (and to retry unsafely), "EOFError" or
        # "pop from empty list"
        if not head:
            raise GmtoolError(f"cannot read weight file {file}: it is empty")
        if len(head) > 8 and head[8:9] == b"{":
            raise GmtoolError(f"{file} is a safetensors file, not the torch archive its name says: rename it")
        raise GmtoolError(
            f"cannot read weight file {file}: neither a torch archive nor a legacy torch pickle (a download that "
            "failed, or an HTML page?)"
        )
    try:
        if file.suffix == ".safetensors":
            with safe_open(file, framework="pt", device="cpu") as f:
                dtypes = {k: f.get_slice(k).get_dtype() for k in f.keys()}
        else:
            stored = torch.load(file, map_location="cpu", weights_only=True, mmap=True)
            if not isinstance(stored, dict):
                raise ValueError(f"not a state dict of named tensors ({type(stored).__name__})")
            bad = next((k for k, t in stored.items() if not isinstance(t, torch.Tensor)), None)
            if bad is not None:
                raise ValueError(f"{bad!r} is not a tensor ({type(stored[bad]).__name__})")
            dtypes = {k: str(t.dtype).removeprefix("torch.") for k, t in stored.items()}
    except READ_ERRORS as e:
        raise GmtoolError(f"cannot read weight file {file}: {first_line(e)}") from None
    if quantized := next((k for k, d in sorted(dtypes.items()) if _quantized(k, d)), None):
        raise GmtoolError(
            f"{file}: {quantized} is stored as {dtypes[quantized]}, a quantized checkpoint's weight: gmtool builds "
            "models in --dtype, not quantized (give it a dequantized copy)"
        )


# integer tensors that are packed weights: int8, GPTQ/AWQ's int32 (qweight), compressed-tensors' packed int4,
# HQQ's W_q, gpt-oss's MXFP4 expert blocks (uint8, with their scales)
PACKED_NAMES = ("weight", "qweight", "weight_packed", "W_q")
PACKED_SUFFIXES = ("_blocks", "_scales")


def _quantized(name: str, dtype: str) -> bool:
    """A float8 or float4 tensor, or an integer weight: transformers would cast it to --dtype unscaled, a model
    of other weights. Integer buffers (position ids, masks) are not weights."""
    d, last = dtype.lower(), name.rsplit(".", 1)[-1]
    if d.startswith(("f8", "float8", "f4", "float4")):
        return True
    return d.startswith(("i", "u")) and (last in PACKED_NAMES or last.endswith(PACKED_SUFFIXES))


@contextlib.contextmanager
def _quiet_transformers():
    """transformers' loading report and progress bar: what gmtool says of the load is its own one line or note."""
    from transformers.utils import logging

    level, bars = logging.get_verbosity(), logging.is_progress_bar_enabled()
    logging.set_verbosity_error()
    logging.disable_progress_bar()
    try:
        yield
    finally:
        logging.set_verbosity(level)
        if bars:
            logging.enable_progress_bar()


def _check_generation_config(file: Path) -> None:
    """from_pretrained reads it with the weights: JSON that is not an object was reported as the weights'
    failure ("TypeError: 'list' object is not a mapping"). One that is no JSON at all it ignores, and so does
    gmtool."""
    try:
        value = json.loads(file.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        return
    if not isinstance(value, dict):
        what = {list: "an array", str: "a string", bool: "a boolean", type(None): "null"}.get(type(value), "a number")
        raise GmtoolError(f"{file} holds {what}, not a JSON object: fix or remove it")


def load_pretrained(ckpt: Path, files: list[Path], cfg, dtype: torch.dtype, device: torch.device, attn: str):
    """The model of cfg with ckpt's weights, as transformers' from_pretrained loads them, on device; and the run's
    notes (stored tensors the model has no place for)."""
    from transformers import AutoModelForCausalLM

    for file in files:
        _check_readable(file)
    _check_generation_config(ckpt / "generation_config.json")
    try:
        with _quiet_transformers():
            model, info = AutoModelForCausalLM.from_pretrained(
                ckpt,
                config=cfg,
                dtype=dtype,
                attn_implementation=attn,
                local_files_only=True,
                trust_remote_code=False,
                ignore_mismatched_sizes=True,  # refused below, with the shapes
                output_loading_info=True,
            )
    except torch.OutOfMemoryError:
        raise  # the machine's limit, not the folder's fault: the caller reports it as such
    except Exception as e:  # noqa: BLE001 (transformers' loader: whatever it raises is said in one line)
        raise GmtoolError(f"transformers cannot load the weights of {ckpt}: {first_line(e, typed=True)}") from None
    if info.get("mismatched_keys"):
        key, stored, wanted = sorted(info["mismatched_keys"], key=lambda m: m[0])[0]
        raise GmtoolError(
            f"{ckpt}: {key} has shape {tuple(stored)}, but the config gives {tuple(wanted)}"
            + (f" (and {len(info['mismatched_keys']) - 1} more)" if len(info["mismatched_keys"]) > 1 else "")
        )
    missing = sorted(info.get("missing_keys") or ())
    if missing:
        raise GmtoolError(f"{ckpt}: {len(missing)} weights of the model are in no weight file (first: {missing[0]})")
    if info.get("error_msgs"):
        raise GmtoolError(f"{ckpt}: {info['error_msgs'][0]}")
    model = model.to(device)
    bad = next((n for n, p in model.named_parameters() if p.is_floating_point() and not p.isfinite().all()), None)
    if bad is not None:
        if dtype == torch.float16:  # a finite bf16 or fp32 weight past 65504 is inf once converted
            raise GmtoolError(
                f"{ckpt}: the weight {bad} is not finite in float16 (NaN stored, or values past float16's range): "
                "try --dtype bf16 or fp32"
            )
        raise GmtoolError(f"{ckpt}: the stored weight {bad} holds NaN or infinite values")
    unused = sorted(info.get("unexpected_keys") or ())
    if unused:
        return model, [
            f"{len(unused)} stored tensors have no place in the model and were left out (first: {unused[0]})"
        ]
    return model, []
