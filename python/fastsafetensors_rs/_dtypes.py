"""The safetensors dtype names, their torch dtypes and their sizes on disk."""

from __future__ import annotations

from typing import Dict, List, Optional, Sequence, Tuple, Union

import torch

# name -> (torch dtype, bits per element as counted in safetensors shapes)
DTYPES: Dict[str, Tuple[torch.dtype, int]] = {
    "BOOL": (torch.bool, 8),
    "U8": (torch.uint8, 8),
    "I8": (torch.int8, 8),
    "I16": (torch.int16, 16),
    "U16": (torch.uint16, 16),
    "I32": (torch.int32, 32),
    "U32": (torch.uint32, 32),
    "I64": (torch.int64, 64),
    "U64": (torch.uint64, 64),
    "F16": (torch.float16, 16),
    "BF16": (torch.bfloat16, 16),
    "F32": (torch.float32, 32),
    "F64": (torch.float64, 64),
    "C64": (torch.complex64, 64),
    "F8_E4M3": (torch.float8_e4m3fn, 8),
    "F8_E5M2": (torch.float8_e5m2, 8),
    "F8_E4M3FNUZ": (torch.float8_e4m3fnuz, 8),
    "F8_E5M2FNUZ": (torch.float8_e5m2fnuz, 8),
    "F8_E8M0": (torch.float8_e8m0fnu, 8),
    "F4": (torch.float4_e2m1fn_x2, 4),  # torch packs two per element: last dim halved
}

# What `dtype=` casts, and what it casts to; everything else (ints, bool, float8/float4,
# complex) keeps its type, and a target outside this set is refused (as the op does).
CAST_TARGETS = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
CASTABLE = frozenset(CAST_TARGETS)


def dtype_from_name(name: str) -> Optional[torch.dtype]:
    """The torch dtype a string names: a torch name with or without `torch.` ("bfloat16",
    "torch.half") or a safetensors name ("BF16"), in any case; None if it names none."""
    key = name.strip()
    if key.lower().startswith("torch."):
        key = key[len("torch."):]
    found = getattr(torch, key.lower(), None)
    if isinstance(found, torch.dtype):
        return found
    entry = DTYPES.get(key.upper())
    return entry[0] if entry else None


def _cast_names() -> str:
    names = [str(d) for d in CAST_TARGETS]
    return ", ".join(names[:-1]) + " or " + names[-1]


def cast_dtype(dtype: Union[torch.dtype, str, None]) -> Optional[torch.dtype]:
    """The `dtype=` argument of a load, checked: None, or one of CASTABLE given as a torch
    dtype or its name. Anything else raises a one-line error (as the op does for TorchScript
    and C++ callers): floating-point weights cast to an integer or float8 dtype are zeros
    and saturated values, never what a whole-checkpoint cast means."""
    if dtype is None:
        return None
    if isinstance(dtype, str):
        named = dtype_from_name(dtype)
        if named is None:
            raise ValueError(f"dtype={dtype!r} names no dtype: use a torch.dtype or a name such as 'bfloat16' "
                             f"(dtype= takes {_cast_names()})")
        dtype = named
    if not isinstance(dtype, torch.dtype):
        raise TypeError(f"dtype must be a torch.dtype or its name, not {type(dtype).__name__}")
    if dtype not in CASTABLE:
        raise ValueError(
            f"dtype={dtype} is not supported: dtype= casts floating-point tensors (F16, BF16, F32, F64) to "
            f"{_cast_names()} and leaves the others as stored; convert to {dtype} yourself "
            f"(tensor.to({dtype})) if that is what you want")
    return dtype


def numel(shape: Sequence[int]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n


def nbytes(dtype: str, shape: Sequence[int]) -> int:
    """Bytes on disk of a tensor given in safetensors terms."""
    return numel(shape) * DTYPES[dtype][1] // 8


def torch_shape(dtype: str, shape: Sequence[int]) -> List[int]:
    """The shape of the loaded torch tensor (F4's last dimension halved)."""
    out = [int(d) for d in shape]
    if dtype == "F4":
        out[-1] //= 2
    return out
