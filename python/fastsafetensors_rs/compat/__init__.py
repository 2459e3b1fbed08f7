"""The API of IBM's fastsafetensors 0.5, so that code written for it (vLLM's and SGLang's
`--load-format fastsafetensors` weight iterators, TGIS-style loaders, scripts) runs
unchanged on this package.

- `SafeTensorsFileLoader(pg, device)`: `add_filenames({rank: [paths]})`, then
  `copy_files_to_device()` makes each rank read its own files and returns a
- `FilesBufferOnDevice`: `get_tensor` (broadcast), `get_sharded` (scatter), `push_tensor`,
  `get_multi_cols` (fused QKV), `as_dict`, `close`; `get_multi_cols`, `as_dict` and the
  `*_wrapped` getters return the original's wrapper, `TorchTensor` (`.get_raw()`).
- `fastsafe_open(files)`: `safe_open` over several files.
- `ParallelLoader(pg, files).iterate_weights()`: every (name, tensor) on every rank.
- `SingleGroup`, `DType`.
- `saver`: `save_sharded(entries, base, num_shards=16)`, `ParallelSaver`, `plain_entry`:
  IBM's shards (names, balance, shard-set metadata), written durably by this package.

Collectives run through torch.distributed on the target device (gloo on CPU, NCCL on GPU).
See docs/migration.md for what is the same, what is better and what differs.
"""

from .buffer import FilesBufferOnDevice, TensorNotFoundError
from .loader import SafeTensorsFileLoader, fastsafe_open
from .parallel import ParallelLoader
from .saver import ParallelSaver
from .tensor import TensorBase, TorchTensor
from .types import DType, SingleGroup, resolve_device

__all__ = [
    "DType",
    "FilesBufferOnDevice",
    "ParallelLoader",
    "ParallelSaver",
    "SafeTensorsFileLoader",
    "SingleGroup",
    "TensorBase",
    "TensorNotFoundError",
    "TorchTensor",
    "fastsafe_open",
    "resolve_device",
]
