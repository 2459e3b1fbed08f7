"""`FilesBufferOnDevice`: the tensors of a set of files, loaded by their owning ranks and
handed out whole, broadcast, scattered or pushed over torch.distributed."""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Any, Dict, Iterable, List, Mapping, Optional, Sequence, Set, Tuple

import torch

from .collectives import Group, as_bytes
from .tensor import TorchTensor, wrap
from .types import Device, DTypeLike, as_torch_dtype, resolve_device

logger = logging.getLogger("fastsafetensors_rs.compat")

# Broadcasts of tensors up to SMALL_TENSOR_BYTES are coalesced: when one is requested, the
# not yet sent small tensors that follow it in its file (up to COALESCE_BYTES in all, found
# among the next LOOKAHEAD_NAMES names) travel in the same broadcast, and the following
# requests for them are answered without a collective.
SMALL_TENSOR_BYTES = 1 << 20
COALESCE_BYTES = 16 << 20
LOOKAHEAD_NAMES = 256
_ALIGN = 16  # byte alignment of each tensor inside a coalesced broadcast


# Integer dtypes of each element size: concatenation and copies run on these views, bit
# for bit, because some dtypes (float4, e8m0) have no cat or copy kernels of their own.
_BITS = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.view(_BITS[t.element_size()])


def cat_exact(tensors: Sequence[torch.Tensor], dim: int) -> torch.Tensor:
    """torch.cat for every dtype, bit for bit."""
    return torch.cat([_bits(t) for t in tensors], dim=dim).view(tensors[0].dtype)


@dataclass(frozen=True)
class TensorEntry:
    """What every rank knows about a tensor from its file's header."""

    name: str
    path: str
    rank: int  # the rank that reads the file
    lidx: int  # the file's index among that rank's files
    st_dtype: str  # the dtype in the header
    shape: Tuple[int, ...]  # the shape in the header
    dtype: torch.dtype  # the dtype once loaded (after a load-time cast)
    torch_shape: Tuple[int, ...]  # the shape torch gives it (F4 packs two values)
    nbytes: int


@dataclass(frozen=True)
class FileEntry:
    path: str
    rank: int
    lidx: int
    names: Tuple[str, ...]  # in the order of their data in the file
    metadata: Optional[Dict[str, str]]


class TensorNotFoundError(KeyError, ValueError):
    """No loaded file holds the requested tensor. A KeyError (as a dict lookup) and a
    ValueError (as the original raised)."""

    def __str__(self) -> str:
        return str(self.args[0]) if self.args else ""


class FilesBufferOnDevice:
    r"""The tensors of the files given to `SafeTensorsFileLoader.add_filenames`, as returned
    by `copy_files_to_device()`.

    Multi-process use is SPMD: every rank calls the same methods with the same arguments in
    the same order, because they run collectives. A rank holds only the files it read;
    `get_tensor` broadcasts a tensor from its owner, `get_sharded` scatters it, `push_tensor`
    sends it to one rank. With `SingleGroup` every call returns the whole tensor.

    Memory: every returned tensor keeps its memory alive itself, so it stays valid after
    `close()` and after this object is gone. Whole tensors from this rank's own files are
    zero-copy views into the loaded file, which lives as long as any of them; in a group of
    several ranks the small ones (up to 1 MiB) are copies instead, so that a kept norm or
    scale never keeps a whole file alive. Shards, and tensors received from other ranks,
    own exactly their bytes. In a group of several ranks, once every tensor of a file has
    been handed out the buffer drops its own reference to that file, so the file's memory
    lives only as long as the caller's tensors (asking again for one of its tensors is then
    an error, as in the original).

    Attributes:
        key_to_rank_lidx: tensor name -> (rank that reads its file, file index on that
            rank), in file order then data order: iterate it to visit every tensor.
        pg: the process group given to the loader.
    """

    def __init__(
        self,
        files: Sequence[FileEntry],
        entries: Mapping[str, TensorEntry],
        local: Dict[str, torch.Tensor],
        pg: Any,
        device: torch.device,
    ):
        """Made by `SafeTensorsFileLoader.copy_files_to_device()`; not meant to be called
        directly. `local` holds the tensors of this rank's files."""
        self.pg = pg
        self.device = device
        self._group = Group(pg)
        self._files: Dict[str, FileEntry] = {f.path: f for f in files}
        self._entries: Dict[str, TensorEntry] = dict(entries)
        self.key_to_rank_lidx: "OrderedDict[str, Tuple[int, int]]" = OrderedDict(
            (name, (e.rank, e.lidx)) for name, e in self._entries.items()
        )
        self._position = {n: i for f in files for i, n in enumerate(f.names)}
        self._local = local
        self._closed = False
        # Bookkeeping that is identical on every rank (it depends only on the calls made),
        # so that each rank takes the same decisions about collectives.
        self._prefetched: Set[str] = set()  # coalesced-broadcast tensors not yet requested
        self._handed_out: Dict[str, Set[str]] = {f.path: set() for f in files}
        self._released: Set[str] = set()
        # The tensors that arrived in a coalesced broadcast, until they are requested.
        self._received: Dict[str, torch.Tensor] = {}

    # ------------------------------------------------------------ metadata

    def keys(self) -> List[str]:
        """Every tensor name, in file order then data order."""
        return list(self.key_to_rank_lidx)

    def get_filename(self, tensor_name: str) -> Optional[str]:
        """The file that holds `tensor_name`; None if none does (what TGIS-style loaders
        test for; falsy, like the "" of some releases)."""
        e = self._entries.get(tensor_name)
        return None if e is None else e.path

    def get_shape(self, tensor_name: str) -> List[int]:
        """The shape in the file's header."""
        return list(self._entry(tensor_name).shape)

    def close(self) -> None:
        """Drops this buffer's references, the process group's included. Tensors already
        returned stay valid; memory is freed when the last tensor into it is gone.
        Idempotent."""
        self._closed = True
        self._local = {}
        self._received = {}
        self._prefetched = set()
        self.pg = None
        self._group.release()

    def __enter__(self) -> "FilesBufferOnDevice":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    # ------------------------------------------------------------ tensors

    def get_tensor(
        self, tensor_name: str, device: Optional[Device] = None, dtype: DTypeLike = None
    ) -> torch.Tensor:
        """The whole tensor on every rank (a broadcast from the rank that read it).

        `device` and `dtype` (a `DType` or `torch.dtype`) convert the result; the tensor
        travels in its loaded dtype. Broadcasts of small tensors are coalesced."""
        e = self._available(tensor_name)
        t = self._whole(e)
        self._hand_out([e])
        return self._convert(t, device, dtype)

    def get_tensor_wrapped(
        self, tensor_name: str, device: Optional[Device] = None, dtype: DTypeLike = None
    ) -> TorchTensor:
        """`get_tensor` in the original's wrapper (`.get_raw()` is the tensor)."""
        return wrap(self.get_tensor(tensor_name, device, dtype))

    def get_sharded_wrapped(
        self,
        tensor_name: str,
        dim: int,
        device: Optional[Device] = None,
        dtype: DTypeLike = None,
    ) -> TorchTensor:
        """`get_sharded` in the original's wrapper (`.get_raw()` is the tensor)."""
        return wrap(self.get_sharded(tensor_name, dim, device, dtype))

    def get_sharded(
        self,
        tensor_name: str,
        dim: int,
        device: Optional[Device] = None,
        dtype: DTypeLike = None,
    ) -> torch.Tensor:
        """This rank's block of the tensor along `dim` (a scatter from the rank that read it).

        Rank r gets indices [r*b, min((r+1)*b, size)) with b = ceil(size / world_size); the
        last blocks may be shorter or empty. `dim=-1` means no sharding: the whole tensor is
        broadcast, as `get_tensor` does. With `SingleGroup` the whole tensor is returned."""
        e = self._available(tensor_name)
        if dim != -1:
            self._check_dim(e, dim)  # also with SingleGroup, so mistakes show before scaling out
        if dim == -1 or self._group.is_single:
            t = self._whole(e)
        else:
            self._forget_prefetch(e)
            t = self._scatter_concat([e], dim)
        self._hand_out([e])
        return self._convert(t, device, dtype)

    def push_tensor(
        self,
        tensor_name: str,
        dst_rank: int,
        device: Optional[Device] = None,
        dtype: DTypeLike = None,
    ) -> Optional[torch.Tensor]:
        """Sends the tensor from the rank that read it to `dst_rank` only: returns it there,
        None on every other rank."""
        e = self._available(tensor_name)
        if not 0 <= dst_rank < self._group.size:
            raise ValueError(f"dst_rank {dst_rank} is outside the group of {self._group.size}")
        self._forget_prefetch(e)
        me = self._group.rank
        t: Optional[torch.Tensor] = None
        if self._group.is_single or me == e.rank == dst_rank:
            t = self._local_tensor(e)
        elif me == e.rank:
            self._group.send(self._local_tensor(e), dst_rank, of=e.path)
        elif me == dst_rank:
            t = torch.empty(e.torch_shape, dtype=e.dtype, device=self.device)
            self._group.recv(t, e.rank, of=e.path)
        self._hand_out([e])
        return None if t is None else self._convert(t, device, dtype)

    def get_multi_cols(
        self,
        tensor_names: Sequence[str],
        dim: int,
        device: Optional[Device] = None,
        dtype: DTypeLike = None,
    ) -> TorchTensor:
        """Shards several tensors along `dim` and concatenates this rank's blocks in the
        order given: the fused-QKV pattern. Rank r gets cat([block_r(t) for t in tensors]),
        blocks as in `get_sharded`. The tensors must agree in dtype and in every other
        dimension. With `SingleGroup`, the concatenation of the whole tensors.

        Returned in the original's wrapper, as it returns it: `.get_raw()` is the tensor."""
        if not tensor_names:
            raise ValueError("get_multi_cols needs at least one tensor name")
        entries = [self._available(n) for n in tensor_names]
        first = entries[0]
        self._check_dim(first, dim)
        for e in entries[1:]:
            same_rest = len(e.torch_shape) == len(first.torch_shape) and all(
                a == b for i, (a, b) in enumerate(zip(e.torch_shape, first.torch_shape)) if i != dim
            )
            if e.dtype != first.dtype or not same_rest:
                raise ValueError(
                    f"get_multi_cols: '{e.name}' ({e.dtype}, {list(e.torch_shape)}) does not "
                    f"match '{first.name}' ({first.dtype}, {list(first.torch_shape)}) outside "
                    f"dim {dim}"
                )
        for e in entries:
            self._forget_prefetch(e)
        if self._group.is_single:
            t = cat_exact([self._local_tensor(e) for e in entries], dim)
        else:
            # One scatter per run of consecutive tensors read by the same rank.
            parts: List[torch.Tensor] = []
            run: List[TensorEntry] = []
            for e in entries:
                if run and run[-1].rank != e.rank:
                    parts.append(self._scatter_concat(run, dim))
                    run = []
                run.append(e)
            parts.append(self._scatter_concat(run, dim))
            t = parts[0] if len(parts) == 1 else cat_exact(parts, dim)
        self._hand_out(entries)
        return wrap(self._convert(t, device, dtype))

    def as_dict(self, tensor_shard_dim: Mapping[str, int]) -> Dict[str, TorchTensor]:
        """{name: get_sharded(name, dim)} for each (name, dim), in the mapping's order;
        dim -1 means the whole tensor. Each in the original's wrapper, as it returns them:
        `.get_raw()` is the tensor."""
        wanted = {n for n, d in tensor_shard_dim.items() if d == -1}
        out: Dict[str, TorchTensor] = {}
        for name, dim in tensor_shard_dim.items():
            if dim == -1:
                e = self._available(name)
                out[name] = wrap(self._whole(e, wanted))
                self._hand_out([e])
            else:
                out[name] = wrap(self.get_sharded(name, dim))
        return out

    # ------------------------------------------------------------ internals

    def _entry(self, name: str) -> TensorEntry:
        e = self._entries.get(name)
        if e is None:
            files = ", ".join(self._files) or "no files"
            raise TensorNotFoundError(f"tensor '{name}' is in none of the files ({files})")
        return e

    def _available(self, name: str) -> TensorEntry:
        """The entry of a tensor that can still be handed out; the same answer on every
        rank, so that all raise together."""
        if self._closed:
            raise RuntimeError(
                f"FilesBufferOnDevice is closed: cannot get tensor '{name}' (tensors returned "
                "before close() stay valid)"
            )
        e = self._entry(name)
        if e.path in self._released:
            raise RuntimeError(
                f"tensor '{name}' of {e.path}: every tensor of this file was already handed "
                "out, so the buffer let go of the file; keep the tensor you were given"
            )
        return e

    def _check_dim(self, e: TensorEntry, dim: int) -> None:
        ndim = len(e.torch_shape)
        if not 0 <= dim < ndim:
            raise ValueError(
                f"tensor '{e.name}' in {e.path} has shape {list(e.torch_shape)}: cannot shard "
                f"along dim {dim} (use 0..{ndim - 1}, or -1 for the whole tensor)"
            )

    def _local_tensor(self, e: TensorEntry) -> torch.Tensor:
        return self._local[e.name]

    def _hand_out(self, entries: Iterable[TensorEntry]) -> None:
        if self._group.is_single:
            return  # the tensors handed out are the file buffer itself: nothing to release
        for e in entries:
            seen = self._handed_out[e.path]
            seen.add(e.name)
            if len(seen) == len(self._files[e.path].names):
                self._released.add(e.path)
                if e.rank == self._group.rank:
                    for n in self._files[e.path].names:
                        self._local.pop(n, None)
                logger.debug("released %s (every tensor handed out)", e.path)

    def _forget_prefetch(self, e: TensorEntry) -> None:
        """A tensor fetched otherwise no longer needs its coalesced copy."""
        self._prefetched.discard(e.name)
        self._received.pop(e.name, None)

    def _convert(
        self, t: torch.Tensor, device: Optional[Device], dtype: DTypeLike
    ) -> torch.Tensor:
        target_dtype = as_torch_dtype(dtype)
        target_device = None if device is None else resolve_device(device)
        if target_device is None and (target_dtype is None or target_dtype == t.dtype):
            return t
        return t.to(device=target_device, dtype=target_dtype)

    # whole tensors (broadcast)

    def _whole(self, e: TensorEntry, wanted: Optional[Set[str]] = None) -> torch.Tensor:
        """The whole tensor on every rank. `wanted`, if given, limits which other tensors a
        coalesced broadcast may carry along."""
        owner = e.rank == self._group.rank
        if self._group.is_single:
            return self._local_tensor(e)
        if e.name in self._prefetched:
            self._prefetched.discard(e.name)
            return self._received.pop(e.name)
        if e.nbytes == 0 or e.nbytes > SMALL_TENSOR_BYTES:
            t = (
                self._local_tensor(e)
                if owner
                else torch.empty(e.torch_shape, dtype=e.dtype, device=self.device)
            )
            self._group.broadcast(t, e.rank, of=e.path)
            return t
        members = [e] + self._companions(e, wanted)
        offsets: List[int] = []
        size = 0
        for m in members:
            offsets.append(size)
            size += -(-m.nbytes // _ALIGN) * _ALIGN
        flat = torch.empty(size, dtype=torch.uint8, device=self.device)
        if owner:
            for m, off in zip(members, offsets):
                flat[off : off + m.nbytes].copy_(as_bytes(self._local_tensor(m)))
        self._group.broadcast(flat, e.rank, of=e.path)
        logger.debug(
            "coalesced broadcast of %d tensors (%d bytes) from %s", len(members), size, e.path
        )
        # Each small tensor gets its own memory, on the owner too: a kept norm or scale
        # must not keep a whole file (or the other small tensors) alive.
        result: Optional[torch.Tensor] = None
        for m, off in zip(members, offsets):
            t = flat[off : off + m.nbytes].view(m.dtype).view(m.torch_shape).clone()
            if m is e:
                result = t
            else:
                self._prefetched.add(m.name)
                self._received[m.name] = t
        assert result is not None
        return result

    def _companions(self, e: TensorEntry, wanted: Optional[Set[str]]) -> List[TensorEntry]:
        """Small tensors that follow `e` in its file, not yet sent, to broadcast with it."""
        names = self._files[e.path].names
        start = self._position[e.name] + 1
        budget = COALESCE_BYTES - e.nbytes
        out: List[TensorEntry] = []
        for name in names[start : start + LOOKAHEAD_NAMES]:
            m = self._entries[name]
            if (
                m.nbytes == 0
                or m.nbytes > SMALL_TENSOR_BYTES
                or name in self._prefetched
                or name in self._handed_out[e.path]
                or (wanted is not None and name not in wanted)
            ):
                continue
            if m.nbytes > budget:
                break
            out.append(m)
            budget -= -(-m.nbytes // _ALIGN) * _ALIGN
        return out

    # shards (scatter)

    def _scatter_concat(self, run: Sequence[TensorEntry], dim: int) -> torch.Tensor:
        """This rank's blocks along `dim` of the tensors in `run` (all read by one rank),
        concatenated in order, in one scatter. Blocks are padded to the first rank's (the
        largest) size for the scatter and cut back to size on arrival."""
        world, me, src = self._group.size, self._group.rank, run[0].rank
        blocks = [-(-e.torch_shape[dim] // world) for e in run]

        def length(e: TensorEntry, block: int, r: int) -> int:
            return max(0, min(e.torch_shape[dim], (r + 1) * block) - r * block)

        totals = [sum(length(e, b, r) for e, b in zip(run, blocks)) for r in range(world)]
        padded = sum(blocks)
        base = list(run[0].torch_shape)

        def shaped(n: int) -> List[int]:
            return base[:dim] + [n] + base[dim + 1 :]

        dtype = run[0].dtype
        out = torch.empty(shaped(padded), dtype=dtype, device=self.device)
        if out.numel() == 0:  # nothing to move; every rank knows it from the headers
            return torch.empty(shaped(totals[me]), dtype=dtype, device=self.device)
        chunks: Optional[List[torch.Tensor]] = None
        if me == src:
            sources = [self._local_tensor(e) for e in run]
            chunks = []
            for r in range(world):
                if len(run) == 1 and totals[r] == padded:
                    chunks.append(sources[0].narrow(dim, r * padded, padded).contiguous())
                    continue
                chunk = torch.empty(shaped(padded), dtype=dtype, device=self.device)
                pos = 0
                for e, t, b in zip(run, sources, blocks):
                    n = length(e, b, r)
                    if n:
                        _bits(chunk.narrow(dim, pos, n)).copy_(_bits(t.narrow(dim, r * b, n)))
                        pos += n
                chunks.append(chunk)
        self._group.scatter(out, chunks, src, of=run[0].path)
        if totals[me] == padded:
            return out
        return out.narrow(dim, 0, totals[me]).clone()  # own exactly this rank's bytes
