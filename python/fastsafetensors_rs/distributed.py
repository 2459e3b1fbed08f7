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
budget) and see the same bytes under its paths (each file's fingerprint: its size, its
header and up to 64 pages sampled over its data, or an object's ETag, version id or
Last-Modified date); a difference is refused at once on every rank, naming it. A rank whose
read fails makes every rank raise, naming the file and the rank: no rank returns a tensor
whose buffer was not filled by all of them.
"""

from __future__ import annotations

import collections
import concurrent.futures
import contextlib
import hashlib
import json
import math
import os
import socket
import threading
from typing import Any, Dict, Iterator, List, Optional, Sequence, Tuple

import torch

from ._dtypes import CASTABLE, DTYPES, torch_shape
from ._logging import redact
from ._ops import checkpoint_files, describe, ops

__all__ = ["node_group", "group_size", "SharedLoad", "SharedTensors", "sharded_load", "block", "verified_bytes"]

_PAGE = 4096
# Bytes this process has hashed for the groups' verified loads (`verified_bytes()`).
_verified_bytes = [0]


def verified_bytes() -> int:
    """Bytes this process has hashed so far for verified loads shared with a group: the files
    the plans gave this rank to check (about 1/world of each load's bytes)."""
    return _verified_bytes[0]
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
                 handle: int = -1, chunk: int = 0, cache_dir: Optional[str] = None, verify: Optional[str] = None):
        dist = _dist()
        self._dist = dist
        self._group = group
        self.world = group_size(group)
        self.rank = dist.get_rank(group)
        self._device = torch.device(device)
        self._reader = reader
        request = {"files": list(paths), "tensor_filter": patterns, "tensor_name_match_mode": mode,
                   "dtype": str(dtype), "device": self._device.type, "max_memory": max_memory,
                   "streamed": streamed, "verify": verify}
        self._own_handle = handle == -1
        self._handle = -1
        # A verified load (`verify`: the op's argument): each file is hashed once, by the rank
        # the plan names (`checkers`), from the buffers the exchange filled, in file order;
        # every rank learns the verdicts before returning (a stream: before handing out any
        # tensor of a later file).
        self._verify_failure: Optional[str] = None
        self._hasher: Optional[concurrent.futures.ThreadPoolExecutor] = None
        self._hashing: List[concurrent.futures.Future] = []
        self.plan: Dict[str, Any] = {}
        failure = None
        try:  # a failure here is every rank's: it goes to the others before raising
            self._check_backend()
            files = paths if not self._own_handle else checkpoint_files(paths)
            self._handle = ops.open_handle(files, cache_dir, verify) if self._own_handle else handle
            text = ops.share_load(files, dtype, patterns, mode, self.world, (max_memory or "") if streamed else None,
                                  chunk, self._handle)
            self.plan = json.loads(text)
        except (RuntimeError, ValueError, OSError) as e:
            failure = f"{type(e).__name__}: {e}"
        # Compared file by file (to name the file), apart from the plan's layout.
        fingerprints = self.plan.pop("fingerprints", [])
        digest = hashlib.sha256(json.dumps(self.plan, sort_keys=True).encode()).hexdigest()
        try:
            self._agree(request, digest, fingerprints, failure)
        except BaseException:
            self.close()
            raise
        self._streamed = streamed
        # Whether the handle verifies (`verify`, or a handle opened to verify): the plan names
        # the rank checking each file it reads.
        self._verifying = any(c >= 0 for c in self.plan.get("checkers", []))
        if self.rank in self.plan.get("checkers", []):
            # The files this rank checks are hashed on a thread of their own, chunk by chunk as
            # the exchange fills them, while the next chunks are read and exchanged (the op
            # lets go of the GIL).
            self._hasher = concurrent.futures.ThreadPoolExecutor(1, thread_name_prefix="fastsafetensors-verify")
        # Each file's last buffer: where the rank checking it has fed it all.
        self._last_of_file = {buf["file"]: b for b, buf in enumerate(self.plan["buffers"])}
        self.tensor_count = len(self.plan["tensors"])
        self.byte_count = sum(t["nbytes"] for t in self.plan["tensors"])

    def _check_backend(self) -> None:
        backend = str(self._dist.get_backend(self._group)).lower()
        if self._device.type == "cpu" and backend == "nccl":
            raise ValueError("process_group: an NCCL group exchanges CUDA tensors only; to load to the CPU, "
                             "pass a gloo group (torch.distributed.new_group(backend='gloo'))")

    def _agree(self, request: Dict[str, Any], digest: str, fingerprints: List[str], failure: Optional[str]) -> None:
        """Every rank learns what every other asked for, planned and holds: a failure or a
        difference raises on all of them, before anything is read."""
        everyone: List[Any] = [None] * self.world
        self._dist.all_gather_object(everyone, (request, digest, fingerprints, failure), group=self._group)
        for r, (_, _, _, failed) in enumerate(everyone):
            if failed:
                raise RuntimeError(f"{failed} (on rank {r} of the {self.world} ranks loading together)")
        for key in request:
            values = [asked[key] for asked, _, _, _ in everyone]
            for r, v in enumerate(values):
                if v != values[0]:
                    raise ValueError(f"process_group: the ranks asked for different loads: {key} is {values[0]!r} "
                                     f"on rank 0 but {v!r} on rank {r}")
        # The same bytes first: a rank reads its part for every other, so a file that differs
        # between ranks would give each a mix of both (even where the layouts agree).
        for i, path in enumerate(self.plan["files"]):
            holders: Dict[str, List[int]] = {}
            for r, (_, _, theirs, _) in enumerate(everyone):
                holders.setdefault(theirs[i] if i < len(theirs) else "", []).append(r)
            if len(holders) > 1:
                groups = "; ".join(f"rank{'s' * (len(rs) > 1)} {', '.join(map(str, rs))}: version {k + 1}"
                                   for k, rs in enumerate(holders.values()))
                raise RuntimeError(f"process_group: {redact(path)} holds different bytes on different ranks ({groups}): "
                                   "each rank must see the same checkpoint (the same path in another working "
                                   "directory, another mount or another copy is another file)")
        for r, (_, theirs, _, _) in enumerate(everyone):
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
        pending = None  # (the exchange in flight, its buffer, whether it is the buffer's last, the chunk)
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
            with self._exchanging(b):
                work = self._dist.all_gather_into_tensor(mem[offset:offset + world * piece], mine,
                                                         group=self._group, async_op=True)
            pending = (work, b, last, (offset, piece))
        if pending is not None:
            done = self._finish(pending, failure, memory, specs)
            if done is not None:
                yield done
        if self._verifying:
            self._check_verified()
        self.close()

    def _finish(self, pending, failure: Optional[str], memory: Dict[int, torch.Tensor],
                specs: List[List[Dict[str, Any]]]) -> Optional[List[Tuple[str, torch.Tensor]]]:
        """Waits for an exchange; after a buffer's last one, checks that every rank read its
        pieces and makes the buffer's tensors."""
        work, b, last, chunk = pending
        with self._exchanging(b):
            work.wait()
        if self._verifying:
            self._check_chunk(b, chunk, memory[b], last)
        if not last:
            return None
        with self._exchanging(b):
            reads_failed = self._reads_failed(failure)
        if reads_failed:
            self.close()
            raise RuntimeError(reads_failed)
        mem = memory.pop(b)
        if self._verifying and self._streamed and self._last_of_file[self.plan["buffers"][b]["file"]] == b:
            self._check_verified()  # before any tensor of a later file
        return [(t["name"], _tensor(t, mem)) for t in specs[b]]

    def _check_chunk(self, b: int, chunk: Tuple[int, int], mem: torch.Tensor, last: bool) -> None:
        """On the rank that checks buffer `b`'s file: the bytes the exchange just brought into
        the buffer (`chunk`: offset, piece) queued to the file's check, from host memory (a copy
        of a device buffer: the very bytes its tensors are views of); after the file's last
        chunk, its verdict, kept for `_check_verified`."""
        buf = self.plan["buffers"][b]
        file = buf["file"]
        if self.plan["checkers"][file] != self.rank or self._hasher is None:
            return
        offset, piece = chunk
        data = mem[offset:min(offset + self.world * piece, buf["len"])]
        host = data if data.device.type == "cpu" else data.to("cpu")
        finish = last and self._last_of_file[file] == b
        self._hashing.append(self._hasher.submit(self._hash, self.plan["files"][file], buf["start"] + offset, host,
                                                 finish))

    def _hash(self, path: str, offset: int, data: torch.Tensor, finish: bool) -> None:
        """The hasher thread's work, in file order: `data` fed to the check of `path` (and the
        check finished after its last bytes); the first failure is kept."""
        if self._verify_failure is not None:
            return
        try:
            if data.numel():
                ops.check_range(path, offset, data, self._handle)
                _verified_bytes[0] += data.numel()
            if finish:
                ops.check_finish(path, self._handle)
        except RuntimeError as e:
            self._verify_failure = str(e)

    def _hashed(self) -> None:
        """Waits for the hashing queued so far."""
        pending, self._hashing = self._hashing, []
        for future in pending:
            future.result()

    def _check_verified(self) -> None:
        """Every rank's verdicts on the files it checked: a mismatch anywhere raises the same
        error on every rank (a bulk load returns nothing then)."""
        self._hashed()
        verdicts: List[Optional[str]] = [None] * self.world
        self._dist.all_gather_object(verdicts, self._verify_failure, group=self._group)
        for r, failed in enumerate(verdicts):
            if failed:
                self.close()
                outcome = "no tensor of a later file was handed out" if self._streamed else "nothing was loaded"
                raise RuntimeError(f"{failed} (checked by rank {r} of the {self.world} ranks loading together; "
                                   f"{outcome})")

    def _reads_failed(self, failure: Optional[str]) -> Optional[str]:
        """Whether every rank read its pieces of the buffer: None, or the first failure, named
        with its rank."""
        ok = torch.tensor([failure is None], dtype=torch.int32, device=self._device)
        everyone = torch.empty(self.world, dtype=torch.int32, device=self._device)
        self._dist.all_gather_into_tensor(everyone, ok, group=self._group)
        if bool(everyone.all()):
            return None
        messages: List[Optional[str]] = [None] * self.world
        self._dist.all_gather_object(messages, failure, group=self._group)
        r = next(r for r, m in enumerate(messages) if m)
        return f"{messages[r]} (read by rank {r} of the {self.world} ranks loading together; nothing was loaded)"

    @contextlib.contextmanager
    def _exchanging(self, b: int) -> Iterator[None]:
        """A collective of buffer `b`'s exchange (see `_exchange_of`)."""
        try:
            with _exchange_of(self.plan["files"][self.plan["buffers"][b]["file"]]):
                yield
        except RuntimeError:
            self.close()
            raise

    def close(self) -> None:
        if self._hasher is not None:
            self._hasher.shutdown(wait=True, cancel_futures=True)
            self._hasher = None
        if self._own_handle and self._handle != -1:
            ops.close_handle(self._handle)
        self._handle = -1


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


@contextlib.contextmanager
def _exchange_of(what: str) -> Iterator[None]:
    """A collective exchanging bytes of `what` (a file's path, or words naming files): the
    process group's own error (a rank that died, one that stopped for longer than the group's
    timeout) raised in one line naming them, rather than bare."""
    try:
        yield
    except RuntimeError as e:
        reason = " ".join(str(e).split())
        raise RuntimeError(f"{redact(what)}: the exchange with the other ranks of the process group failed (a rank "
                           f"died, or stopped for longer than the group's timeout): {reason}") from e


# ---------------------------------------------------------------- shards


def block(size: int, world: int, rank: int) -> Tuple[int, int]:
    """Rank `rank`'s part `[start, stop)` of `size` indices split over `world` ranks, as the
    compatible API's `get_sharded` splits them: blocks of `ceil(size / world)`, the last ones
    shorter or empty."""
    b = -(-size // world)
    return min(size, rank * b), min(size, (rank + 1) * b)


def sharded_load(paths: Sequence[str], device: str, dtype: Optional[torch.dtype], reader: Optional[str],
                 patterns: Optional[List[str]], mode: str, group: Any,
                 shard: Dict[str, int], cache_dir: Optional[str] = None,
                 verify: Optional[str] = None) -> Dict[str, torch.Tensor]:
    """A load where the tensors `shard` names (glob pattern -> dimension) come as this rank's
    block along that dimension, and every other selected tensor whole.

    Row blocks (dimension 0) are read by their rank alone, only their bytes: nothing goes over
    the group. A block along another dimension is not contiguous in the file: its tensor is
    read whole by one rank (tensors spread over the ranks by bytes) and scattered. The other
    tensors are read once between the ranks and exchanged (`SharedLoad`). Verified
    (`verify`, the op's argument), see `_verified_blocks`."""
    dist = _dist()
    world, rank = group_size(group), dist.get_rank(group)
    files = checkpoint_files(paths)
    handle = ops.open_handle(files, cache_dir, verify)
    try:
        selected = list(ops.selected(files, patterns, mode, handle))
        dtypes, shapes, file_of = _headers(files, handle)
        dims = _shard_dims(selected, shard, files, handle, shapes)
        if verify is not None:
            return _verified_blocks(files, device, dtype, reader, selected, dims, group, world, rank, handle, verify)
        rows = [n for n in selected if dims.get(n) == 0]
        columns = [n for n in selected if dims.get(n, 0) > 0]
        whole = [n for n in selected if n not in dims]
        out: Dict[str, torch.Tensor] = {}
        # Made even with nothing whole to share: the ranks agree on the files' bytes before the
        # blocks one rank reads for the others go out.
        shared = SharedLoad(files, device, dtype, reader, whole, "exact", group, None, False, handle)
        out.update(pair for buffer in shared.buffers() for pair in buffer)
        for name in rows:
            start, stop = block(shapes[name][0], world, rank)
            if start == stop:  # more ranks than rows
                empty = [0] + torch_shape(dtypes[name], shapes[name])[1:]
                t = torch.empty(empty, dtype=DTYPES[dtypes[name]][0])
            else:
                t = ops.load_rows(files[file_of[name]], name, start, stop, reader, handle)
            out[name] = _cast(t, dtype).to(device)
        owners = _owners(columns, shapes, dtypes, world)
        mine = [n for n in columns if owners[n] == rank]
        local = {}
        if mine:
            local = dict(zip(*ops.load_named(files, device, dtype, reader, None, mine, "exact", handle)[:2]))
        for name in columns:
            stored = dtypes[name]
            loaded = _cast(torch.empty(0, dtype=DTYPES[stored][0]), dtype).dtype
            with _exchange_of(files[file_of[name]]):
                out[name] = _scatter(local.pop(name, None), dims[name], torch_shape(stored, shapes[name]), loaded,
                                     device, owners[name], group, world, rank)
        return {n: out[n] for n in selected}
    finally:
        ops.close_handle(handle)


def _verified_blocks(files: Sequence[str], device: str, dtype: Optional[torch.dtype], reader: Optional[str],
                     selected: List[str], dims: Dict[str, int], group: Any, world: int, rank: int,
                     handle: int, verify: str) -> Dict[str, torch.Tensor]:
    """`sharded_load` verified: a file's digest covers all of it, and row blocks read by their
    own ranks are never in one place to hash. So the load is a verified shared load (each
    byte read once in the group, each file hashed once, by one rank, every verdict known to
    every rank before anything is returned) of every selected tensor, and each rank keeps its
    blocks of what arrives, one buffer at a time. The price: every rank receives every byte,
    as with `process_group=` alone, where unverified row blocks go over the group not at all."""
    shared = SharedLoad(files, device, dtype, reader, selected, "exact", group, None, False, handle, verify=verify)
    out: Dict[str, torch.Tensor] = {}
    for buffer in shared.buffers():
        for name, t in buffer:
            d = dims.get(name)
            if d is not None:
                start, stop = block(t.shape[d], world, rank)
                if stop - start != t.shape[d]:
                    # A copy, so that the buffer the whole tensor is a view of can go.
                    t = t.narrow(d, start, stop - start).clone(memory_format=torch.contiguous_format)
            out[name] = t
    return {n: out[n] for n in selected}


def _headers(files: Sequence[str], handle: int):
    """Each tensor's safetensors dtype name, shape and file, from the headers."""
    dtypes: Dict[str, str] = {}
    shapes: Dict[str, List[int]] = {}
    file_of: Dict[str, int] = {}
    for i, f in enumerate(files):
        names, types, dims, _ = describe(f, handle)
        dtypes.update(zip(names, types))
        shapes.update(zip(names, (list(d) for d in dims)))
        file_of.update((n, i) for n in names)
    return dtypes, shapes, file_of


def _shard_dims(selected: List[str], shard: Dict[str, int], files: Sequence[str], handle: int,
                shapes: Dict[str, List[int]]) -> Dict[str, int]:
    """The dimension each selected tensor is split along (the first pattern that matches it)."""
    dims: Dict[str, int] = {}
    wanted = set(selected)
    for pattern, dim in shard.items():
        if isinstance(dim, bool) or not isinstance(dim, int):
            raise TypeError(f"shard[{pattern!r}]: expected a dimension (int), got {dim!r}")
        for name in ops.selected(list(files), [pattern], "glob", handle):
            if name in dims or name not in wanted:
                continue
            ndim = len(shapes[name])  # F4 keeps its dimensions (the last one halved)
            d = dim + ndim if dim < 0 else dim
            if not 0 <= d < ndim:
                raise ValueError(f"shard[{pattern!r}] = {dim}: tensor {name!r} has {ndim} dimension(s) "
                                 f"(shape {shapes[name]})")
            dims[name] = d
    return dims


def _owners(columns: List[str], shapes: Dict[str, List[int]], dtypes: Dict[str, str], world: int) -> Dict[str, int]:
    """Which rank reads each tensor split along a dimension other than 0: the largest first,
    each to the rank with the fewest bytes so far (the same on every rank: headers only)."""
    load = [0] * world
    owners: Dict[str, int] = {}
    size = {n: DTYPES[dtypes[n]][1] * max(1, math.prod(shapes[n])) for n in columns}
    for name in sorted(columns, key=lambda n: (-size[n], n)):
        r = min(range(world), key=lambda k: (load[k], k))
        owners[name] = r
        load[r] += size[name]
    return owners


def _cast(t: torch.Tensor, dtype: Optional[torch.dtype]) -> torch.Tensor:
    """`dtype=` as the loader applies it: floating-point tensors cast, the rest kept."""
    return t.to(dtype) if dtype is not None and t.dtype in CASTABLE and t.dtype != dtype else t


def _scatter(whole: Optional[torch.Tensor], dim: int, shape: List[int], dtype: torch.dtype,
             device: str, owner: int, group: Any, world: int, rank: int) -> torch.Tensor:
    """This rank's block along `dim` of a tensor (of torch `shape` and `dtype` once
    loaded), scattered by the rank that read it (`whole` there). Blocks are padded to the
    first (the largest) for the scatter and cut back on arrival."""
    dist = _dist()
    # Blocks travel as bytes (a last dimension of each element's bytes): every dtype (float8,
    # float4, bool, bfloat16) is cut, padded and scattered alike, bit for bit, on any backend.
    size = torch.empty(0, dtype=dtype).element_size()
    b = -(-shape[dim] // world)
    padded = shape[:dim] + [b] + shape[dim + 1:] + [size]
    out = torch.empty(padded, dtype=torch.uint8, device=device)
    chunks = None
    if rank == owner:
        bits = whole.unsqueeze(-1).view(torch.uint8)
        chunks = []
        for r in range(world):
            start, stop = block(shape[dim], world, r)
            chunk = torch.zeros(padded, dtype=torch.uint8, device=device)
            chunk.narrow(dim, 0, stop - start).copy_(bits.narrow(dim, start, stop - start))
            chunks.append(chunk)
    if out.numel():
        dist.scatter(out, chunks, src=dist.get_global_rank(group, owner), group=group)
    start, stop = block(shape[dim], world, rank)
    return out.narrow(dim, 0, stop - start).contiguous().view(dtype).squeeze(-1)
