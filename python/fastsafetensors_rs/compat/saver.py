"""IBM fastsafetensors 0.5's `saver`: `save_sharded`, `ParallelSaver`, `plain_entry`,
`shard_paths` and `WriteEntry`, writing through `fastsafetensors_rs`'s saver.

The shards are IBM's: the same files (`{base}-0000i-of-0000N.safetensors`), the same tensors in
each (largest first into the emptiest shard), the same shard-set metadata
(`fst.shard.index`, `fst.shard.count`, `fst.shard.set`), so IBM's loader takes them as its
own. What differs: the tensors in a file are in safetensors' order, each file is written with
direct parallel writes and is always synced and renamed into place when complete (`fsync=`
is accepted; a save is always durable), and a custom `fill` (an encoder writing into mapped
files) is not taken: tensors are written as they are.
"""

from __future__ import annotations

import os
import shutil
import uuid
from dataclasses import dataclass
from typing import Any, Callable, List, Mapping, Optional, Sequence

import torch

from .._errors import mapped_errors
from ..saving import SAVABLE, _group_size, group_save
from .tensor import TensorBase
from .types import DType

__all__ = ["KEY_SHARD_COUNT", "KEY_SHARD_INDEX", "KEY_SHARD_SET", "ParallelSaver", "WriteEntry", "plain_entry",
           "save_sharded", "shard_paths"]

KEY_SHARD_INDEX = "fst.shard.index"
KEY_SHARD_COUNT = "fst.shard.count"
KEY_SHARD_SET = "fst.shard.set"

ShardMetadataFn = Callable[[Sequence["WriteEntry"]], Mapping[str, str]]


@dataclass
class WriteEntry:
    """One tensor to write: its on-disk dtype and shape, its size, and its tensor (`source`)."""

    name: str
    dtype: DType
    shape: List[int]
    nbytes: int
    source: Any = None


def _tensor(source: Any, name: str) -> torch.Tensor:
    if isinstance(source, TensorBase):
        source = source.get_raw()
    if not isinstance(source, torch.Tensor):
        raise ValueError(f"{name}: the source is a {type(source).__name__}; this saver writes torch tensors as they are "
                         "(a custom fill is not supported)")
    return source


def plain_entry(name: str, tensor: Any, *, framework: str = "pytorch") -> WriteEntry:
    """Describes a tensor (or a `TorchTensor`), keeping it as the entry's source."""
    if framework != "pytorch":
        raise ValueError(f"framework={framework!r}: only 'pytorch' is supported")
    t = _tensor(tensor, name)
    if t.dtype not in SAVABLE:
        raise ValueError(f"tensor '{name}' cannot be saved: safetensors has no dtype for {t.dtype}")
    shape = list(t.shape)
    if t.dtype == torch.float4_e2m1fn_x2 and shape:
        shape[-1] *= 2  # safetensors counts float4 values, torch pairs of them
    return WriteEntry(name, DType.from_torch(t.dtype), shape, t.numel() * t.element_size(), tensor)


def shard_paths(base: str, num_shards: int) -> List[str]:
    if num_shards < 1:
        raise ValueError("num_shards must be positive")
    return [f"{base}-{i + 1:05d}-of-{num_shards:05d}.safetensors" for i in range(num_shards)]


def _strings(given: Optional[Mapping[str, str]]) -> dict:
    for k, v in (given or {}).items():
        if not isinstance(k, str) or not isinstance(v, str):
            raise ValueError(f"__metadata__ entries must be strings: {k!r}")
    return dict(given or {})


@mapped_errors
def save_sharded(entries: Sequence[WriteEntry], base: str, *, num_shards: int = 16, fill: Any = None,
                 framework: str = "pytorch", min_free_bytes: int = 0, fsync: bool = False,
                 metadata: Optional[Mapping[str, str]] = None, shard0_metadata: Optional[Mapping[str, str]] = None,
                 shard_metadata: Optional[ShardMetadataFn] = None, header_align: int = 8,
                 pg: Any = None) -> List[str]:
    """Writes `entries` as `{base}-0000i-of-0000N.safetensors`; returns the paths. Every shard
    is written and synced before any is renamed into place: a tensor refused, a full disk or a
    failed write leaves none of them.

    `pg` (an extension of IBM's API): a torch.distributed group whose ranks all make this call
    with the same entries (replicated tensors): each rank writes its share of the shards'
    bytes, and the shards are renamed into place by rank 0 once every rank's are durable (see
    `fastsafetensors_rs.save`)."""
    del fsync  # every file is synced before it is renamed into place
    group = pg if pg is not None and _group_size(pg) > 1 else None
    set_id = _shared_set_id(group)
    tensors: Mapping[str, Any] = {}
    files: List[dict] = []
    try:
        tensors, files = _layout(entries, base, num_shards, fill, framework, min_free_bytes, metadata, shard0_metadata,
                                 shard_metadata, header_align, set_id)
    except Exception as e:
        if group is None:
            raise
        # Failed on this rank: the group's first step raises it here and names it on the others.
        group_save({}, "", -1, None, None, group, files=[], failed=e)
    group_save(tensors, "", -1, None, None, group, files=files)
    return shard_paths(base, num_shards)


def _layout(entries: Sequence[WriteEntry], base: str, num_shards: int, fill: Any, framework: str,
            min_free_bytes: int, metadata: Optional[Mapping[str, str]], shard0_metadata: Optional[Mapping[str, str]],
            shard_metadata: Optional[ShardMetadataFn], header_align: int, set_id: str):
    """The tensors by name and IBM's files (each its tensors and metadata), checked."""
    if fill is not None:
        raise NotImplementedError("save_sharded(fill=...): a custom fill is not supported; entries' sources "
                                  "(torch tensors) are written as they are")
    if framework != "pytorch":
        raise ValueError(f"framework={framework!r}: only 'pytorch' is supported")
    if header_align != 8:
        raise ValueError(f"header_align={header_align}: only 8 (safetensors' own alignment) is supported")
    paths = shard_paths(base, num_shards)
    names = set()
    for e in entries:
        if e.name in names or e.name == "__metadata__":
            raise ValueError(f"duplicate or reserved tensor name: {e.name}")
        names.add(e.name)
    tensors = {e.name: _tensor(e.source, e.name) for e in entries}
    common, first = _strings(metadata), _strings(shard0_metadata)
    # IBM's balance: largest first, each into the emptiest shard.
    members: List[List[WriteEntry]] = [[] for _ in paths]
    loads = [0] * num_shards
    for e in sorted(entries, key=lambda e: -e.nbytes):
        i = loads.index(min(loads))
        members[i].append(e)
        loads[i] += e.nbytes
    directory = os.path.dirname(os.path.abspath(base))
    os.makedirs(directory, exist_ok=True)
    free = shutil.disk_usage(directory).free
    if free < sum(loads) + min_free_bytes:
        raise OSError(f"not enough space in {directory}: {sum(loads) / 2**30:.1f} GiB needed, {free / 2**30:.1f} GiB free")
    files = []
    for i, (path, shard) in enumerate(zip(paths, members)):
        md = dict(common, **(first if i == 0 else {}))
        md.update({KEY_SHARD_INDEX: str(i), KEY_SHARD_COUNT: str(num_shards), KEY_SHARD_SET: set_id})
        if shard_metadata is not None:
            extra = _strings(shard_metadata(tuple(shard)))
            reserved = set(extra) & {KEY_SHARD_INDEX, KEY_SHARD_COUNT, KEY_SHARD_SET}
            if reserved:
                raise ValueError(f"shard metadata key is reserved: {reserved.pop()}")
            md.update(extra)
        files.append({"path": os.path.abspath(path), "tensors": [e.name for e in shard], "metadata": md})
    return tensors, files


def _shared_set_id(pg: Any) -> str:
    """A new shard-set id, rank 0's on every rank of `pg`."""
    set_id = uuid.uuid4().hex
    if pg is not None:
        import torch.distributed as dist

        box = [set_id]
        dist.broadcast_object_list(box, src=dist.get_global_rank(pg, 0), group=pg)
        set_id = box[0]
    return set_id


class ParallelSaver:
    """Settings for repeated `save_sharded` calls, as IBM's `ParallelSaver` (`num_threads` is
    accepted: the writers are the loader's I/O threads, `FASTSAFETENSORS_THREADS`; `pg`, an
    extension, saves from every rank of a process group as `save_sharded(..., pg=)` does)."""

    def __init__(self, *, num_shards: int = 16, framework: str = "pytorch", num_threads: int = 8,
                 shard_metadata: Optional[ShardMetadataFn] = None, fill: Any = None, min_free_bytes: int = 0,
                 fsync: bool = False, pg: Any = None) -> None:
        if num_shards < 1:
            raise ValueError("num_shards must be positive")
        if num_threads < 1:
            raise ValueError("num_threads must be positive")
        self.num_shards, self.framework, self.num_threads = num_shards, framework, num_threads
        self.shard_metadata, self.fill, self.min_free_bytes, self.fsync = shard_metadata, fill, min_free_bytes, fsync
        self.pg = pg

    def save(self, tensors: Mapping[str, Any], base: str, *, metadata: Optional[Mapping[str, str]] = None,
             shard0_metadata: Optional[Mapping[str, str]] = None, header_align: int = 8) -> List[str]:
        entries = [plain_entry(name, t, framework=self.framework) for name, t in tensors.items()]
        return self.save_entries(entries, base, metadata=metadata, shard0_metadata=shard0_metadata,
                                 header_align=header_align)

    def save_entries(self, entries: Sequence[WriteEntry], base: str, *, metadata: Optional[Mapping[str, str]] = None,
                     shard0_metadata: Optional[Mapping[str, str]] = None, header_align: int = 8) -> List[str]:
        return save_sharded(entries, base, num_shards=self.num_shards, fill=self.fill, framework=self.framework,
                            min_free_bytes=self.min_free_bytes, fsync=self.fsync, metadata=metadata,
                            shard0_metadata=shard0_metadata, shard_metadata=self.shard_metadata,
                            header_align=header_align, pg=self.pg)
