"""`SafeTensorsFileLoader` and `fastsafe_open`: the entry points of the fastsafetensors 0.5
API, over `fastsafetensors_rs.load`."""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import Any, Dict, List, Mapping, Optional, Sequence, Tuple, Union

import torch
import torch.distributed as dist

from .. import api as _api
from .. import keep as _keep
from .._dtypes import cast_dtype
from .._errors import mapped_errors
from .._ops import describe
from ..verify import spec as verify_spec
from .buffer import FileEntry, FilesBufferOnDevice, TensorEntry, TensorNotFoundError
from .collectives import Group
from .types import (
    DType,
    Device,
    DTypeLike,
    as_torch_dtype,
    loaded_dtype,
    nbytes_of,
    resolve_device,
    torch_dtype_of,
    torch_shape,
)

logger = logging.getLogger("fastsafetensors_rs.compat")

PathLike = Union[str, bytes, os.PathLike]
_FRAMEWORKS = ("pytorch", "pt", "torch")


@dataclass(frozen=True)
class _Header:
    path: str
    rank: int
    names: Tuple[str, ...]  # data order
    st_dtypes: Tuple[str, ...]
    shapes: Tuple[Tuple[int, ...], ...]
    metadata: Optional[Dict[str, str]]


@mapped_errors
def read_header(path: str, rank: int) -> _Header:
    """The header of `path` (no tensor data is read); errors name the file."""
    names, dtypes, shapes, metadata = describe(path)
    return _Header(
        path=path,
        rank=rank,
        names=tuple(names),
        st_dtypes=tuple(dtypes),
        shapes=tuple(tuple(int(d) for d in s) for s in shapes),
        metadata=metadata,
    )


@dataclass
class LoadPlan:
    """Who reads what, and what every tensor looks like once loaded."""

    files: List[FileEntry]
    entries: Dict[str, TensorEntry]
    own_paths: List[str]
    device: torch.device
    cast: Optional[torch.dtype]
    reader: Optional[str]
    # What each rank's own files are verified against (`fastsafetensors_rs.load`'s verify=).
    verify: Any = None
    # Whether each rank's own files are kept between processes (`fastsafetensors_rs.load`'s keep=).
    keep: bool = False

    @classmethod
    def make(
        cls,
        headers: Sequence[_Header],
        rank: int,
        device: torch.device,
        cast: Optional[torch.dtype],
        reader: Optional[str],
        verify: Any = None,
        keep: bool = False,
    ) -> "LoadPlan":
        files: List[FileEntry] = []
        entries: Dict[str, TensorEntry] = {}
        lidx: Dict[int, int] = {}
        for h in sorted(headers, key=lambda h: h.rank):  # stable: keeps each rank's order
            index = lidx.get(h.rank, 0)
            lidx[h.rank] = index + 1
            files.append(FileEntry(h.path, h.rank, index, h.names, h.metadata))
            for name, st_dtype, shape in zip(h.names, h.st_dtypes, h.shapes):
                dtype = loaded_dtype(torch_dtype_of(st_dtype, name, h.path), cast)
                tshape = torch_shape(st_dtype, shape)
                entries[name] = TensorEntry(
                    name, h.path, h.rank, index, st_dtype, shape, dtype, tshape,
                    nbytes_of(dtype, tshape),
                )
        own = [f.path for f in files if f.rank == rank]
        return cls(files, entries, own, device, cast, reader, verify, keep)

    def read_own(self) -> Dict[str, torch.Tensor]:
        """Reads this rank's files in one bulk load (no collective: safe on any thread)."""
        if not self.own_paths:
            return {}
        return _api.load(self.own_paths, device=self.device, dtype=self.cast, reader=self.reader, verify=self.verify,
                         keep=self.keep)


def open_buffer(
    plan: Optional[LoadPlan],
    local: Optional[Dict[str, torch.Tensor]],
    error: Optional[BaseException],
    pg: Any,
    device: torch.device,
) -> FilesBufferOnDevice:
    """The buffer over a plan whose own files were read (`local`) or failed (`error`).

    Every rank learns whether all ranks succeeded before any tensor moves: a failure on
    one rank is raised on all of them, instead of leaving the others in a collective."""
    group = Group(pg)
    try:
        failed = group.failed_ranks(error is None, device, of=_files_named(plan)) if not group.is_single else []
    except RuntimeError as e:
        if error is not None:
            raise error from e  # this rank's own failure says more than the group's
        raise
    if error is not None:
        raise error
    if failed:
        raise RuntimeError(
            f"rank(s) {failed} of the process group could not read their files; their own "
            "error says why"
        )
    assert plan is not None and local is not None
    return FilesBufferOnDevice(plan.files, plan.entries, local, pg, device)


def _files_named(plan: Optional[LoadPlan]) -> str:
    """The plan's files as an error names them: the first, and how many more."""
    paths = [f.path for f in plan.files] if plan is not None else []
    if not paths:
        return "the loader's files"
    return paths[0] + (f" and {len(paths) - 1} more file{'s' * (len(paths) > 2)}" if len(paths) > 1 else "")


def _enable_debug_log() -> None:
    logger.setLevel(logging.DEBUG)
    if not logger.handlers:
        handler = logging.StreamHandler()
        handler.setFormatter(logging.Formatter("[fastsafetensors] %(message)s"))
        logger.addHandler(handler)


class SafeTensorsFileLoader:
    r"""Loads .safetensors files for one process of a (possibly) distributed program.

    Register files per rank with `add_filenames({rank: [paths]})`; `copy_files_to_device()`
    makes each rank read its own files (one bulk read) and returns a `FilesBufferOnDevice`
    that hands tensors out, broadcast or sharded over torch.distributed.

    Args:
        pg: a `torch.distributed.ProcessGroup` (gloo on CPU, NCCL on GPU), or `SingleGroup()`
            or None for one process.
        device: "cpu", "cuda", "cuda:N", an index or a torch.device. Indices are local to
            the node: "cuda" means this process's GPU (the current device, else
            `$LOCAL_RANK`), and a `cuda:{global_rank}` that does not exist on this node is
            mapped to the local GPU (see `resolve_device`).
        bbuf_size_kb, max_threads: accepted for compatibility. Reads are parallel direct
            reads sized by the core; `$FASTSAFETENSORS_THREADS` sets its I/O threads.
        nogds: accepted. Whether GPUDirect Storage is used is the core's per-file reader
            choice; with nogds=False nothing fails on machines without it.
        set_numa: accepted; the core does not pin threads or memory to NUMA nodes.
        disable_cache: accepted. Shards are never cached: a repeated request repeats the
            collective (the original's cache doubled memory when enabled).
        debug_log: logs each step on the "fastsafetensors_rs.compat" logger.
        framework: "pytorch" (or "pt"); other frameworks are not supported.
        reader: the core's reader, "auto" (default), "direct" or "mmap" (this
            implementation's own option).
        verify: what each rank's files are verified against, as `fastsafetensors_rs.load`'s
            `verify=` (a `Signature`, `Digests`, True): every file is checked once, by the
            rank that reads it, and a mismatch fails `copy_files_to_device` on every rank.
        keep: each rank's files kept between processes, as `fastsafetensors_rs.load`'s
            `keep=` (docs/keep.md): a restarted job's ranks attach to what they read before.
        **kwargs: other options of the original (e.g. `max_pinned_memory_in_kb`) are
            accepted and ignored.

    Example:
        >>> loader = SafeTensorsFileLoader(SingleGroup(), "cpu")
        >>> loader.add_filenames({0: ["model.safetensors"]})
        >>> fb = loader.copy_files_to_device()
        >>> w = fb.get_tensor("lm_head.weight")
        >>> fb.close(); loader.close()   # optional: w stays valid either way
    """

    def __init__(
        self,
        pg: Any,
        device: Device = "cpu",
        bbuf_size_kb: int = 16 * 1024,
        max_threads: int = 16,
        nogds: bool = False,
        set_numa: bool = True,
        disable_cache: bool = True,
        debug_log: bool = False,
        framework: str = "pytorch",
        *,
        reader: Optional[str] = None,
        verify: Any = None,
        keep: bool = False,
        **kwargs: Any,
    ):
        if framework not in _FRAMEWORKS:
            raise ValueError(f"framework {framework!r} is not supported: only 'pytorch'")
        if debug_log:
            _enable_debug_log()
        if kwargs:
            logger.debug("ignored options: %s", ", ".join(sorted(kwargs)))
        self.pg = pg
        self._group = Group(pg)
        hints = [self._group.rank]
        if dist.is_available() and dist.is_initialized():
            hints.append(dist.get_rank())
        self.device: torch.device = resolve_device(device, hints)
        self.nogds = nogds
        self.reader = _api._reader(reader)
        # Each rank verifies the files it reads (so the group checks each file once), and a
        # mismatch on one rank fails copy_files_to_device on every rank.
        verify_spec(verify)  # malformed: raised here
        self.verify = verify
        # Each rank's own files kept between processes (docs/keep.md): a restarted job attaches.
        self.keep = _keep.check_keep(keep)
        self._headers: Dict[str, _Header] = {}
        self._owner_of: Dict[str, str] = {}  # tensor name -> path

    def reset(self) -> None:
        """Forgets every registered file, to load another set with the same loader."""
        self._headers = {}
        self._owner_of = {}

    def close(self) -> None:
        """Forgets the registered files and lets go of the process group; the loader takes
        no more files. Buffers and tensors already made stay valid. Idempotent."""
        self.reset()
        self.pg = None
        self._group.release()

    def _check_open(self, what: str) -> None:
        if self._group.released:
            raise RuntimeError(f"{what}: the loader is closed; make a new SafeTensorsFileLoader")

    def get_keys(self) -> List[str]:
        """The names of all tensors of all registered files."""
        return [n for h in self._ordered_headers() for n in h.names]

    def get_shape(self, tensor_name: str) -> List[int]:
        """A tensor's shape, from its file's header."""
        path = self._owner_of.get(tensor_name)
        if path is None:
            raise TensorNotFoundError(f"tensor '{tensor_name}' is in none of the registered files")
        h = self._headers[path]
        return list(h.shapes[h.names.index(tensor_name)])

    def add_filenames(self, filenames: Mapping[int, Sequence[PathLike]]) -> None:
        """Registers files and the rank that reads each: `{rank: [paths]}`. Every rank must
        register the same mapping; each reads only its own files' data (all ranks read every
        header). Tensor names must be unique across files."""
        self._check_open("add_filenames")
        for rank, paths in filenames.items():
            is_rank = isinstance(rank, int) and not isinstance(rank, bool)
            if not is_rank or not 0 <= rank < self._group.size:
                raise ValueError(
                    f"add_filenames: rank {rank!r} is not a rank of the process group "
                    f"(size {self._group.size})"
                )
            for path in _api._paths(paths):
                known = self._headers.get(path)
                if known is not None and known.rank != rank:
                    raise ValueError(
                        f"add_filenames: {path} is given to ranks {known.rank} and {rank}"
                    )
                header = read_header(path, rank)
                for name in header.names:
                    other = self._owner_of.get(name)
                    if other is not None and other != path:
                        raise ValueError(
                            f"add_filenames: tensor '{name}' is in both {other} and {path}; "
                            "names must be unique across files"
                        )
                if known is not None:  # registered again: forget the old names
                    for name in known.names:
                        self._owner_of.pop(name, None)
                self._headers[path] = header
                for name in header.names:
                    self._owner_of[name] = path
                if rank == self._group.rank:
                    logger.debug("add_filenames: %s (%d tensors)", path, len(header.names))

    def copy_files_to_device(
        self,
        dtype: DTypeLike = DType.AUTO,
        use_buf_register: bool = True,
        max_copy_block_size: int = 16 * 1024 * 1024 * 1024,
    ) -> FilesBufferOnDevice:
        """Each rank reads its own files to `device` (one bulk read) and gets the buffer that
        hands the tensors out.

        Args:
            dtype: cast floating-point tensors (F16, BF16, F32, F64) to this dtype as they
                load, before anything is sent; integer, bool and quantised tensors keep
                theirs. One of F16, BF16, F32, F64 as a `DType`, a `torch.dtype` or a name;
                other dtypes are refused (as by `fastsafetensors_rs.load`); `DType.AUTO`
                keeps every dtype.
            use_buf_register, max_copy_block_size: accepted for compatibility; the core
                plans its own reads.
        """
        self._check_open("copy_files_to_device")
        plan = self._plan(cast_dtype(as_torch_dtype(dtype)))  # refused on every rank alike
        if self.device.type == "cuda":
            torch.cuda.set_device(self.device)
        local, error = None, None
        try:
            local = plan.read_own()
            logger.debug("copy_files_to_device: read %s to %s", plan.own_paths, self.device)
        except Exception as exc:  # reported to every rank by open_buffer
            error = exc
        return open_buffer(plan, local, error, self.pg, self.device)

    def _ordered_headers(self) -> List[_Header]:
        return sorted(self._headers.values(), key=lambda h: h.rank)

    def _plan(self, cast: Optional[torch.dtype]) -> LoadPlan:
        return LoadPlan.make(
            self._ordered_headers(), self._group.rank, self.device, cast, self.reader, self.verify, self.keep
        )


class fastsafe_open:
    """Opens one or more files and loads them at once; `safe_open` for a list of files.

    Args:
        filenames: a path, a list of paths, or `{rank: [paths]}` for several ranks.
        framework: "pt" (or "pytorch").
        pg: a process group when `filenames` spreads files over ranks; None for one process.
        device: where the tensors go (see `SafeTensorsFileLoader`).
        nogds, debug_log, max_copy_block_size: as for `SafeTensorsFileLoader`.

    `keys()`, `metadata()` ({path: the file's `__metadata__`, None where a header has none
    or a null one}), `get_tensor(name)`. Tensors stay valid after the handle is closed.
    """

    def __init__(
        self,
        filenames: Union[PathLike, Sequence[PathLike], Mapping[int, Sequence[PathLike]]],
        framework: str = "pt",
        pg: Any = None,
        device: Device = "cpu",
        nogds: bool = False,
        debug_log: bool = False,
        max_copy_block_size: int = 16 * 1024 * 1024 * 1024,
        **kwargs: Any,
    ):
        self.loader = SafeTensorsFileLoader(
            pg, device, nogds=nogds, debug_log=debug_log, framework=framework, **kwargs
        )
        if isinstance(filenames, (str, bytes, os.PathLike)):
            file_dict: Mapping[int, Sequence[PathLike]] = {0: [filenames]}
        elif isinstance(filenames, Mapping):
            file_dict = filenames
        else:
            file_dict = {0: list(filenames)}
        self.loader.add_filenames(file_dict)
        self._metadata = {h.path: h.metadata for h in self.loader._ordered_headers()}
        self.fb: Optional[FilesBufferOnDevice] = self.loader.copy_files_to_device(
            max_copy_block_size=max_copy_block_size
        )
        self._keys = self.fb.keys()

    def metadata(self) -> Dict[str, Optional[Dict[str, str]]]:
        return {path: None if m is None else dict(m) for path, m in self._metadata.items()}

    def keys(self) -> List[str]:
        return list(self._keys)

    def get_tensor(self, name: str) -> torch.Tensor:
        if self.fb is None:
            raise RuntimeError(f"fastsafe_open is closed: cannot get tensor '{name}'")
        return self.fb.get_tensor(name)

    def close(self) -> None:
        if self.fb is not None:
            self.fb.close()
            self.fb = None
        self.loader.close()

    def __enter__(self) -> "fastsafe_open":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
