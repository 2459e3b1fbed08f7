"""fastsafetensors_rs: fast .safetensors loading into CPU or GPU memory (Rust core, torch ops).

Importing the package registers the torch ops `torch.ops.fastsafetensors.*`:
`load(files, device="cpu", dtype=None, reader=None) -> Dict[str, Tensor]` and friends,
usable from Python, TorchScript and C++.
"""

from ._ops import LIBRARY_PATH, ops
from .api import load, load_file, release_staging_buffers, safe_open, stream
from .compat import DType, FilesBufferOnDevice, ParallelLoader, SafeTensorsFileLoader, SingleGroup, fastsafe_open
from .integrations import enable_logging, patch_transformers, patched_transformers, unpatch_transformers, weights_iterator

__version__ = "0.1.0"

__all__ = ["LIBRARY_PATH", "load", "load_file", "ops", "release_staging_buffers", "safe_open", "stream",
           "__version__",
           "DType", "FilesBufferOnDevice", "ParallelLoader", "SafeTensorsFileLoader", "SingleGroup",
           "fastsafe_open",
           "enable_logging", "patch_transformers", "patched_transformers", "unpatch_transformers", "weights_iterator"]
