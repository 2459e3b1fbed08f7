"""Loads the compiled extension, which registers the `torch.ops.fastsafetensors` ops."""

import glob
import importlib.machinery
import json
import os
from typing import List, Sequence

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
    """Refuses, with both versions and the rebuild command, an extension compiled against a
    torch whose C++ ABI differs from the running one (see `_build_info`)."""
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
