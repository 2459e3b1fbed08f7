"""The small types of the fastsafetensors 0.5 API and the rules shared by its classes:
the `DType` enum, `SingleGroup`, dtype conversion and device resolution."""

from __future__ import annotations

import logging
import math
import os
from enum import Enum
from typing import Dict, Mapping, Optional, Sequence, Set, Tuple, Union

import torch

from .._dtypes import CASTABLE, DTYPES, dtype_from_name
from .._ops import ops

logger = logging.getLogger("fastsafetensors_rs.compat")

Device = Union[str, int, torch.device]


class DType(Enum):
    """Data types by their safetensors names, as `copy_files_to_device(dtype=...)`,
    `get_tensor(dtype=...)` and friends take them. `AUTO` keeps the file's dtype.

    Every argument that takes a `DType` also takes a `torch.dtype`."""

    BOOL = "BOOL"
    I8 = "I8"
    I16 = "I16"
    I32 = "I32"
    I64 = "I64"
    U8 = "U8"
    U16 = "U16"
    U32 = "U32"
    U64 = "U64"
    F16 = "F16"
    F32 = "F32"
    F64 = "F64"
    BF16 = "BF16"
    F8_E5M2 = "F8_E5M2"
    F8_E4M3 = "F8_E4M3"
    F8_E8M0 = "F8_E8M0"
    F4 = "F4"
    C64 = "C64"
    F8_E4M3FNUZ = "F8_E4M3FNUZ"
    F8_E5M2FNUZ = "F8_E5M2FNUZ"
    AUTO = "AUTO"

    @property
    def torch_dtype(self) -> Optional[torch.dtype]:
        """The torch dtype (None for `AUTO`)."""
        return _TORCH_DTYPES.get(self)

    @classmethod
    def from_torch(cls, dtype: torch.dtype) -> "DType":
        try:
            return _FROM_TORCH[dtype]
        except KeyError:
            raise ValueError(f"{dtype} has no safetensors dtype") from None


_TORCH_DTYPES: Dict[DType, torch.dtype] = {DType(name): dtype for name, (dtype, _) in DTYPES.items()}
_FROM_TORCH: Dict[torch.dtype, DType] = {v: k for k, v in _TORCH_DTYPES.items()}

DTypeLike = Union[DType, torch.dtype, str, None]


def as_torch_dtype(dtype: DTypeLike) -> Optional[torch.dtype]:
    """A `DType`, `torch.dtype`, dtype name (safetensors' "BF16" or torch's "bfloat16") or
    None as a torch dtype; None for `DType.AUTO` and None."""
    if dtype is None or isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        if dtype.strip().upper() == DType.AUTO.value:
            return None
        named = dtype_from_name(dtype)
        if named is None:
            raise ValueError(f"unknown dtype {dtype!r}: use a DType or a torch.dtype")
        return named
    if isinstance(dtype, DType):
        return dtype.torch_dtype
    raise TypeError(f"dtype must be a DType or a torch.dtype, not {type(dtype).__name__}")


def torch_dtype_of(st_dtype: str, name: str, path: str) -> torch.dtype:
    """The torch dtype of a tensor stored as `st_dtype` (a safetensors dtype name)."""
    try:
        found = DType(st_dtype).torch_dtype
    except ValueError:
        found = None
    if found is None:
        raise ValueError(f"{path}: tensor '{name}': dtype {st_dtype} has no torch equivalent")
    return found


def loaded_dtype(native: torch.dtype, cast: Optional[torch.dtype]) -> torch.dtype:
    """The dtype a tensor has after a load with `dtype=cast`."""
    return cast if cast is not None and native in CASTABLE else native


def torch_shape(st_dtype: str, shape: Sequence[int]) -> Tuple[int, ...]:
    """The torch shape of a tensor whose header says `shape`: torch stores F4 two values
    per element (float4_e2m1fn_x2), so the last dimension halves."""
    out = tuple(int(d) for d in shape)
    if st_dtype == "F4" and out:
        out = out[:-1] + (out[-1] // 2,)
    return out


def nbytes_of(dtype: torch.dtype, shape: Sequence[int]) -> int:
    return math.prod(shape) * dtype.itemsize


class SingleGroup:
    """The process group of a single process: rank 0 of 1. Pass it (or None) as `pg` when
    there is no `torch.distributed` group; every tensor is then returned whole."""

    def size(self) -> int:
        return 1

    def rank(self) -> int:
        return 0

    def __repr__(self) -> str:
        return "SingleGroup()"


# ---------------------------------------------------------------- devices


def resolve_device(device: Device, rank_hints: Sequence[int] = ()) -> torch.device:
    """The torch.device that `device` ("cpu", "cuda", "cuda:1", 1, a torch.device) names in
    this process, with CUDA indices always the LOCAL ones.

    "cuda" without an index means this process's GPU: the current device if one was set
    (`torch.cuda.set_device`), else `$LOCAL_RANK` (as torchrun sets it), else 0. An explicit
    index that exists is used as given. An index that does not exist on this node but equals
    this process's rank (`rank_hints`: its global and group rank) is the `cuda:{rank}` idiom
    written for single-node runs; it is mapped to the local device with a warning instead of
    failing with "invalid device ordinal" on the second node.
    """
    dev = _parse_device(device)
    try:
        ops.check_device(str(dev))  # the loader's rule: cpu or cuda[:N], one CPU device
    except RuntimeError as e:
        raise ValueError(str(e)) from None
    if dev.type == "cpu":
        return torch.device("cpu")
    count = torch.cuda.device_count()
    if dev.index is not None and 0 <= dev.index < count:
        return dev
    current = torch.cuda.current_device() if count > 0 else 0
    index = pick_cuda_index(
        dev.index, rank_hints=rank_hints, device_count=count, current_device=current, env=os.environ
    )
    return torch.device("cuda", index)


_warned_remaps: Set[Tuple[int, int]] = set()  # warn once per mapping, not once per loader


def pick_cuda_index(
    requested: Optional[int],
    *,
    rank_hints: Sequence[int],
    device_count: int,
    current_device: int,
    env: Mapping[str, str],
) -> int:
    """The local CUDA device index for a request (see `resolve_device`); pure, for testing."""
    if device_count <= 0:
        raise RuntimeError("a CUDA device was requested but this process sees none")
    if requested is None:
        return _local_index(device_count, current_device, env)
    if 0 <= requested < device_count:
        return requested
    if requested in rank_hints:
        local = _local_index(device_count, current_device, env)
        if (requested, local) in _warned_remaps:
            return local
        _warned_remaps.add((requested, local))
        logger.warning(
            "device cuda:%d does not exist here (%d visible) and equals this process's rank: "
            "using the local device cuda:%d (derive device indices from LOCAL_RANK, not the "
            "global rank)",
            requested, device_count, local,
        )
        return local
    raise ValueError(f"device cuda:{requested} does not exist: this process sees {device_count}")


def _local_index(device_count: int, current_device: int, env: Mapping[str, str]) -> int:
    if current_device != 0:
        return current_device  # set explicitly by the program
    local_rank = env.get("LOCAL_RANK")
    if local_rank is not None:
        try:
            value = int(local_rank)
        except ValueError:
            value = -1
        if 0 <= value < device_count:
            return value
    return current_device


def _parse_device(device: Device) -> torch.device:
    if isinstance(device, torch.device):
        return device
    if isinstance(device, bool):
        raise TypeError("device must be a string, an index or a torch.device")
    if isinstance(device, int):
        return torch.device("cuda", device)
    if isinstance(device, str):
        name = device.strip().lower()
        if name.startswith("gpu"):  # "gpu[:n]", as the original's Device.from_str accepts
            name = "cuda" + name[3:]
        return torch.device(name)
    if hasattr(device, "as_str"):  # fastsafetensors.st_types.Device
        return _parse_device(device.as_str())
    raise TypeError(
        f"device must be a string, an index or a torch.device, not {type(device).__name__}"
    )
