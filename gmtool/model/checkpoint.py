"""A local checkpoint's weights, copied into the model gmtool built from its config on the device.

transformers' from_pretrained needs accelerate to place weights on a device; gmtool builds the model where it
runs (as for a profile) and copies each stored tensor into it, one at a time, so the device never holds a
second copy of the weights. Safetensors files (one, or shards named by model.safetensors.index.json) and
PyTorch .bin files are read."""

from __future__ import annotations

import json
import pickle
from collections.abc import Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open

from gmtool.errors import GmtoolError

SINGLE_FILES = ("model.safetensors", "pytorch_model.bin")
INDEX_FILES = ("model.safetensors.index.json", "pytorch_model.bin.index.json")
# what a damaged or foreign weight file raises while it is opened or read
READ_ERRORS = (SafetensorError, OSError, RuntimeError, ValueError, EOFError, pickle.UnpicklingError)


def weight_files(ckpt: Path) -> list[Path]:
    """The checkpoint's weight files (the shards its index names, in order); [] when it holds none."""
    for name in INDEX_FILES:
        index = ckpt / name
        if not index.is_file():
            continue
        try:
            weight_map = json.loads(index.read_text())["weight_map"]
            shards = sorted(set(weight_map.values()))
            if not all(isinstance(s, str) and s for s in shards):
                raise TypeError
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            raise GmtoolError(
                f"{index} is not a weight index (a JSON object with a weight_map of names to file names)"
            ) from None
        absent = next((s for s in shards if not (ckpt / s).is_file()), None)
        if absent is not None:
            raise GmtoolError(f"{index} names the weight file {absent}, which is not in {ckpt}")
        return [ckpt / s for s in shards]
    found = [ckpt / name for name in SINGLE_FILES if (ckpt / name).is_file()][:1]
    # shards without their index (or weights under another name) would leave the run on random weights, told
    # only in results.json's notes: refused, as a checkpoint whose weights were asked for and not read
    # (a .bin is weights when named as transformers names them: training_args.bin and the like are not)
    stray = sorted(
        p.name
        for p in ckpt.iterdir()
        if p.is_file() and (p.suffix == ".safetensors" or p.suffix == ".bin" and p.name.startswith("pytorch_model"))
    )
    if not found and stray:
        more = f" and {len(stray) - 1} more" if len(stray) > 1 else ""
        raise GmtoolError(
            f"{ckpt} holds {stray[0]}{more} but no {' or '.join(SINGLE_FILES)} or index of shards: add the "
            "index, or move them away to run on random weights"
        )
    return found


def _tensors(file: Path, device: torch.device) -> Iterator[tuple[str, torch.Tensor]]:
    if file.suffix == ".safetensors":
        with safe_open(file, framework="pt", device=str(device)) as f:
            for key in f.keys():
                yield key, f.get_tensor(key)
    else:
        stored = torch.load(file, map_location=device, weights_only=True, mmap=True)
        if not isinstance(stored, dict):
            raise ValueError(f"not a state dict of named tensors ({type(stored).__name__})")
        for key, tensor in stored.items():
            if not isinstance(tensor, torch.Tensor):
                raise ValueError(f"{key!r} is not a tensor ({type(tensor).__name__})")
            yield key, tensor


def load_weights(model: torch.nn.Module, files: list[Path], device: torch.device) -> list[str]:
    """Copy every tensor of files into model (dtype converted). A weight the model has and the files lack, a
    shape that differs from the config's, or a file that cannot be read is refused; returns the run's notes
    (stored tensors the model has no place for)."""
    params = model.state_dict()
    prefix = f"{model.base_model_prefix}."  # checkpoints of the base model alone omit it
    loaded, unused = set(), []
    with torch.no_grad():
        for file in files:
            try:
                for key, tensor in _tensors(file, device):
                    name = key if key in params else prefix + key
                    if name not in params:
                        unused.append(key)
                        continue
                    if tensor.shape != params[name].shape:
                        raise GmtoolError(
                            f"{file}: {key} has shape {tuple(tensor.shape)}, but the config gives "
                            f"{tuple(params[name].shape)}"
                        )
                    params[name].copy_(tensor)
                    loaded.add(name)
            except torch.OutOfMemoryError:
                raise  # the device's limit, not the file's fault: the caller reports it as such
            except READ_ERRORS as e:
                msg = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
                raise GmtoolError(f"cannot read weight file {file}: {msg}") from None
    # tied weights (the output layer sharing the embedding) are stored once: a parameter is loaded when its
    # storage was written under any name
    written = {params[n].data_ptr() for n in loaded}
    missing = [n for n, p in model.named_parameters() if n not in loaded and p.data_ptr() not in written]
    if missing:
        raise GmtoolError(
            f"{files[0].parent}: {len(missing)} weights of the model are in no weight file (first: {missing[0]})"
        )
    if unused:
        return [f"{len(unused)} stored tensors have no place in the model and were left out (first: {unused[0]})"]
    return []
