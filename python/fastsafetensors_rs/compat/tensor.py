"""The tensor wrapper of IBM's fastsafetensors (0.3 to 0.5): `FilesBufferOnDevice.as_dict`,
`get_multi_cols`, `get_tensor_wrapped` and `get_sharded_wrapped` return one, and code written
for it unwraps it with `get_raw()` (TGIS: `fb.get_multi_cols(names, dim=0).get_raw()`).

A thin shell around a torch.Tensor with the methods of IBM's `TorchTensor`; each returns a new
wrapper around the torch result. `device` is a `torch.device` (IBM's own `Device` type is not
provided), `dtype` a `DType`.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import List, Optional

import torch

from .types import Device, DType, DTypeLike, as_torch_dtype, resolve_device


class TensorBase:
    """What every wrapper is an instance of (IBM's abstract base of `TorchTensor`)."""


@dataclass
class TorchTensor(TensorBase):
    device: torch.device
    dtype: DType
    real_tensor: torch.Tensor

    def get_raw(self) -> torch.Tensor:
        """The torch.Tensor itself (no copy)."""
        return self.real_tensor

    def get_shape(self) -> List[int]:
        """The shape as the safetensors header gives it: F4 counts two values per byte,
        where torch's float4_e2m1fn_x2 packs them into one element."""
        shape = list(self.real_tensor.shape)
        if self.dtype == DType.F4:
            if not shape:
                raise ValueError("F4 requires a packed last dimension")
            shape[-1] *= 2
        return shape

    def get_nbytes(self) -> int:
        return self.real_tensor.nbytes

    def copy_to_buffer(self, buf: memoryview) -> None:
        """Copies the tensor's bytes, in C order, to the start of `buf`."""
        if self.real_tensor.numel() == 0:
            return
        flat = self.real_tensor.detach().contiguous().reshape(-1).view(torch.uint8)
        torch.frombuffer(buf, dtype=torch.uint8, count=flat.numel()).copy_(flat.cpu())

    def to(self, device: Optional[Device] = None, dtype: DTypeLike = DType.AUTO) -> "TorchTensor":
        """On `device` and in `dtype` (a `DType`, `torch.dtype` or name; AUTO keeps it);
        this wrapper itself when nothing changes, as in the original."""
        target_device = None if device is None else resolve_device(device)
        target_dtype = as_torch_dtype(dtype)
        if (target_device is None or target_device == self.device) and (
                target_dtype is None or target_dtype == self.real_tensor.dtype):
            return self
        return wrap(self.real_tensor.to(device=target_device, dtype=target_dtype))

    def contiguous(self) -> "TorchTensor":
        return wrap(self.real_tensor.contiguous())

    def clone(self) -> "TorchTensor":
        return wrap(self.real_tensor.clone())

    def detach(self) -> "TorchTensor":
        return wrap(self.real_tensor.detach())

    def view(self, dtype: DTypeLike) -> "TorchTensor":
        """The same bytes as another dtype."""
        target = as_torch_dtype(dtype)
        if target is None:
            raise ValueError("view: name a dtype (DType.AUTO keeps nothing to view as)")
        return wrap(self.real_tensor.view(target))

    def reshape(self, shape: List[int]) -> "TorchTensor":
        return wrap(self.real_tensor.reshape(shape))

    def data_ptr(self) -> int:
        return self.real_tensor.data_ptr()

    def __getitem__(self, index) -> "TorchTensor":
        return wrap(self.real_tensor[index])


def wrap(tensor: torch.Tensor) -> TorchTensor:
    """`tensor` in the wrapper."""
    return TorchTensor(tensor.device, DType.from_torch(tensor.dtype), tensor)
