"""Loads shared by the ranks of a torch.distributed group: read once, fan out.

With `process_group=` (`load`, `load_file`, `stream`, `safe_open(...).tensors()`), every rank
of the group gets every selected tensor, bit-exact, and each byte is read from storage by one
rank only. The loader (in Rust) cuts the selected bytes into chunks and each chunk into one
page-aligned piece per rank, whatever the number and sizes of the files; each rank reads its
pieces straight into the buffer the tensors will be views of, and one all-gather per chunk, on
the group's own backend, brings in the other ranks' pieces (NCCL for CUDA tensors, gloo for
CPU ones: torch.distributed is the only transport). The read of the next chunk overlaps the
exchange of this one.

Which group to pass:
- node-local storage (each node has its own copy of the checkpoint, on a local NVMe drive or
  in its page cache): `node_group()`, so that each node reads every byte once and the
  exchange stays on the node's own links (NVLink, PCIe, loopback);
- shared storage that is slower than the network between nodes (a network filesystem, an
  object store mount): the world group, `torch.distributed.group.WORLD`, so that the job as a
  whole reads every byte once.
A group of one rank is an ordinary load.

Every rank must ask for the same load (files, tensor filter, dtype, device type, memory
budget); a difference is refused at once on every rank, naming it. A rank whose read fails
makes every rank raise, naming the file and the rank: no rank returns a tensor whose buffer
was not filled by all of them.
"""

from __future__ import annotations

import collections
import hashlib
import json
import os
import socket
import threading
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from ._dtypes import DTYPES
from ._ops import ops

__all__ = ["node_group", "group_size", "SharedLoad", "SharedTensors"]

_PAGE = 4096
# One node-local group per parent group, made once (every rank must make every group).
_node_groups: Dict[Any, Any] = {}


def _dist():
    import torch.distributed as dist

    return dist


def group_size(process_group: Any) -> int:
    """The number of ranks in `process_group` (an initialized default group for None is not
    assumed: None means no sharing)."""
    dist = _dist()
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError("process_group: torch.distributed is not initialized "
                           "(call torch.distributed.init_process_group first)")
    return dist.get_world_size(process_group)


def node_group() -> Any:
    """This process's node-local group: the ranks of the job that share its node.

    Nodes are told apart by torchrun's `GROUP_RANK` (the node's rank), else by
    `LOCAL_WORLD_SIZE` (ranks numbered node by node, as torchrun and SLURM do), else by the
    host names, gathered once. Every rank of the job must call it (it makes one group per
    node); later calls return the same group. See the module documentation for which group
    to load with.
    """
    dist = _dist()
    world = group_size(None)
    if "world" in _node_groups:
        return _node_groups["world"]
    rank = dist.get_rank()
    if os.environ.get("GROUP_RANK"):
        node = "node " + os.environ["GROUP_RANK"]
    elif os.environ.get("LOCAL_WORLD_SIZE"):
        node = f"node {rank // int(os.environ['LOCAL_WORLD_SIZE'])}"
    else:
        node = socket.gethostname()
    nodes: List[Optional[str]] = [None] * world
    dist.all_gather_object(nodes, node)
    members: Dict[str, List[int]] = {}
    for r, n in enumerate(nodes):
        members.setdefault(n, []).append(r)
    mine, _ = dist.new_subgroups_by_enumeration(list(members.values()))
    _node_groups["world"] = mine
    return mine


def _aligned_bytes(size: int, device: torch.device) -> torch.Tensor:
    """`size` bytes on `device` starting at a page boundary (what direct reads need)."""
    raw = torch.empty(size + _PAGE, dtype=torch.uint8, device=device)
    skip = -raw.data_ptr() % _PAGE
    return raw[skip:skip + size]


def _tensor(spec: Dict[str, Any], buffer: torch.Tensor) -> torch.Tensor:
    """A tensor over its bytes in `buffer`, as the loader specified it (a view, or a copy,
    then cast), as the op does for the tensors of its own buffers."""
    dtype = DTYPES[spec["dtype"]][0]
    if spec["nbytes"] == 0:
        out = torch.empty(spec["shape"], dtype=dtype, device=buffer.device)
    else:
        data = buffer[spec["offset"]:spec["offset"] + spec["nbytes"]]
        out = (data.clone() if spec["copy"] else data).view(dtype).view(spec["shape"])
    return out.to(DTYPES[spec["cast"]][0]) if spec["cast"] else out


class SharedLoad:
    """One load shared by the ranks of `group`: `buffers()` yields each buffer's tensors as
    soon as every rank has its bytes."""

    def __init__(self, paths: Sequence[str], device: str, dtype: Optional[torch.dtype], reader: Optional[str],
                 patterns: Optional[List[str]], mode: str, group: Any, max_memory: Optional[str], streamed: bool,
                 handle: int = -1, chunk: int = 0):
        dist = _dist()
        self._dist = dist
        self._group = group
        self.world = group_size(group)
        self.rank = dist.get_rank(group)
        self._device = torch.device(device)
        self._reader = reader
        self._check_backend()
        request = {"files": list(paths), "tensor_filter": patterns, "tensor_name_match_mode": mode,
                   "dtype": str(dtype), "device": self._device.type, "max_memory": max_memory,
                   "streamed": streamed}
        self._own_handle = handle == -1
        self._handle = -1
        self.plan: Dict[str, Any] = {}
        failure = None
        try:
            files = paths if not self._own_handle else _files_of(paths)
            self._handle = ops.open_handle(files) if self._own_handle else handle
            text = ops.share_load(files, dtype, patterns, mode, self.world, (max_memory or "") if streamed else None,
                                  chunk, self._handle)
            self.plan = json.loads(text)
        except (RuntimeError, ValueError, OSError) as e:
            failure = f"{type(e).__name__}: {e}"
        digest = hashlib.sha256(json.dumps(self.plan, sort_keys=True).encode()).hexdigest()
        try:
            self._agree(request, digest, failure)
        except BaseException:
            self.close()
            raise
        self.tensor_count = len(self.plan["tensors"])
        self.byte_count = sum(t["nbytes"] for t in self.plan["tensors"])

    def _check_backend(self) -> None:
        backend = str(self._dist.get_backend(self._group)).lower()
        if self._device.type == "cpu" and backend == "nccl":
            raise ValueError("process_group: an NCCL group exchanges CUDA tensors only; to load to the CPU, "
                             "pass a gloo group (torch.distributed.new_group(backend='gloo'))")

    def _agree(self, request: Dict[str, Any], digest: str, failure: Optional[str]) -> None:
        """Every rank learns what every other asked for and planned: a failure or a difference
        raises on all of them, before anything is read."""
        everyone: List[Any] = [None] * self.world
        self._dist.all_gather_object(everyone, (request, digest, failure), group=self._group)
        for r, (_, _, failed) in enumerate(everyone):
            if failed:
                raise RuntimeError(f"{failed} (on rank {r} of the {self.world} ranks loading together)")
        for key in request:
            values = [asked[key] for asked, _, _ in everyone]
            for r, v in enumerate(values):
                if v != values[0]:
                    raise ValueError(f"process_group: the ranks asked for different loads: {key} is {values[0]!r} "
                                     f"on rank 0 but {v!r} on rank {r}")
        for r, (_, theirs, _) in enumerate(everyone):
            if theirs != everyone[0][1]:
                raise RuntimeError(f"process_group: the files differ between ranks 0 and {r} (their headers or "
                                   "what the paths resolve to): each rank must see the same checkpoint")

    def buffers(self) -> Iterator[List[Tuple[str, torch.Tensor]]]:
        """Each buffer's `(name, tensor)` pairs, in read order, once every rank holds it."""
        plan, rank, world = self.plan, self.rank, self.world
        specs: List[List[Dict[str, Any]]] = [[] for _ in plan["buffers"]]
        for t in plan["tensors"]:
            specs[t["buffer"]].append(t)
        failure: Optional[str] = None
        pending = None  # (the exchange in flight, its buffer, whether it is the buffer's last)
        memory: Dict[int, torch.Tensor] = {}
        steps = [(b, c, k + 1 == len(buf["chunks"])) for b, buf in enumerate(plan["buffers"])
                 for k, c in enumerate(buf["chunks"])]
        for b, (offset, piece), last in steps:
            buf = plan["buffers"][b]
            if b not in memory:
                memory[b] = _aligned_bytes(buf["size"], self._device)
            mem = memory[b]
            at = min(offset + rank * piece, buf["len"])
            n = min(at + piece, buf["len"]) - at
            if n and failure is None:
                try:
                    ops.read_range(plan["files"][buf["file"]], buf["start"] + at, mem[at:at + n], self._reader,
                                   self._handle)
                except RuntimeError as e:
                    failure = str(e)
            if pending is not None:
                done = self._finish(pending, failure, memory, specs)
                if done is not None:
                    yield done
            mine = mem[offset + rank * piece:offset + (rank + 1) * piece]
            work = self._dist.all_gather_into_tensor(mem[offset:offset + world * piece], mine, group=self._group,
                                                     async_op=True)
            pending = (work, b, last)
        if pending is not None:
            done = self._finish(pending, failure, memory, specs)
            if done is not None:
                yield done
        self.close()

    def _finish(self, pending, failure: Optional[str], memory: Dict[int, torch.Tensor],
                specs: List[List[Dict[str, Any]]]) -> Optional[List[Tuple[str, torch.Tensor]]]:
        """Waits for an exchange; after a buffer's last one, checks that every rank read its
        pieces and makes the buffer's tensors."""
        work, b, last = pending
        work.wait()
        if not last:
            return None
        self._check_reads(failure)
        mem = memory.pop(b)
        return [(t["name"], _tensor(t, mem)) for t in specs[b]]

    def _check_reads(self, failure: Optional[str]) -> None:
        ok = torch.tensor([failure is None], dtype=torch.int32, device=self._device)
        everyone = torch.empty(self.world, dtype=torch.int32, device=self._device)
        self._dist.all_gather_into_tensor(everyone, ok, group=self._group)
        if bool(everyone.all()):
            return
        messages: List[Optional[str]] = [None] * self.world
        self._dist.all_gather_object(messages, failure, group=self._group)
        r = next(r for r, m in enumerate(messages) if m)
        self.close()
        raise RuntimeError(f"{messages[r]} (read by rank {r} of the {self.world} ranks loading together; "
                           "nothing was loaded)")

    def close(self) -> None:
        if self._own_handle and self._handle != -1:
            ops.close_handle(self._handle)
        self._handle = -1


def _files_of(paths: Sequence[str]) -> List[str]:
    """The files the paths stand for (directories and indexes expanded), checked as a load
    checks them."""
    files: List[str] = []
    for p in paths:
        found, _, problems = ops.checkpoint(p)
        if problems:
            raise RuntimeError(problems[0])
        files.extend(found)
    return files


class SharedTensors:
    """What `stream(..., process_group=...)` returns: `(name, tensor)` pairs as their buffers
    arrive on every rank, and how many tensors and bytes there are (`tensor_count`,
    `byte_count`). Every rank must iterate to the end (or `close()` at the same point): the
    exchange needs all of them."""

    def __init__(self, load: SharedLoad):
        self._load = load
        self._buffers = load.buffers()
        self._ready: collections.deque = collections.deque()
        self._lock = threading.Lock()
        self.tensor_count: int = load.tensor_count
        self.byte_count: int = load.byte_count

    def __iter__(self) -> "SharedTensors":
        return self

    def __next__(self) -> Tuple[str, torch.Tensor]:
        with self._lock:
            while not self._ready:
                self._ready.extend(next(self._buffers))
            # Handed over and forgotten: only the consumer keeps the buffer alive.
            return self._ready.popleft()

    def close(self) -> None:
        with self._lock:
            self._buffers.close()
            self._ready.clear()
            self._load.close()

    def __enter__(self) -> "SharedTensors":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
