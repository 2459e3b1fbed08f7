"""Loads the compiled extension, which registers the `torch.ops.fastsafetensors` ops, and
holds the package's few adapters to their schemas (lists where Python wants a dict, a handle
where it wants an object: the schemas the stable ABI can express)."""

import glob
import importlib.machinery
import json
import os
import weakref
from typing import Dict, List, Optional, Sequence, Tuple

import torch

from . import _build_info

_HERE = os.path.dirname(os.path.abspath(__file__))


def _library_path() -> str:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidates = glob.glob(os.path.join(_HERE, "_C" + suffix))
        if candidates:
            return candidates[0]
    raise ImportError(
        f"fastsafetensors_rs: the compiled extension _C is missing from {_HERE}; "
        "build it with `pip install --no-build-isolation .` (or `make build`)"
    )


def _check_built_for_this_torch() -> None:
    """Refuses, naming both torch versions and what to do, a library that cannot load under the
    running torch: a stable-ABI one under a torch older than its minimum, a per-torch one under
    another torch release (see `_build_info`)."""
    path = os.path.join(_HERE, _build_info.FILE)
    try:
        with open(path, encoding="utf-8") as f:
            built = json.load(f)
    except (OSError, ValueError) as e:
        raise ImportError(
            f"fastsafetensors_rs: {path} (which torch the extension was compiled against) is missing "
            f"or unreadable ({e}); rebuild: {_build_info.REBUILD}"
        ) from None
    problem = _build_info.incompatibility(built, _build_info.describe(torch))
    if problem:
        raise ImportError(problem)


def _point_at_cufile() -> None:
    """Lets the loader find the cuFile library the CUDA wheels ship (as libcufile.so.0, a
    name no default search finds) unless the user chose one."""
    if os.environ.get("FASTSAFETENSORS_CUFILE"):
        return
    site_packages = os.path.dirname(os.path.dirname(torch.__file__))
    found = sorted(glob.glob(os.path.join(site_packages, "nvidia", "*", "lib", "libcufile.so*")))
    if found:
        os.environ["FASTSAFETENSORS_CUFILE"] = found[0]


LIBRARY_PATH = _library_path()
_check_built_for_this_torch()
_point_at_cufile()
torch.ops.load_library(LIBRARY_PATH)
ops = torch.ops.fastsafetensors


def describe(path: str, handle: int = -1) -> Tuple[List[str], List[str], List[List[int]], Optional[Dict[str, str]]]:
    """`describe`'s names, dtypes and shapes (offset order), and the metadata as a dict (None
    where the header has no `__metadata__`)."""
    names, dtypes, shapes, keys, values = ops.describe(path, handle)
    return names, dtypes, shapes, None if keys is None else dict(zip(keys, values))


class Stream:
    """A stream the op opened (`open_stream` gives its handle), as the package uses it: `next()`
    gives the next group's `(names, tensors)`, None after the last. Dropping it, or `close()`,
    stops its reads (the op closes a stream itself once it is read to its end)."""

    def __init__(self, handle: int):
        self.handle = handle
        self._close = weakref.finalize(self, ops.close_stream, handle)

    def next(self) -> Optional[Tuple[List[str], List[torch.Tensor]]]:
        names, tensors = ops.stream_next(self.handle)
        if names:
            return names, tensors
        self._close.detach()  # closed by the op at its end
        return None

    def read_path(self) -> str:
        return ops.stream_info(self.handle)[0]

    def file_index(self) -> int:
        return ops.stream_info(self.handle)[1]

    def file_path(self) -> str:
        return ops.stream_info(self.handle)[2]

    def tensor_count(self) -> int:
        return ops.stream_info(self.handle)[3]

    def byte_count(self) -> int:
        return ops.stream_info(self.handle)[4]

    def close(self) -> None:
        self._close()


def open_stream(*args) -> Stream:
    """`open_stream` (the op's arguments), as a `Stream`."""
    return Stream(ops.open_stream(*args))


def checkpoint_files(paths: Sequence[str]) -> List[str]:
    """The files `paths` (files, checkpoint directories, indexes) stand for, as the load op
    resolves them, failing on the first problem it would fail on."""
    files: List[str] = []
    for path in paths:
        found, _, problems = ops.checkpoint(path)
        if problems:
            raise RuntimeError(problems[0])
        files.extend(found)
    return files
