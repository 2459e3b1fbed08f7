"""Loads the compiled extension, which registers the `torch.ops.fastsafetensors` ops."""

import glob
import importlib.machinery
import os

import torch

_HERE = os.path.dirname(os.path.abspath(__file__))


def _library_path() -> str:
    for suffix in importlib.machinery.EXTENSION_SUFFIXES:
        candidates = glob.glob(os.path.join(_HERE, "_C" + suffix))
        if candidates:
            return candidates[0]
    raise ImportError(
        f"fastsafetensors: the compiled extension _C is missing from {_HERE}; "
        "build it with `pip install --no-build-isolation -e .` (or `make build`)"
    )


LIBRARY_PATH = _library_path()
torch.ops.load_library(LIBRARY_PATH)
ops = torch.ops.fastsafetensors
