"""Saving: `save_file` (one file, byte for byte what safetensors writes) and `save` (a sharded
checkpoint directory, named and indexed as transformers' `save_pretrained` names it).

Both go through `torch.ops.fastsafetensors.save`: the Rust core lays the files out, writes
them with parallel direct writes from page-aligned buffers (CUDA tensors come off the device
through pinned staging buffers, never as a whole-model host copy), syncs them, and renames
them into place, so a save that fails or is killed never leaves a partial file under a final
name. See docs/save.md.
"""

from __future__ import annotations

import json
import os
import re
from typing import Any, Callable, Dict, List, Mapping, Optional, Union

import torch

from ._dtypes import DTYPES
from ._errors import SafetensorError, mapped_errors
from ._ops import ops
from .api import _max_memory

PathLike = Union[str, "os.PathLike[str]"]

# The torch dtypes safetensors stores (not torch's quantized, bits and sub-byte integer types,
# nor complex32 and complex128).
SAVABLE = frozenset(dtype for dtype, _ in DTYPES.values())

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
        if t.dtype not in SAVABLE:
            raise SafetensorError(f"tensor '{name}' cannot be saved: safetensors has no dtype for {t.dtype}")
    if metadata is not None:
        if not isinstance(metadata, Mapping):
            raise TypeError(f"metadata: expected a dict of str to str, got {type(metadata).__name__}")
        for key, value in metadata.items():
            if not isinstance(key, str) or not isinstance(value, str):
                raise TypeError(f"metadata: keys and values must be str, got {key!r}: {value!r}")


@mapped_errors
def _save(tensors: Mapping[str, torch.Tensor], target: str, max_shard_size: int,
          metadata: Optional[Mapping[str, str]], max_memory: Union[None, int, str],
          process_group: Any = None) -> List[str]:
    if process_group is not None and _group_size(process_group) > 1:
        return group_save(tensors, target, max_shard_size, metadata, max_memory, process_group)
    _check(tensors, metadata)
    keys = list(metadata) if metadata is not None else None
    values = [metadata[k] for k in keys] if keys is not None else None
    return ops.save(list(tensors), list(tensors.values()), target, max_shard_size, keys, values,
                    _max_memory(max_memory) or "")


def save_file(tensors: Dict[str, torch.Tensor], filename: PathLike, metadata: Optional[Dict[str, str]] = None,
              *, max_memory: Union[None, int, str] = None, process_group: Any = None) -> None:
    """Saves `tensors` to one safetensors file, as `safetensors.torch.save_file` does.

    For CPU tensors the file is byte for byte safetensors' (same tensor order, header and
    padding), except that metadata of several keys is written with the keys sorted (safetensors
    writes them in an order that changes from run to run). Tensors may be on CUDA, and need not
    be contiguous (they are made contiguous on their own device). The file appears under its
    name only once it is complete and synced. `max_memory` caps the host memory the save holds
    (default: as for streams).

    `process_group`: a torch.distributed group whose ranks all make this call with the same
    tensors (replicated): each rank writes its share of the file's bytes, and the file appears
    once every rank's bytes are durable (see `save`).
    """
    _save(tensors, os.fspath(filename), -1, metadata, max_memory, process_group)


def save(tensors: Dict[str, torch.Tensor], save_directory: PathLike, max_shard_size: Union[int, str] = "5GB",
         metadata: Optional[Dict[str, str]] = None, *, max_memory: Union[None, int, str] = None,
         process_group: Any = None) -> List[str]:
    """Saves `tensors` as a checkpoint directory: `model.safetensors`, or shards
    `model-00001-of-0000N.safetensors` of at most `max_shard_size` bytes (as many as
    transformers' `save_pretrained` makes, balanced by bytes) and `model.safetensors.index.json`,
    written in parallel. The directory is replaced as a whole: whenever the save is killed or
    fails, it holds the earlier checkpoint or the new one, never a mix; its other files stay.
    Shards and index of an earlier save that the new checkpoint does not use are gone. Returns
    the paths written.

    `process_group`: a torch.distributed group whose ranks all make this call. Tensors of the
    same name on several ranks are one tensor, replicated (same dtype and shape; their bytes
    are taken to be the same): the ranks holding it share its writing, each byte written once.
    Tensors only one rank holds (pipeline stages, experts) are written by it. One index lists
    them all; shards never mix tensors held by different ranks. The directory is committed
    once, by rank 0, after every rank's bytes are durable; a rank failing (or leaving the
    group) fails every rank, and the directory keeps its earlier checkpoint. Every rank
    returns the same paths.
    """
    return _save(tensors, os.fspath(save_directory), shard_size(max_shard_size), metadata, max_memory,
                 process_group)


# ---------------------------------------------------------------- saves of a process group


def _group_size(process_group: Any) -> int:
    from .distributed import group_size

    return group_size(process_group)


def _described(tensors: Mapping[str, torch.Tensor]) -> List[dict]:
    return [{"name": name, "dtype": str(t.dtype)[len("torch."):], "shape": list(t.shape)}
            for name, t in tensors.items()]


class _RankFailed(SafetensorError):
    """Another rank of a group save failed: this one fails with its message."""


def _first_line(e: BaseException) -> str:
    return str(e).strip().splitlines()[0] if str(e).strip() else repr(e)


def _agree(process_group: Any, mine: Any, target: str) -> List[Any]:
    """Every rank's `mine`, gathered (before the commit); a rank that left the group fails this
    one clearly."""
    import torch.distributed as dist

    out: List[Any] = [None] * dist.get_world_size(process_group)
    try:
        dist.all_gather_object(out, mine, group=process_group)
    except RuntimeError as e:
        raise _RankFailed(f"{target}: the group save failed and nothing was committed: a rank left the group "
                          f"({_first_line(e)})") from e
    return out


def _step(process_group: Any, world: int, where: str, run: Callable[[], Any]) -> List[Any]:
    """One step of a group save: `run()` on this rank, then every rank's result gathered. This
    rank's failure is raised here, and the first failing rank's on the others: every rank
    fails alike, and the group stays in step."""
    error: Optional[BaseException] = None
    try:
        mine: Any = {"ok": run()}
    except Exception as e:  # any failure must reach the other ranks, or they would wait for this one
        mine, error = {"error": str(e)}, e
    statuses = _agree(process_group, mine, where) if world > 1 else [mine]
    if error is not None:
        raise error
    for rank, status in enumerate(statuses):
        if "error" in status:
            raise _RankFailed(f"rank {rank} of the group: {status['error']}")
    return [status["ok"] for status in statuses]


def group_save(tensors: Mapping[str, torch.Tensor], target: str, max_shard_size: int,
               metadata: Optional[Mapping[str, str]], max_memory: Union[None, int, str], process_group: Any,
               files: Optional[List[dict]] = None, failed: Optional[BaseException] = None) -> List[str]:
    """The steps of a save by every rank of `process_group` (or by this process alone, with
    None): the plan from every rank's tensor list, rank 0 creating the files, every rank
    writing its share and syncing it, then rank 0 committing once all are durable. A failure
    on any rank is raised on every rank, its rank named, and nothing is committed (`failed`:
    what this rank failed on before, raised at the first step)."""
    import torch.distributed as dist

    rank = dist.get_rank(process_group) if process_group is not None else 0
    world = dist.get_world_size(process_group) if process_group is not None else 1
    budget = _max_memory(max_memory) or ""
    where = os.path.dirname(files[0]["path"]) if files else target
    request = {"target": target, "max_shard_size": max_shard_size, "files": files,
               "metadata": dict(metadata) if metadata is not None else None}

    def described() -> dict:
        if failed is not None:
            raise failed
        _check(tensors, metadata)
        return {"tensors": _described(tensors), **request}

    statuses = _step(process_group, world, where, described)
    for r, status in enumerate(statuses):
        for key in request:
            if status[key] != request[key]:
                raise ValueError(f"a group save takes the same {key} on every rank: rank {r} gave {status[key]!r}, "
                                 f"rank {rank} {request[key]!r}")
    spec = {"rank": rank, "world": world, "ranks": [s["tensors"] for s in statuses], **request}
    handle: List[int] = []

    def begin() -> List[str]:
        out = ops.save_begin(json.dumps(spec))
        handle.append(int(out[0]))
        return list(out[2:])

    try:
        locations = _step(process_group, world, where, begin)[0]
        _step(process_group, world, where, lambda: ops.save_write(
            handle[0], [] if rank == 0 else locations, list(tensors), list(tensors.values()), budget))
        outcome: Any = None
        error: Optional[BaseException] = None
        if rank == 0:
            try:
                outcome = {"paths": ops.save_commit(handle.pop())}
            except RuntimeError as e:
                outcome, error = {"error": str(e)}, e
        if world > 1:
            box = [outcome]
            try:
                dist.broadcast_object_list(box, src=dist.get_global_rank(process_group, 0), group=process_group)
            except RuntimeError as e:
                raise _RankFailed(f"{where}: the group save failed: rank 0 left the group before saying whether it "
                                  f"committed (the target holds the earlier contents or the new ones) "
                                  f"({_first_line(e)})") from e
            outcome = box[0]
        if error is not None:
            raise error
        if "error" in outcome:
            raise _RankFailed(f"rank 0 of the group: {outcome['error']}")
        return outcome["paths"]
    finally:
        if handle:
            ops.save_end(handle[0])
