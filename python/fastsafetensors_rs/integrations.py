"""Where the package meets other tools, gathered for `fastsafetensors_rs/__init__.py`.

Importing this module applies `FASTSAFETENSORS_LOG` and registers the ops' fake kernels; it
imports neither transformers, vLLM nor tqdm (those load when used).

- `patch_transformers`, `unpatch_transformers`, `patched_transformers`: transformers'
  `from_pretrained` reads through fastsafetensors (`transformers_patch`).
- `weights_iterator`: the `(name, tensor)` iterator serving engines consume (`weights`); the
  vLLM load format `fastsafetensors_rs` is in `vllm_plugin`.
- `enable_logging`: the package's log records to stderr (`_logging`).
- fake kernels for `torch.compile` / FakeTensorMode (`_fake`); progress bars (`progress`).
"""

from ._fake import register_fake_kernels
from ._logging import configure_from_env, enable_logging
from .transformers_patch import patch_transformers, patched_transformers, unpatch_transformers
from .weights import weights_iterator

__all__ = ["enable_logging", "patch_transformers", "patched_transformers", "unpatch_transformers",
           "weights_iterator"]

configure_from_env()
register_fake_kernels()
