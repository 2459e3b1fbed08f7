"""The safetensors-style API: `load_file`, `load`, `safe_open` and `stream`, over the torch ops.

Selecting tensors (`tensor_filter`, every function here): a name, a list of names, or a
callable `name -> bool`, matched by `tensor_name_match_mode`:

- "glob" (default): shell patterns matched against the whole name, as `fnmatch.fnmatchcase`
  does: `*` any run of characters (dots included), `?` one character, `[abc]`, `[!abc]`;
- "regex": regular expressions found anywhere in the name, as `re.search` does (anchor with
  `^...$` to match the whole name). The syntax is Rust's `regex` crate, which matches in time
  linear in the name: no lookaround or backreferences;
- "exact": the names themselves. A name that is in none of the files is an error listing
  every such name.

Only the selected tensors' bytes are read (ranges a few hundred KiB apart are read together).
A glob or regex filter that selects nothing gives nothing: an empty dict, an empty iteration
(and a warning in the log), with no data read. A callable is called once per name in the
headers and selects exactly the names it returns true for.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import os
import threading
import weakref
from typing import Any, Callable, Dict, Iterable, Iterator, List, Mapping, Optional, Sequence, Tuple, TypeVar, Union

import torch

from . import _ops, distributed
from . import keep as _keep
from ._dtypes import cast_dtype
from ._errors import (INVALID_ARGUMENT, InvalidBackendError, SafetensorError, TensorKeyError, from_op, mapped_errors,
                      reraise)
from ._logging import level_from_env, redact
from ._ops import checkpoint_files, ops
from .progress import progress_from_env
from .verify import Verify
from .verify import spec as verify_spec

logger = logging.getLogger("fastsafetensors_rs")
T = TypeVar("T")

PathLike = Union[str, bytes, os.PathLike]
Device = Union[str, int, torch.device]
TensorFilter = Union[None, str, Iterable[str], Callable[[str], bool]]
ProcessGroup = Any  # a torch.distributed ProcessGroup

__all__ = ["SafetensorError", "load", "load_bytes", "load_file", "release_staging_buffers", "safe_open", "stream"]

MATCH_MODES = ("glob", "regex", "exact")
READERS = ("auto", "direct", "mmap")
ENV_MAX_MEMORY = "FASTSAFETENSORS_MAX_MEMORY"
SIZE = "bytes with an optional K/M/G/T suffix (e.g. 64G), or 'unlimited'"
_U64_MAX = 2**64 - 1


# ------------------------------------------------------------------ arguments


def _device_name(device: Device) -> str:
    """The device argument as the op's device string, checked by the op's own rule ("cpu",
    "cuda", "cuda:N"); anything else raises ValueError in one line."""
    if isinstance(device, bool) or not isinstance(device, (str, int, torch.device)):
        raise TypeError(f"device must be a string, an index or a torch.device, not {type(device).__name__}")
    if isinstance(device, int):
        if device < 0:
            raise ValueError(f"device={device}: a CUDA device index is 0 or more")
        device = f"cuda:{device}"
    try:
        return ops.check_device(str(device))
    except RuntimeError as e:
        raise ValueError(str(e)) from None


def _reader(reader: Optional[str]) -> Optional[str]:
    """The `reader=` argument, checked when the function taking it is called."""
    if reader is None:
        return None
    if not isinstance(reader, str):
        raise TypeError(f"reader must be a string or None, not {type(reader).__name__}")
    if reader not in READERS:
        raise ValueError(f"reader={reader!r} is not valid: expected 'auto', 'direct' or 'mmap' "
                         "(or None: $FASTSAFETENSORS_READER, else 'auto')")
    return reader


def _nogds(nogds: Optional[bool]) -> Optional[bool]:
    if nogds is not None and not isinstance(nogds, bool):
        raise TypeError(f"nogds must be True, False or None, not {type(nogds).__name__}")
    return nogds


# safetensors 0.8's `backend=` values, each with the reader that reads the same way: "mmap"
# maps the file, "pread" reads the bytes into memory of their own (here with parallel
# O_DIRECT preads, buffered where the file system has no O_DIRECT).
BACKENDS = {"mmap": "mmap", "pread": "direct"}


def _reader_or_backend(reader: Optional[str], backend: Optional[str]) -> Optional[str]:
    """The reader for `reader=` and safetensors' `backend=` (None: not given), which must not
    disagree. An unknown backend is refused as safetensors refuses it (SafetensorError, also
    a ValueError here)."""
    reader = _reader(reader)
    if backend is None:
        return reader
    if not isinstance(backend, str):
        raise TypeError(f"backend must be a string or None, not {type(backend).__name__}")
    chosen = BACKENDS.get(backend)
    if chosen is None:
        raise InvalidBackendError(f'backend "{backend}" is invalid (expected one of: "mmap", "pread"; '
                                  "this package's own readers are reader='auto', 'direct' or 'mmap')")
    if reader is not None and reader != chosen:
        raise ValueError(f"reader={reader!r} and backend={backend!r} (reader={chosen!r}) disagree: pass one of them")
    return chosen


def check_settings() -> None:
    """Raises ValueError naming a malformed `FASTSAFETENSORS_LOG` or `_PROGRESS`. Every load
    runs it, as the core checks its own settings (`_READER`, `_THREADS`, `_MAX_HOST_MEMORY`,
    `_MAX_MEMORY`) at every load: a malformed setting is an error, never silently a default."""
    level_from_env()
    progress_from_env()


# URL schemes the loader reads (as the core's source::remote::is_url knows them).
URL_SCHEMES = ("s3", "s3a", "gs", "az", "adl", "azure", "abfs", "abfss", "http", "https")


def is_url(path: PathLike) -> bool:
    """Whether `path` is an object URL (`s3://`, `gs://`, `az://`, `http(s)://`) rather than a
    local path."""
    if not isinstance(path, str):
        return False
    scheme, sep, _ = path.partition("://")
    return bool(sep) and scheme in URL_SCHEMES


def _path(path: PathLike) -> str:
    """One path argument as the ops take it: a str (bytes and os.PathLike decoded as
    `os.fsdecode` does), which must be UTF-8 and hold no NUL: ValueError naming any other,
    whole, in one line."""
    if isinstance(path, bytes) and b"\0" in path:
        raise ValueError(_NOT_A_PATH.format(len(path)))
    path = os.fsdecode(path)
    if "\0" in path:
        shown = os.fsencode(path).decode("utf-8", "backslashreplace").replace("\0", "\\x00")
        raise ValueError(f"{shown}: a path cannot hold a NUL character (\\x00), and no file is named so")
    try:
        path.encode("utf-8")
    except UnicodeEncodeError:
        shown = os.fsencode(path).decode("utf-8", "backslashreplace")
        raise ValueError(f"{shown}: the path is not UTF-8, and fastsafetensors_rs takes UTF-8 paths only: "
                         "rename the file, or link to it under a UTF-8 name") from None
    return path


# Bytes with a NUL are never a path (no file name holds one) and always serialized
# safetensors data (its first 8 bytes, the header's length, hold NULs for any length < 2**56).
_NOT_A_PATH = ("got {} bytes holding a NUL byte where a path goes, and no path holds one: serialized safetensors "
               "data (what safetensors.torch.load takes) loads with fastsafetensors_rs.load(data) or load_bytes(data)")


def _paths(files: Union[PathLike, Iterable[PathLike]]) -> List[str]:
    """A path, or several, as a list of `_path`s."""
    if isinstance(files, (str, bytes, os.PathLike)):
        files = [files]
    return [_path(f) for f in files]


def _filter_args(tensor_filter: TensorFilter, mode: str, paths: Sequence[str],
                 handle: int = -1) -> Tuple[Optional[List[str]], str]:
    """The op's `tensor_filter` and `tensor_name_match_mode` for the user's arguments. A callable
    is applied to every name in the headers (of the files `handle` holds open, if given) and
    becomes the exact list of the names it picks."""
    if mode not in MATCH_MODES:
        raise ValueError(f"tensor_name_match_mode={mode!r}: expected one of {', '.join(map(repr, MATCH_MODES))}")
    if tensor_filter is None:
        return None, mode
    if callable(tensor_filter):
        return [name for name in ops.selected(list(paths), None, "glob", handle) if tensor_filter(name)], "exact"
    if isinstance(tensor_filter, (str, os.PathLike)):
        return [os.fspath(tensor_filter)], mode
    patterns = list(tensor_filter)
    for p in patterns:
        if not isinstance(p, str):
            raise TypeError(f"tensor_filter: expected names or patterns (str), got {type(p).__name__} {p!r}")
    return patterns, mode


def _check_size(text: str) -> None:
    """Refuses, as ValueError, a size the loader does not take, by asking its own rule (an
    empty stream reads nothing). A malformed setting it meets on the way is left to the load
    itself to report."""
    try:
        _ops.open_stream([], "cpu", None, None, None, "glob", text)
    except RuntimeError as e:
        if str(e).startswith(INVALID_ARGUMENT):
            raise ValueError(str(e)[len(INVALID_ARGUMENT):]) from None


def _max_memory(max_memory: Union[None, int, str]) -> Optional[str]:
    """The op's `max_memory`: bytes, a size string ("256M", "2GiB", "unlimited"), or None for
    `$FASTSAFETENSORS_MAX_MEMORY` (else the default), checked by the loader's rule when the
    function taking it is called. A blank string is refused (the op would take it for None)."""
    if max_memory is None:
        return None
    if isinstance(max_memory, str):
        if not max_memory.strip():
            raise ValueError(f"max_memory={max_memory!r} is not valid: expected {SIZE} (or None for the default)")
        _check_size(max_memory)
        return max_memory
    if isinstance(max_memory, bool) or not isinstance(max_memory, int):
        raise TypeError(f"max_memory: expected bytes (int) or a size such as '256M', got {max_memory!r}")
    if max_memory < 0:
        raise ValueError(f"max_memory={max_memory}: must not be negative")
    if max_memory > _U64_MAX:
        raise ValueError(f"max_memory={max_memory} is not valid: at most {_U64_MAX} bytes (or 'unlimited')")
    return str(max_memory)


_gc_lock = threading.Lock()
_gc_holders = 0
_gc_was_enabled = False


@contextlib.contextmanager
def _gc_paused() -> Iterator[None]:
    """Pauses Python's garbage collector while a load creates its tensors: making 100k tensor
    objects would otherwise trigger hundreds of collections, each walking every object of the
    process. Collections resume afterwards (nested and concurrent loads pause it once)."""
    global _gc_holders, _gc_was_enabled
    with _gc_lock:
        if _gc_holders == 0:
            _gc_was_enabled = gc.isenabled()
            gc.disable()
        _gc_holders += 1
    try:
        yield
    finally:
        with _gc_lock:
            _gc_holders -= 1
            if _gc_holders == 0 and _gc_was_enabled:
                gc.enable()


def _report(paths: Sequence[str], read_paths: Sequence[str]) -> None:
    if not logger.isEnabledFor(logging.DEBUG) and "mmap-fallback" not in read_paths:
        return
    if len(paths) != len(read_paths):  # directories or indexes: the files they stand for
        paths = [f for p in paths for f in ops.checkpoint(p)[0]]
    fallback = [p for p, how in zip(paths, read_paths) if how == "mmap-fallback"]
    if fallback:
        logger.info("%d file(s) mapped instead of read: direct reads of every file would not fit in host memory "
                    "(FASTSAFETENSORS_MAX_HOST_MEMORY, else MemAvailable): %s", len(fallback), ", ".join(fallback))
    if logger.isEnabledFor(logging.DEBUG):
        for path, how in zip(paths, read_paths):
            logger.debug("%s: read with %s", path, how)


def _nothing_selected(patterns: Optional[List[str]], mode: str, count: int, paths: Sequence[str]) -> None:
    if patterns is not None and count == 0 and mode != "exact":
        logger.warning("tensor_filter %r (%s) selects no tensor of %d file(s)", patterns, mode, len(paths))


# ------------------------------------------------------------------ batch loads


@mapped_errors
def load(
    files: Union[PathLike, Iterable[PathLike]],
    device: Device = "cpu",
    dtype: Union[torch.dtype, str, None] = None,
    reader: Optional[str] = None,
    nogds: Optional[bool] = None,
    *,
    tensor_filter: TensorFilter = None,
    tensor_name_match_mode: str = "glob",
    process_group: Optional[ProcessGroup] = None,
    shard: Optional[Mapping[str, int]] = None,
    cache_dir: Optional[PathLike] = None,
    verify: Verify = None,
    keep: bool = False,
) -> Dict[str, torch.Tensor]:
    """Loads every tensor (or the selected ones) of one or more files into one dict.

    Args:
        files: a path or several; tensor names must be unique across them. Serialized
            safetensors data instead (`bytes` holding a NUL, which no path does, or a
            bytearray / memoryview) loads as `load_bytes(files)` does, what
            `safetensors.torch.load(data)` does. A path is a
            `.safetensors` file, a checkpoint directory (the shards its
            `*.safetensors.index.json` lists, or without an index every `*.safetensors` in
            it), or an index file (`*.json`); shards are checked against their index.
        device: where the tensors go ("cpu", "cuda", "cuda:1", an index or a torch.device).
        dtype: if given, floating-point tensors (f16, bf16, f32, f64) are cast to it on the
            device; integer, bool and quantised (float8/float4) tensors keep their dtype.
            It must be torch.float16, torch.bfloat16, torch.float32 or torch.float64, or the
            name of one ("bfloat16", "torch.bfloat16", "BF16"); other dtypes are refused.
        reader: "auto" (default: zero-copy mmap for files already in the page cache, parallel
            O_DIRECT reads otherwise), "direct" or "mmap". `$FASTSAFETENSORS_READER` sets the
            default. For CUDA targets it picks how files reach the pinned staging buffers:
            "direct" (O_DIRECT), "mmap" (through the page cache), "auto" (per file).
        nogds: CUDA only. None (default) uses GPUDirect Storage where the nvidia-fs driver
            is loaded and falls back to the staged path otherwise; True never uses it; False
            requires it and fails if a file cannot be read with it.
        tensor_filter, tensor_name_match_mode: which tensors to load (see the module
            documentation); only their bytes are read. On CUDA a filtered load reads them
            into host memory and copies them.
        process_group: a torch.distributed group whose ranks all make this same call: each
            gets every tensor, while each byte is read from storage by one rank and the rest
            exchanged over the group (see `fastsafetensors_rs.distributed`; CUDA pieces go
            through pinned staging, without GPUDirect Storage).
        shard: with `process_group`, the tensors to split over its ranks: `{glob pattern:
            dimension}`; each rank gets its block of each matching tensor (rank r of n: indices
            `[r*b, min((r+1)*b, size))`, `b = ceil(size / n)`, as `get_sharded` splits), and
            every other tensor whole. A block of rows (dimension 0) is read by its rank alone,
            only its bytes; a block along another dimension is scattered by the rank that read
            the whole tensor; each byte is still read once between the ranks. Verified, the
            load is shared as `process_group` alone shares it (each file hashed once in the
            group) and each rank keeps its blocks of what it receives.
        cache_dir: for URLs, a local directory where each object read whole is kept, keyed by
            URL and version, so that the next load of that version reads the local copy (see
            docs/remote.md). None: `$FASTSAFETENSORS_CACHE_DIR`, if set. Local files ignore it.
        verify: `fastsafetensors_rs.Signature(...)`, `fastsafetensors_rs.Digests({...})`,
            True or "full" (see `fastsafetensors_rs.verify` and docs/verify.md): every file read
            is hashed as its bytes land, and the load returns only once every file matches;
            a mismatch raises an error naming the file and no tensor is returned.
        keep: True keeps what the load read in memory that outlives the process, held by a
            keeper process of this user (started on demand), so that a later load of the same
            files, selection and device (with `verify=`, the same digests) in any process of
            this user maps it in milliseconds instead of reading; the tensors are private
            copy-on-write views of it. Where it cannot be kept (no keeper, a full
            FASTSAFETENSORS_KEEP_MEMORY budget) the load reads as without it, saying why in one
            line on stderr. See docs/keep.md.

    The tensors own their memory: no handle needs closing, and a buffer is freed when the last
    tensor into it is gone. With the "auto" reader, files whose direct reads would not fit in
    host memory are mapped instead (logged at INFO), so a load larger than memory succeeds.
    """
    if _is_serialized(files):
        given = [name for name, value in (("reader", reader), ("nogds", nogds), ("process_group", process_group),
                                          ("shard", shard), ("cache_dir", cache_dir), ("verify", verify),
                                          ("keep", keep or None))
                 if value is not None]
        if given:
            raise ValueError(f"load(data) of serialized bytes takes device, dtype and tensor_filter only, "
                             f"not {', '.join(given)} (they apply to files)")
        return load_bytes(files, device, dtype, tensor_filter=tensor_filter,
                          tensor_name_match_mode=tensor_name_match_mode)
    reader, nogds = _reader(reader), _nogds(nogds)
    keep = _keep.check_keep(keep)
    _keep.refuse_with_group(keep, process_group, shard)
    check_settings()
    paths = _paths(files)
    patterns, mode = _filter_args(tensor_filter, tensor_name_match_mode, paths)
    target, cast = _device_name(device), cast_dtype(dtype)
    cache = _cache_dir(cache_dir)
    checked = verify_spec(verify, paths)
    if shard is not None:
        if process_group is None:
            raise ValueError("shard= splits tensors over the ranks of a process_group: pass one")
        out = distributed.sharded_load(paths, target, cast, reader, patterns, mode, process_group, dict(shard),
                                       cache, checked)
    elif _shared(process_group):
        shared = distributed.SharedLoad(paths, target, cast, reader, patterns, mode, process_group, None, False,
                                        cache_dir=cache, verify=checked)
        with _gc_paused():
            out = dict(pair for buffer in shared.buffers() for pair in buffer)
    else:
        def run(load: Optional[_Interruptible]) -> Dict[str, torch.Tensor]:
            with _opened(paths, cache, load, checked) as (files, handle):
                return _load(files, target, cast, reader, nogds, patterns, mode, handle, keep)

        out = _Interruptible(target).run(run) if any(map(is_url, paths)) else run(None)
    _nothing_selected(patterns, mode, len(out), paths)
    return out


def _interruptible(work: Callable[[], T], device: str, interrupted: Callable[[], bool]) -> T:
    """`work()` on a thread of its own while this one waits, so that Ctrl-C reaches the caller
    at once however long a remote server takes. On KeyboardInterrupt, `interrupted()` is
    called: True once it has cancelled what the work waits for (then the thread is joined
    before the interrupt goes on), False to leave the thread to finish on its own. On CUDA
    the thread works on the caller's current stream."""
    outcome: Dict[str, Any] = {}
    # (Without CUDA the op itself refuses the device, with its own message.)
    cuda = device.startswith("cuda") and torch.cuda.is_available()
    stream = torch.cuda.current_stream(device) if cuda else None

    # The worker says it is done with an Event rather than by ending: a `Thread.join` that a
    # KeyboardInterrupt broke can leave the thread looking finished to every later join
    # (CPython 3.11), and a daemon thread still inside an op when the interpreter exits aborts
    # the process.
    done = threading.Event()

    def run() -> None:
        try:
            with torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext():
                outcome["value"] = work()
        except BaseException as e:  # noqa: BLE001 - raised again on the caller's thread
            outcome["error"] = e
        finally:
            done.set()

    threading.Thread(target=run, name="fastsafetensors-load", daemon=True).start()
    try:
        while not done.wait(0.1):
            pass
    except KeyboardInterrupt:
        if interrupted():
            done.wait()
        raise
    if "error" in outcome:
        raise outcome["error"]
    return outcome["value"]


class _Interruptible:
    """A load of URLs run by `_interruptible`: on Ctrl-C, the reads in flight from the load's
    handle are cancelled (they stop within 50 ms); a load still opening its files (a header's
    GET) is left to finish on its own, and its handle closed unused."""

    def __init__(self, device: str):
        self._device = device
        self._lock = threading.Lock()
        self._handle: Optional[int] = None
        self._interrupted = False

    def opened(self, handle: int) -> None:
        """The load's files are open under `handle`: from now on an interrupt cancels its reads.
        Raises KeyboardInterrupt on the load's thread if the caller was interrupted already."""
        with self._lock:
            self._handle = handle
            if self._interrupted:
                raise KeyboardInterrupt

    def _interrupt(self) -> bool:
        with self._lock:
            self._interrupted = True
            handle = self._handle
        return handle is not None and ops.cancel_handle(handle)

    def run(self, load: Callable[["_Interruptible"], T]) -> T:
        return _interruptible(lambda: load(self), self._device, self._interrupt)


def _cache_dir(cache_dir: Optional[PathLike]) -> Optional[str]:
    if cache_dir is not None and not isinstance(cache_dir, (str, os.PathLike)):
        raise TypeError(f"cache_dir= takes a directory path, not {type(cache_dir).__name__}")
    return None if cache_dir is None else os.fspath(cache_dir)


@contextlib.contextmanager
def _opened(paths: List[str], cache_dir: Optional[str], interruptible: Optional[_Interruptible] = None,
            verify: Optional[str] = None) -> Iterator[Tuple[List[str], int]]:
    """`(paths, -1)` for local paths without a `cache_dir` (the ops open the paths themselves);
    else the files they stand for, and a handle on them, opened with that cache (closed on
    exit: the loads and streams started from it keep what they read from). URLs always get
    a handle: it is what cancels their requests on Ctrl-C (`_Interruptible`). So does a
    verified load (`verify`: the op's argument): the handle checks every load from it."""
    if cache_dir is None and verify is None and not any(map(is_url, paths)):
        yield paths, -1
        return
    files = _files_of(paths)
    handle = ops.open_handle(files, cache_dir, verify)
    try:
        if interruptible is not None:
            interruptible.opened(handle)
        yield files, handle
    finally:
        ops.close_handle(handle)


def _files_of(paths: List[str]) -> List[str]:
    """The files `paths` stand for: files as they are (opening one reads its header: a second
    open would be a second GET); directories, prefixes and indexes resolved to theirs."""
    return paths if all(p.endswith(".safetensors") for p in paths) else checkpoint_files(paths)


def _shared(process_group: Optional[ProcessGroup]) -> bool:
    """Whether a load is shared: a group of more than one rank (a group of one reads alone)."""
    return process_group is not None and distributed.group_size(process_group) > 1


def _load(paths: List[str], device: str, dtype: Optional[torch.dtype], reader: Optional[str], nogds: Optional[bool],
          patterns: Optional[List[str]], mode: str, handle: int = -1, keep: bool = False) -> Dict[str, torch.Tensor]:
    """`load` of checked arguments; `handle`: the files a `safe_open` holds open, to read
    instead of opening `paths` (-1: none); `keep`: kept between processes."""
    op = ops.load_kept if keep else ops.load_named
    with _gc_paused():
        names, tensors, read_paths = op(paths, device, dtype, reader, nogds, patterns, mode, handle)
        out = dict(zip(names, tensors))
    _report(paths, read_paths)
    return out


def load_file(
    filename: PathLike,
    device: Device = "cpu",
    dtype: Union[torch.dtype, str, None] = None,
    reader: Optional[str] = None,
    nogds: Optional[bool] = None,
    *,
    tensor_filter: TensorFilter = None,
    tensor_name_match_mode: str = "glob",
    process_group: Optional[ProcessGroup] = None,
    shard: Optional[Mapping[str, int]] = None,
    cache_dir: Optional[PathLike] = None,
    backend: Optional[str] = None,
    verify: Verify = None,
    keep: bool = False,
) -> Dict[str, torch.Tensor]:
    """Loads one file (or a checkpoint directory or index), like
    `safetensors.torch.load_file`. See `load` for the arguments; `backend`: safetensors
    0.8's name for the reader, "mmap" (reader "mmap") or "pread" (reader "direct"); None
    leaves the choice to `reader`."""
    reader = _reader_or_backend(reader, backend)
    return load([filename], device=device, dtype=dtype, reader=reader, nogds=nogds, tensor_filter=tensor_filter,
                tensor_name_match_mode=tensor_name_match_mode, process_group=process_group, shard=shard,
                cache_dir=cache_dir, verify=verify, keep=keep)


def _is_serialized(files: Any) -> bool:
    """Whether `files` is serialized safetensors data rather than paths (see `_NOT_A_PATH`)."""
    return isinstance(files, (bytearray, memoryview)) or (isinstance(files, bytes) and b"\0" in files)


@mapped_errors
def load_bytes(
    data: Union[bytes, bytearray, memoryview],
    device: Device = "cpu",
    dtype: Union[torch.dtype, str, None] = None,
    *,
    tensor_filter: TensorFilter = None,
    tensor_name_match_mode: str = "glob",
) -> Dict[str, torch.Tensor]:
    """Loads the tensors of serialized safetensors data (the bytes of a `.safetensors` file,
    what `safetensors.torch.save` returns), like `safetensors.torch.load(data)`. The data
    is checked by the same rules as a file; errors name it `<bytes>`. The tensors own their
    memory: `data` can be dropped or changed afterwards. Arguments as in `load`."""
    if not isinstance(data, (bytes, bytearray, memoryview)):
        raise TypeError(f"load_bytes takes serialized safetensors data (bytes, bytearray or memoryview), not "
                        f"{type(data).__name__}: load a file with load_file(path)")
    view = memoryview(data).cast("B")
    target, cast = _device_name(device), cast_dtype(dtype)
    check_settings()
    with _anonymous_file(view) as path:
        patterns, mode = _filter_args(tensor_filter, tensor_name_match_mode, [path])
        try:
            # Mapped: the bytes are in memory already, and the tensors keep the mapping alive.
            out = _load([path], target, cast, "mmap", None, patterns, mode)
        except RuntimeError as e:
            raise from_op(str(e).replace(path, "<bytes>")) from None
    _nothing_selected(patterns, mode, len(out), ["<bytes>"])
    return out


@contextlib.contextmanager
def _anonymous_file(data: memoryview) -> Iterator[str]:
    """A path to a file in memory holding `data`, removed on exit (what was mapped from it
    stays): the loader reads paths, and the bytes must be checked as a file's are."""
    if hasattr(os, "memfd_create") and os.path.isdir("/proc/self/fd"):
        fd = os.memfd_create("fastsafetensors_rs-bytes", os.MFD_CLOEXEC)
        path = f"/proc/self/fd/{fd}"
    else:
        import tempfile

        fd, path = tempfile.mkstemp(suffix=".safetensors")
    try:
        with open(fd, "wb", closefd=False) as f:
            f.write(data)
        yield path
    finally:
        os.close(fd)
        if not path.startswith("/proc/"):
            os.unlink(path)


def release_staging_buffers() -> int:
    """Frees the pinned host memory CUDA loads keep for the next load (per GPU loaded to, up
    to 2 x FASTSAFETENSORS_THREADS buffers of 8 MiB: 128 MiB by default); returns how many
    buffers were freed. It is otherwise held until the process exits; a later load allocates
    it again."""
    return ops.release_staging_buffers()


# ------------------------------------------------------------------ streaming


@mapped_errors
def stream(
    files: Union[PathLike, Iterable[PathLike]],
    device: Device = "cpu",
    dtype: Union[torch.dtype, str, None] = None,
    reader: Optional[str] = None,
    *,
    tensor_filter: TensorFilter = None,
    tensor_name_match_mode: str = "glob",
    max_memory: Union[None, int, str] = None,
    process_group: Optional[ProcessGroup] = None,
    cache_dir: Optional[PathLike] = None,
    verify: Verify = None,
    keep: bool = False,
) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yields `(name, tensor)` for the selected tensors of `files`, in file order and within a
    file in the order of the data, each as soon as the group of tensors it was read with has
    arrived, while the reads of later groups (also in the next files) go on in the background.

    Args:
        max_memory: the most memory the stream's buffers may hold at once: bytes or a size
            ("256M", "2G", "unlimited"). None: `$FASTSAFETENSORS_MAX_MEMORY`, else 1 GiB (at
            most half the available memory). Counts buffers being read, read and waiting, and
            handed out but still referenced by a tensor. A tensor larger than the budget still
            loads, alone.
        files, device, dtype, reader, tensor_filter, tensor_name_match_mode, process_group,
        cache_dir: as in `load`. With a group, every rank must iterate to the end (or close the
            iterator at the same point): the exchange needs all of them.
        verify: as in `load`. Tensors are handed out as they arrive, and each file is checked
            once its last bytes have: a file that does not match ends the stream with that
            error before any tensor of a later file is handed out (tensors of the failing file
            may have been handed out already: use `load`, or `safe_open`, to get nothing from a
            file before it is checked). A verified stream reads whole files.
        keep: as in `load`: the tensors of a kept load, handed out in read order once it has
            returned (an attach maps them at once; the first, filling load reads the selection
            whole into the kept memory first, outside `max_memory`).

    Memory a yielded tensor keeps alive: the buffer of the group it was read with, at most
    `max(group size, its own size)`, where a group is a quarter of `max_memory`, at most 32 MiB
    (for a mapped file in the page cache, the mapping of that range). Copy it into your own
    storage (a parameter's `copy_`, or `clone()`) and drop it to give the memory back; a
    consumer that keeps every tensor still gets them all, but read one group at a time.

    Headers are read and the selection checked when this is called (errors are raised here);
    reading starts at once. Leaving the loop early (`break`, an exception) stops the reads once
    the iterator is closed (`close()`, a `with` block) or dropped.
    """
    reader, budget = _reader(reader), _max_memory(max_memory)
    if _keep.check_keep(keep):
        _keep.refuse_with_group(keep, process_group)
        return _keep.KeptTensors(load(files, device, dtype, reader, tensor_filter=tensor_filter,
                                      tensor_name_match_mode=tensor_name_match_mode, cache_dir=cache_dir,
                                      verify=verify, keep=True))
    check_settings()
    paths = _paths(files)
    patterns, mode = _filter_args(tensor_filter, tensor_name_match_mode, paths)
    target, cast = _device_name(device), cast_dtype(dtype)
    cache = _cache_dir(cache_dir)
    checked = verify_spec(verify, paths)
    if _shared(process_group):
        shared = distributed.SharedLoad(paths, target, cast, reader, patterns, mode, process_group, budget, True,
                                        cache_dir=cache, verify=checked)
        _nothing_selected(patterns, mode, shared.tensor_count, paths)
        return distributed.SharedTensors(shared)
    if any(map(is_url, paths)):
        # The iterator holds the files open: Ctrl-C while it waits cancels their requests.
        def open_remote(load: _Interruptible) -> TensorIterator:
            files = _files_of(paths)
            handle = ops.open_handle(files, cache, checked)
            try:
                load.opened(handle)
                opened = _ops.open_stream(files, target, cast, reader, patterns, mode, budget, handle)
            except BaseException:
                ops.close_handle(handle)
                raise
            return TensorIterator(opened, files=handle, device=target)

        iterator = _Interruptible(target).run(open_remote)
        _nothing_selected(patterns, mode, iterator.tensor_count, paths)
        return iterator
    with _opened(paths, cache, None, checked) as (files, handle):
        opened = _ops.open_stream(files, target, cast, reader, patterns, mode, budget, handle)
    _nothing_selected(patterns, mode, opened.tensor_count(), paths)
    return TensorIterator(opened)


class TensorIterator:
    """The iterator `stream` returns: `(name, tensor)` pairs, and how many tensors and bytes
    there are in all (`tensor_count`, `byte_count`). `close()` (or dropping it) stops the reads.
    Threads may share one: each tensor goes to exactly one of them."""

    def __init__(self, handle, files: Optional[int] = None, device: str = "cpu"):
        self._lock = threading.Lock()
        self._handle = handle
        # The handle of the files the stream reads, where it holds them (URLs): a wait for the
        # next group is then on a thread of its own, and Ctrl-C cancels their requests.
        self._files = files
        self._device = device
        if files is not None:
            # (Not at exit: the ops may be gone then, and the process lets go of everything.)
            weakref.finalize(self, ops.close_handle, files).atexit = False
        self._reported: set = set()
        self._names: List[str] = []
        self._tensors: List[Optional[torch.Tensor]] = []
        self._next = 0
        self.tensor_count: int = handle.tensor_count()
        self.byte_count: int = handle.byte_count()

    def __iter__(self) -> "TensorIterator":
        return self

    def __next__(self) -> Tuple[str, torch.Tensor]:
        with self._lock:
            try:
                return self._take()
            except RuntimeError as e:  # inline, not a decorator: this runs once per tensor
                reraise(e)

    def _take(self) -> Tuple[str, torch.Tensor]:
        while self._next == len(self._names):
            group = None
            if self._handle is not None:
                try:
                    with _gc_paused():
                        group = self._next_group()
                except KeyboardInterrupt:
                    self._drop()  # its reads cancelled: the stream is over
                    raise
            if group is None:
                self._drop()
                raise StopIteration
            self._names, self._tensors = group
            self._next = 0
            self._report_file()
        i = self._next
        self._next += 1
        # Hand each tensor over and forget it: only the consumer keeps its buffer alive.
        tensor, self._tensors[i] = self._tensors[i], None
        return self._names[i], tensor

    def _next_group(self):
        if self._files is None:
            return self._handle.next()
        files = self._files
        return _interruptible(self._handle.next, self._device, lambda: ops.cancel_handle(files))

    def _report_file(self) -> None:
        """Logs how each file is read, when its first group arrives."""
        index = self._handle.file_index()
        if index in self._reported:
            return
        self._reported.add(index)
        path, how = self._handle.file_path(), self._handle.read_path()
        if how == "mmap-fallback":
            logger.info("%s: mapped instead of read: direct reads would not fit in host memory", path)
        logger.debug("%s: read with %s", path, how)

    def close(self) -> None:
        """Stops the reads still going on and drops what was read but not handed out (after
        the group another thread is waiting for, if any, has arrived)."""
        with self._lock:
            self._drop()

    def _drop(self) -> None:
        self._handle = None
        self._names, self._tensors, self._next = [], [], 0
        if self._files is not None:
            ops.close_handle(self._files)
            self._files = None

    def __enter__(self) -> "TensorIterator":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class safe_open:
    """Opens one or several `.safetensors` files: reads their headers now, tensor data on demand.

    Mirrors `safetensors.safe_open` for one file (`keys()`, `offset_keys()`, `metadata()`,
    `get_tensor()`, `get_tensors()`, `get_slice()`, usable as a context manager; `backend=`
    as in `load_file`) and adds:

    - `tensors()`: every selected tensor, streamed in read order while later reads go on;
    - several files at once (`safe_open([a, b, c])`), as one set of names;
    - `tensor_filter` / `tensor_name_match_mode`: `keys()` and everything else see only the
      selected tensors, and only their bytes are read;
    - `max_memory`: the budget of `tensors()` (see `stream`). `get_tensor` keeps what it reads
      (until the handle is closed), so it reads without a budget; files whose direct reads
      would not fit in host memory are mapped instead, as `load` does.

    The handle opens its files when it is made and holds them until it is closed (or dropped):
    every read comes from the files it opened, as with safetensors, even if a path is replaced
    (`os.replace`, as the Hugging Face Hub client does) or deleted meanwhile. A file written to
    in place after opening fails the next read with an error naming it.

    `get_tensor(name)` streams the file holding `name` from its start on first access and
    returns as soon as `name` has arrived (reading the rest of the file goes on in the
    background); later calls find their tensors read or arriving. `get_slice(name)[a:b]` on a
    tensor not read yet reads only rows `[a, b)` from the file. Tensors stay valid after
    `close()`; the handle keeps what `get_tensor` read until it is closed. Once it is closed
    (`close()`, the end of its `with` block), every method raises `SafetensorError` ("the
    safe_open handle is closed"), as safetensors' does. With several files,
    `metadata()` is the first file's. Each path is one `.safetensors` file: a directory or an
    index is refused (load those with `load_file`). `cache_dir`: as in `load`. `verify`: as in
    `load`; a verified handle reads a file whole on its first `get_tensor` and returns its
    tensors only once the file has passed (`get_slice` rows need `full=True`, as a filtered
    `load` does). `keep`: as in `load`; a kept handle loads a file whole (kept, or attached
    to) on its first `get_tensor` or `get_slice` of it.
    """

    @mapped_errors
    def __init__(
        self,
        filename: Union[PathLike, Sequence[PathLike]],
        framework: str = "pt",
        device: Device = "cpu",
        tensor_filter: TensorFilter = None,
        tensor_name_match_mode: str = "glob",
        max_memory: Union[None, int, str] = None,
        reader: Optional[str] = None,
        nogds: Optional[bool] = None,
        cache_dir: Optional[PathLike] = None,
        *,
        backend: Optional[str] = None,
        verify: Verify = None,
        keep: bool = False,
    ):
        if framework not in ("pt", "torch", "pytorch"):
            raise ValueError(f"framework {framework!r} is not supported: only 'pt' (PyTorch)")
        self._paths = _paths(filename)
        # How messages name the files (URLs without their credentials).
        self._path = redact(self._paths[0] if len(self._paths) == 1 else ", ".join(self._paths))
        self._device = _device_name(device)
        self._reader = _reader_or_backend(reader, backend)
        self._nogds = _nogds(nogds)
        self._max_memory = _max_memory(max_memory)
        if not callable(tensor_filter):  # the arguments are checked before any file is opened
            self._patterns, self._mode = _filter_args(tensor_filter, tensor_name_match_mode, self._paths)
        self._files: Dict[int, _FileReader] = {}
        self._closed = False
        # transformers reads tensors from a thread pool: a file is read once however many ask.
        self._lock = threading.Lock()
        # The files, held open from here to close(): every op below reads them through it.
        cache = _cache_dir(cache_dir)
        checked = verify_spec(verify, self._paths)
        # A verified handle hands out a file's tensors only once the file has passed.
        self._verified = checked is not None
        # Kept: each file is loaded whole (kept, or attached to) on its first get_tensor.
        self._keep = _keep.check_keep(keep)
        self._handle: int = ops.open_handle(self._paths, cache, checked)
        try:
            if callable(tensor_filter) and self._verified:
                # The names it is asked about come from the headers: only once they are checked.
                self._patterns, self._mode = None, "glob"
                for i in range(len(self._paths)):
                    self._checked(i)
            if callable(tensor_filter):  # asked about the names of the files opened
                self._patterns, self._mode = _filter_args(tensor_filter, tensor_name_match_mode, self._paths,
                                                          self._handle)
            self._describe()
        except BaseException:
            self.close()
            raise

    def _describe(self) -> None:
        """Names, dtypes, shapes and metadata from the headers read when the files were opened."""
        self._dtypes: Dict[str, str] = {}
        self._shapes: Dict[str, List[int]] = {}
        self._file_of: Dict[str, int] = {}
        self._metadata = None
        for i, path in enumerate(self._paths):
            names, dtypes, shapes, metadata = _ops.describe(path, self._handle)
            if i == 0:
                self._metadata = metadata
            self._dtypes.update(zip(names, dtypes))
            self._shapes.update(zip(names, shapes))
            self._file_of.update((n, i) for n in names)
        if self._patterns is not None or len(self._paths) > 1:
            # The loader's own view of the selection.
            self._offset_keys: List[str] = list(ops.selected(self._paths, self._patterns, self._mode, self._handle))
            _nothing_selected(self._patterns, self._mode, len(self._offset_keys), self._paths)
        else:
            self._offset_keys = list(names) if self._paths else []
        self._selected = frozenset(self._offset_keys)

    def __enter__(self) -> "safe_open":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Lets go of the files, drops this handle's references and stops its reads; tensors
        already returned stay valid."""
        with self._lock:
            if not self._closed and hasattr(self, "_handle"):
                ops.close_handle(self._handle)
            self._closed = True
            self._files.clear()

    def __del__(self) -> None:
        # Without close(), the files are let go of with the handle. At interpreter exit the
        # ops may be gone already; the process lets go of everything then anyway.
        with contextlib.suppress(Exception):
            self.close()

    def keys(self) -> List[str]:
        self._check_open()
        self._checked_all()
        return sorted(self._offset_keys)

    def offset_keys(self) -> List[str]:
        """Names in the order of their data in the files (the order `tensors()` yields them)."""
        self._check_open()
        self._checked_all()
        return list(self._offset_keys)

    def metadata(self) -> Optional[Dict[str, str]]:
        self._check_open()
        if self._paths:
            self._checked(0)
        return None if self._metadata is None else dict(self._metadata)

    @mapped_errors
    def get_tensor(self, name: str) -> torch.Tensor:
        """The tensor `name`; repeated calls return the same tensor (clone it before writing
        if that matters)."""
        self._check(name)
        return self._reader_for(name).get(name)

    @mapped_errors
    def get_tensors(self) -> Dict[str, torch.Tensor]:
        """Every selected tensor, `{name: tensor}` in the order of `offset_keys()`, as
        safetensors 0.8's `get_tensors()` (and its `load_file`, which is this) gives them: one
        bulk load of the files the handle holds, as `load_file` reads them. The tensors are the
        caller's alone: the handle does not keep them, and `get_tensor` reads on its own."""
        self._check_open()
        check_settings()  # as every load does
        loaded = _load(self._paths, self._device, None, self._reader, self._nogds, self._patterns, self._mode,
                       self._handle)
        return {name: loaded[name] for name in self._offset_keys}

    def get_slice(self, name: str) -> "TensorSlice":
        self._check(name)
        self._checked(self._file_of[name])
        return TensorSlice(self, name)

    @mapped_errors
    def _checked(self, index: int) -> None:
        """For a verified handle: file `index` read whole and checked (and kept, for
        `get_tensor`), before anything its header says is returned (names, shapes, dtypes,
        metadata): the header places every tensor, and it is part of what is checked."""
        if self._verified:
            with self._lock:
                self._check_open()
                reader = self._files.get(index)
                if reader is None:
                    reader = self._files[index] = _FileReader(self, self._paths[index])
            reader.checked()

    def _checked_all(self) -> None:
        for i in range(len(self._paths)):
            self._checked(i)

    def tensors(self, process_group: Optional[ProcessGroup] = None) -> Iterator[Tuple[str, torch.Tensor]]:
        """Every selected tensor as `(name, tensor)`, in read order, each as soon as its bytes
        have arrived while later reads go on (see `stream`, which this is, for the memory a
        tensor keeps alive, and for `process_group`). Independent of `get_tensor`: each call
        reads the files again."""
        self._check_open()
        check_settings()  # as every load does
        if _shared(process_group):
            return distributed.SharedTensors(distributed.SharedLoad(
                self._paths, self._device, None, self._reader, self._patterns, self._mode, process_group,
                self._max_memory, True, self._handle))
        return TensorIterator(_ops.open_stream(self._paths, self._device, None, self._reader, self._patterns,
                                               self._mode, self._max_memory, self._handle))

    def _check(self, name: str) -> None:
        self._check_open()
        if name not in self._selected:
            why = "not selected by tensor_filter" if name in self._dtypes else "no tensor named"
            raise TensorKeyError(f"{self._path}: {why} '{name}'")

    def _check_open(self) -> None:
        if self._closed:
            raise SafetensorError(f"{self._path}: the safe_open handle is closed")

    def _reader_for(self, name: str) -> "_FileReader":
        index = self._file_of[name]
        with self._lock:
            self._check_open()
            reader = self._files.get(index)
            if reader is None:
                reader = self._files[index] = _FileReader(self, self._paths[index])
            return reader

    def _arrived(self, name: str) -> Optional[torch.Tensor]:
        with self._lock:
            reader = self._files.get(self._file_of[name])
        return None if reader is None else reader.arrived.get(name)


class _FileReader:
    """The tensors of one file of a `safe_open` handle, kept once read. On the CPU the file is
    streamed from its start on the first request, which then waits only for the group holding
    its tensor; for CUDA, or a verified handle, it is loaded in one bulk load (GPUDirect Storage
    or staged copies; verified before anything of it is returned)."""

    def __init__(self, handle: safe_open, path: str):
        # Not a reference: the handle holds its readers, and a cycle would keep a dropped handle
        # (and the files it holds open) until the garbage collector runs. It is alive whenever
        # `get` runs, since its caller holds it.
        self._handle = weakref.proxy(handle)
        self._path = path
        self._stream = None
        self.arrived: Dict[str, torch.Tensor] = {}
        self._checked = False  # read whole (and verified, for a verified handle)
        self._lock = threading.Lock()

    def checked(self) -> None:
        """A verified handle's file, read whole and checked once (a file with none of the
        selected tensors is checked all the same, its tensors let go)."""
        with self._lock:
            if not self._checked:
                self._load_whole()

    def _load_whole(self) -> None:
        h = self._handle
        check_settings()  # as every load does
        selected = any(h._file_of.get(n) == h._paths.index(self._path) for n in h._selected) \
            if h._patterns is not None else True
        loaded = _load([self._path], h._device, None, h._reader, h._nogds, h._patterns if selected else None,
                       h._mode, h._handle, h._keep)
        self.arrived = loaded if selected else {}
        self._checked = True

    def get(self, name: str) -> torch.Tensor:
        with self._lock:
            if name in self.arrived:
                return self.arrived[name]
            h = self._handle
            if h._device != "cpu" or h._verified or h._keep:
                self._load_whole()
            elif self._stream is None:
                check_settings()  # as every load does
                # No budget: the handle keeps everything it reads (files that would not fit in
                # host memory are mapped instead, as in `load`).
                self._stream = _open_stream([self._path], h._device, h._reader, h._patterns, h._mode, "unlimited",
                                            h._handle)
            while name not in self.arrived:
                with _gc_paused():
                    group = self._stream.next() if self._stream is not None else None
                if group is None:
                    raise RuntimeError(f"{redact(self._path)}: internal error: '{name}' was not read")
                self.arrived.update(zip(*group))
            return self.arrived[name]


def _open_stream(paths: List[str], device: str, reader: Optional[str], patterns: Optional[List[str]], mode: str,
                 max_memory: Optional[str], handle: int):
    """The op's stream of files `handle` holds open; one place, so that tests can count the
    streams opened."""
    return _ops.open_stream(paths, device, None, reader, patterns, mode, max_memory, handle)


def _rows(index, shape: Sequence[int]) -> Optional[Tuple[int, int, tuple]]:
    """For an index whose first element is a step-1 slice of a proper part of the rows:
    (start, stop, the index of the remaining dimensions). None for any other index."""
    first, rest = (index[0], index[1:]) if isinstance(index, tuple) and index else (index, ())
    if not isinstance(first, slice) or first.step not in (None, 1) or not shape:
        return None
    start, stop, _ = first.indices(shape[0])
    stop = max(start, stop)
    if stop - start == shape[0]:
        return None
    return start, stop, rest


class TensorSlice:
    """A tensor's shape and dtype without loading it; indexing loads and slices. Indexing a
    range of rows of a tensor not read yet (`[a:b]`, `[a:b, ...]`) reads only those rows."""

    def __init__(self, handle: safe_open, name: str):
        self._handle = handle
        self._name = name

    def get_shape(self) -> List[int]:
        return list(self._handle._shapes[self._name])

    def get_dtype(self) -> str:
        """The safetensors dtype name, e.g. "BF16" or "F8_E4M3"."""
        return self._handle._dtypes[self._name]

    @mapped_errors
    def __getitem__(self, index) -> torch.Tensor:
        h = self._handle
        rows = None if self.get_dtype() == "F4" and len(self.get_shape()) < 2 else _rows(index, self.get_shape())
        if rows is not None and h._arrived(self._name) is None and not h._keep:
            h._check_open()
            check_settings()
            start, stop, rest = rows
            part = ops.load_rows(h._paths[h._file_of[self._name]], self._name, start, stop, h._reader, h._handle)
            if h._device != "cpu":
                part = part.to(h._device)
            return part[(slice(None),) + rest].contiguous() if rest else part
        return h.get_tensor(self._name)[index].contiguous()

    def __len__(self) -> int:
        shape = self.get_shape()
        if not shape:
            raise TypeError("len() of a 0-d tensor")
        return shape[0]
