"""The safetensors dtype names, their torch dtypes and their sizes on disk."""

from __future__ import annotations

from typing import Dict, List, Sequence, Tuple

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

# What `dtype=` casts; everything else (ints, bool, float8/float4, complex) keeps its type.
CASTABLE = frozenset({torch.float16, torch.bfloat16, torch.float32, torch.float64})


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
