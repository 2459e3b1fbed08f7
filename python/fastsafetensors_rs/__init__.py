"""fastsafetensors_rs: fast .safetensors loading into CPU or GPU memory, and saving (Rust core,
torch ops).

Importing the package registers the torch ops `torch.ops.fastsafetensors.*`:
`load(files, device="cpu", dtype=None, reader=None) -> Dict[str, Tensor]` and friends,
usable from Python, TorchScript and C++.

The fastsafetensors-compatible API and the integrations are imported on first use of one of
their names (PEP 562), so that `import fastsafetensors_rs` costs little beyond the library.
"""

import importlib

from . import _fake, _logging
from ._logging import enable_logging
from ._ops import LIBRARY_PATH, ops
from ._errors import SafetensorError
from .api import load, load_bytes, load_file, release_staging_buffers, safe_open, stream
from .distributed import node_group
from .saving import save, save_file
from .verify import Digests, Signature

__version__ = "0.1.0"

# Public name -> the module that defines it, imported when the name is first used.
_LAZY = {
    "DType": ".compat",
    "FilesBufferOnDevice": ".compat",
    "ParallelLoader": ".compat",
    "ParallelSaver": ".compat",
    "SafeTensorsFileLoader": ".compat",
    "SingleGroup": ".compat",
    "fastsafe_open": ".compat",
    "patch_transformers": ".transformers_patch",
    "patched_transformers": ".transformers_patch",
    "unpatch_transformers": ".transformers_patch",
    "weights_iterator": ".weights",
    "install_as_fastsafetensors": "._alias",
    "FastsafetensorsAliasWarning": "._alias",
}

# Submodules reachable as attributes (`fastsafetensors_rs.compat`), as when all were eager.
_SUBMODULES = {"cli", "compat", "distributed", "integrations", "loader", "parallel_loader", "progress", "transformers_patch",
               "vllm_plugin", "weights"}

__all__ = ["Digests", "LIBRARY_PATH", "SafetensorError", "Signature", "enable_logging", "load", "load_bytes", "load_file", "node_group", "ops",
           "release_staging_buffers", "safe_open", "save", "save_file", "stream", "__version__", *_LAZY]

# What importing the integrations did eagerly, kept eager: FASTSAFETENSORS_LOG is applied and
# the fake kernel (torch.compile / FakeTensorMode) is registered with the ops.
_logging.configure_from_env()
_fake.register_fake_kernels()


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module("." + name, __name__)
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | _SUBMODULES)
