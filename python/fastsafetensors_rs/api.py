"""The safetensors-style API: `load_file`, `load` and `safe_open`, over the torch ops."""

from __future__ import annotations

import logging
import os
import threading
from typing import Dict, Iterable, List, Optional, Union

import torch

from ._dtypes import cast_dtype
from ._logging import level_from_env
from ._ops import ops
from .progress import progress_from_env

logger = logging.getLogger("fastsafetensors_rs")

PathLike = Union[str, os.PathLike]
Device = Union[str, int, torch.device]

__all__ = ["load", "load_file", "release_staging_buffers", "safe_open"]


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


def check_settings() -> None:
    """Raises ValueError naming a malformed `FASTSAFETENSORS_LOG` or `_PROGRESS`. Every load
    runs it, as the core checks its own settings (`_READER`, `_THREADS`, `_MAX_HOST_MEMORY`)
    at every load: a malformed setting is an error, never silently a default."""
    level_from_env()
    progress_from_env()


def load(
    files: Union[PathLike, Iterable[PathLike]],
    device: Device = "cpu",
    dtype: Union[torch.dtype, str, None] = None,
    reader: Optional[str] = None,
    nogds: Optional[bool] = None,
) -> Dict[str, torch.Tensor]:
    """Loads every tensor of one or more files into one dict.

    Args:
        files: a path or several; tensor names must be unique across them. A path is a
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

    The tensors own their memory: no handle needs closing, and a file's buffer is freed when
    the last tensor into it is gone.
    """
    check_settings()
    if isinstance(files, (str, os.PathLike)):
        files = [files]
    paths: List[str] = [os.fspath(f) for f in files]
    tensors, read_paths = ops.load_with_report(paths, _device_name(device), cast_dtype(dtype), reader, nogds)
    if logger.isEnabledFor(logging.DEBUG):
        for path, how in zip(paths, read_paths):
            logger.debug("%s: read with %s", path, how)
    return tensors


def load_file(
    filename: PathLike,
    device: Device = "cpu",
    dtype: Union[torch.dtype, str, None] = None,
    reader: Optional[str] = None,
    nogds: Optional[bool] = None,
) -> Dict[str, torch.Tensor]:
    """Loads one file (or a checkpoint directory or index), like
    `safetensors.torch.load_file`. See `load` for the arguments."""
    return load([filename], device=device, dtype=dtype, reader=reader, nogds=nogds)


def release_staging_buffers() -> int:
    """Frees the pinned host memory CUDA loads keep for the next load (per GPU loaded to, up
    to 2 x FASTSAFETENSORS_THREADS buffers of 8 MiB: 128 MiB by default); returns how many
    buffers were freed. It is otherwise held until the process exits; a later load allocates
    it again."""
    return ops.release_staging_buffers()


class safe_open:
    """Reads a file's header on open; loads its data in bulk on first access.

    Mirrors `safetensors.safe_open`: `keys()`, `metadata()`, `get_tensor()`, `get_slice()`,
    usable as a context manager. Tensors stay valid after `close()`. It opens one
    `.safetensors` file: a directory or an index is refused (load those with `load_file`).
    """

    def __init__(
        self,
        filename: PathLike,
        framework: str = "pt",
        device: Device = "cpu",
        reader: Optional[str] = None,
        nogds: Optional[bool] = None,
    ):
        if framework not in ("pt", "torch", "pytorch"):
            raise ValueError(f"framework {framework!r} is not supported: only 'pt' (PyTorch)")
        self._path = os.fspath(filename)
        self._device = _device_name(device)
        self._reader = reader
        self._nogds = nogds
        names, dtypes, shapes, metadata = ops.describe(self._path)
        self._offset_keys: List[str] = list(names)
        self._dtypes = dict(zip(names, dtypes))
        self._shapes = dict(zip(names, shapes))
        self._metadata = None if metadata is None else dict(metadata)
        self._tensors: Optional[Dict[str, torch.Tensor]] = None
        self._closed = False
        # transformers reads tensors from a thread pool: the first access loads once.
        self._loading = threading.Lock()

    def __enter__(self) -> "safe_open":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        """Drops this handle's references; tensors already returned stay valid."""
        self._closed = True
        self._tensors = None

    def keys(self) -> List[str]:
        return sorted(self._offset_keys)

    def offset_keys(self) -> List[str]:
        """Names in the order of their data in the file."""
        return list(self._offset_keys)

    def metadata(self) -> Optional[Dict[str, str]]:
        return None if self._metadata is None else dict(self._metadata)

    def get_tensor(self, name: str) -> torch.Tensor:
        """The tensor `name`. All of the file is loaded on the first call, in one bulk read;
        repeated calls return the same tensor (clone it before writing if that matters)."""
        self._check(name)
        with self._loading:
            if self._closed:
                raise RuntimeError(f"{self._path}: the safe_open handle is closed")
            if self._tensors is None:
                self._tensors = load([self._path], device=self._device, reader=self._reader, nogds=self._nogds)
            return self._tensors[name]

    def get_slice(self, name: str) -> "TensorSlice":
        self._check(name)
        return TensorSlice(self, name)

    def _check(self, name: str) -> None:
        if name not in self._dtypes:
            raise KeyError(f"{self._path}: no tensor named '{name}'")


class TensorSlice:
    """A tensor's shape and dtype without loading it; indexing loads and slices."""

    def __init__(self, handle: safe_open, name: str):
        self._handle = handle
        self._name = name

    def get_shape(self) -> List[int]:
        return list(self._handle._shapes[self._name])

    def get_dtype(self) -> str:
        """The safetensors dtype name, e.g. "BF16" or "F8_E4M3"."""
        return self._handle._dtypes[self._name]

    def __getitem__(self, index) -> torch.Tensor:
        return self._handle.get_tensor(self._name)[index].contiguous()

    def __len__(self) -> int:
        shape = self.get_shape()
        if not shape:
            raise TypeError("len() of a 0-d tensor")
        return shape[0]
