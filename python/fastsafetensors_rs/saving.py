"""Saving: `save_file` (one file, byte for byte what safetensors writes) and `save` (a sharded
checkpoint directory, named and indexed as transformers' `save_pretrained` names it).

Both go through `torch.ops.fastsafetensors.save`: the Rust core lays the files out, writes
them with parallel direct writes from page-aligned buffers (CUDA tensors come off the device
through pinned staging buffers, never as a whole-model host copy), syncs them, and renames
them into place, so a save that fails or is killed never leaves a partial file under a final
name. See docs/save.md.
"""

from __future__ import annotations

import os
import re
from typing import Dict, List, Mapping, Optional, Union

import torch

from ._errors import mapped_errors
from ._ops import ops
from .api import _max_memory

PathLike = Union[str, "os.PathLike[str]"]

# transformers' `convert_file_size_to_int`: decimal units, and binary ones with an "i".
_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
          "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}


def shard_size(size: Union[int, str]) -> int:
    """Bytes of a `max_shard_size`: an int, or a string such as "5GB" (10^9) or "500MiB"."""
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise TypeError(f"max_shard_size: expected bytes (int) or a size such as '5GB', got {size!r}")
    if isinstance(size, int):
        bytes_ = size
    else:
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([KMGT]I?B|B|)\s*", size.upper())
        if match is None:
            raise ValueError(f"max_shard_size={size!r} is not a size: expected bytes or a size such as '5GB' or '500MiB'")
        bytes_ = int(float(match.group(1)) * _UNITS[match.group(2)])
    if bytes_ <= 0:
        raise ValueError(f"max_shard_size={size!r}: must be positive")
    return bytes_


def _check(tensors: Mapping[str, torch.Tensor], metadata: Optional[Mapping[str, str]]) -> None:
    """What safetensors refuses before writing, with its kind of exception."""
    if not isinstance(tensors, Mapping):
        raise ValueError(f"Expected a dict of [str, torch.Tensor] but received {type(tensors)}")
    for name, t in tensors.items():
        if not isinstance(name, str):
            raise ValueError(f"tensor names must be strings, got {name!r}")
        if not isinstance(t, torch.Tensor):
            raise ValueError(f"Key `{name}` is invalid, expected torch.Tensor but received {type(t)}")
        if t.layout != torch.strided:
            raise ValueError(f"tensor '{name}' cannot be saved: it is {t.layout}, and safetensors stores dense tensors: "
                             "save tensor.to_dense() (it may be much larger)")
        if t.device.type not in ("cpu", "cuda"):
            raise ValueError(f"tensor '{name}' cannot be saved: it is on {t.device}; move it to the CPU or a CUDA device")
    if metadata is not None:
        if not isinstance(metadata, Mapping):
            raise TypeError(f"metadata: expected a dict of str to str, got {type(metadata).__name__}")
        for key, value in metadata.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise TypeError(f"metadata: keys and values must be str, got {key!r}: {value!r}")


@mapped_errors
def _save(tensors: Mapping[str, torch.Tensor], target: str, max_shard_size: int,
          metadata: Optional[Mapping[str, str]], max_memory: Union[None, int, str]) -> List[str]:
    _check(tensors, metadata)
    keys = list(metadata) if metadata is not None else None
    values = [metadata[k] for k in keys] if keys is not None else None
    return ops.save(list(tensors), list(tensors.values()), target, max_shard_size, keys, values,
                    _max_memory(max_memory) or "")


def save_file(tensors: Dict[str, torch.Tensor], filename: PathLike, metadata: Optional[Dict[str, str]] = None,
              *, max_memory: Union[None, int, str] = None) -> None:
    """Saves `tensors` to one safetensors file, as `safetensors.torch.save_file` does.

    For CPU tensors the file is byte for byte safetensors' (same tensor order, header and
    padding), except that metadata of several keys is written with the keys sorted (safetensors
    writes them in an order that changes from run to run). Tensors may be on CUDA, and need not
    be contiguous (they are made contiguous on their own device). The file appears under its
    name only once it is complete and synced. `max_memory` caps the host memory the save holds
    (default: as for streams).
    """
    _save(tensors, os.fspath(filename), -1, metadata, max_memory)


def save(tensors: Dict[str, torch.Tensor], save_directory: PathLike, max_shard_size: Union[int, str] = "5GB",
         metadata: Optional[Dict[str, str]] = None, *, max_memory: Union[None, int, str] = None) -> List[str]:
    """Saves `tensors` as a checkpoint directory: `model.safetensors`, or shards
    `model-00001-of-0000N.safetensors` of at most `max_shard_size` bytes (as many as
    transformers' `save_pretrained` makes, balanced by bytes) and `model.safetensors.index.json`,
    written in parallel, the index last. Shards and index of an earlier save in the directory
    that the new checkpoint does not use are removed. Returns the paths written.
    """
    return _save(tensors, os.fspath(save_directory), shard_size(max_shard_size), metadata, max_memory)
