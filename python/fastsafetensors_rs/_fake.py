"""Fake (meta) kernels, so that FakeTensorMode and `torch.compile` can trace code that calls
the ops without reading any tensor data.

`fastsafetensors::load` has no tensor inputs: its outputs follow from the files' headers
alone. The fake kernel resolves directories and indexes as `load` does, reads each header
with `describe` (a few KiB, no data) and returns the names and empty tensors of the shapes
and dtypes `load` would return, in its order, on the requested device, with the same `dtype=`
and device rules. `keys`, `metadata` and `describe` return no tensors and run as they are
under fake modes. `load_with_report` has no fake kernel: how each file will be read (its
third output) is decided at run time and cannot be known from the headers.

`make_fx` and `torch.export` cannot record `load`: FX graphs keep no `str[]` output, and the
names come as one since the stable ABI has no Dict return.
"""

from __future__ import annotations

import logging
from typing import Dict, List, Optional, Tuple

import torch

from ._dtypes import CASTABLE, DTYPES, cast_dtype, torch_shape
from ._ops import checkpoint_files, describe, ops

__all__ = ["register_fake_kernels"]

logger = logging.getLogger("fastsafetensors_rs")

_registered = False


def _target_device(device: str) -> torch.device:
    target = torch.device(ops.check_device(device))  # the real op's rule and errors
    if target.type == "cuda" and target.index is None:
        # The real op loads to the current device.
        index = torch.cuda.current_device() if torch.cuda.is_available() else 0
        target = torch.device("cuda", index)
    return target


def fake_load(
    files: List[str],
    device: str = "cpu",
    dtype: Optional[torch.dtype] = None,
    reader: Optional[str] = None,
    nogds: Optional[bool] = None,
    tensor_filter: Optional[List[str]] = None,
    tensor_name_match_mode: str = "glob",
) -> Tuple[List[str], List[torch.Tensor]]:
    """What `fastsafetensors::load` returns, with empty tensors derived from the headers."""
    target = _target_device(device)
    try:
        dtype = cast_dtype(dtype)
    except ValueError as e:  # raised as the real op raises it
        raise RuntimeError(f"fastsafetensors: {e}") from None
    # The loader's own selection, from the headers alone.
    selected = None if tensor_filter is None else set(ops.selected(files, tensor_filter, tensor_name_match_mode))
    out: Dict[str, torch.Tensor] = {}
    origin: Dict[str, str] = {}
    for path in checkpoint_files(files):
        names, dtypes, shapes, _ = describe(path)  # header only; validates it
        for name, st_dtype, shape in zip(names, dtypes, shapes):
            if selected is not None and name not in selected:
                continue
            if name in out:
                raise RuntimeError(f"tensor '{name}' is in both {origin[name]} and {path}")
            if st_dtype not in DTYPES:
                raise RuntimeError(f"{path}: tensor '{name}': dtype {st_dtype} has no torch equivalent")
            if st_dtype == "F4" and (not shape or shape[-1] % 2):
                raise RuntimeError(
                    f"{path}: tensor '{name}': F4 needs an even last dimension to load as torch.float4_e2m1fn_x2")
            torch_dtype = DTYPES[st_dtype][0]
            if dtype is not None and torch_dtype in CASTABLE:
                torch_dtype = dtype
            out[name] = torch.empty(torch_shape(st_dtype, shape), dtype=torch_dtype, device=target)
            origin[name] = path
    return list(out), list(out.values())


def register_fake_kernels() -> None:
    """Registers the fake kernels (once per process)."""
    global _registered
    if _registered:
        return
    try:
        torch.library.register_fake("fastsafetensors::load")(fake_load)
    except RuntimeError as e:  # one is registered already (e.g. by the extension itself)
        logger.debug("fake kernel for fastsafetensors::load not registered: %s", e)
    _registered = True
