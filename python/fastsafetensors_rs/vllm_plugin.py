"""vLLM plugin: the load format `fastsafetensors_rs`.

vLLM calls the functions listed under the `vllm.general_plugins` entry-point group in every
process it starts; `register()` is ours. It registers a model loader for
`--load-format fastsafetensors_rs` with `vllm.model_executor.model_loader.register_model_loader`:

    vllm serve path/to/model --load-format fastsafetensors_rs
    vllm serve path/to/model --load-format fastsafetensors_rs \\
        --model-loader-extra-config '{"reader": "direct", "prefetch": 1}'

The loader is vLLM's `DefaultModelLoader` (file discovery, downloads, index filtering, strict
weight check) with the weight iterator replaced by `fastsafetensors_rs.weights_iterator`, which
reads each shard in one bulk read straight to the worker's GPU. Options, all optional, in
`model_loader_extra_config`: `reader` ("auto", "direct", "mmap"), `nogds` (bool), `device`
(default: the worker's current CUDA device, else "cpu"), `prefetch` (files read ahead, 0).

Without vLLM installed, `register()` does nothing; importing this module never imports vLLM.
To call it without the entry point (e.g. in a custom launcher), call `register()` before
creating the engine.
"""

from __future__ import annotations

import copy
import logging
import time
from typing import Any, Dict, Iterator, Optional, Tuple

import torch

from .weights import weights_iterator

logger = logging.getLogger("fastsafetensors_rs")

__all__ = ["LOAD_FORMAT", "register", "make_loader_class"]

LOAD_FORMAT = "fastsafetensors_rs"
OPTIONS = ("reader", "nogds", "device", "prefetch")

_registered: Optional[type] = None


def _default_device() -> torch.device:
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _show_progress(requested: bool) -> bool:
    # Like vLLM: one bar, on the first rank only.
    if not requested:
        return False
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0
    return True


def make_loader_class(default_loader: type) -> type:
    """Builds the loader class on top of vLLM's `DefaultModelLoader` (passed in, so that this
    module imports without vLLM)."""

    class FastSafetensorsRsLoader(default_loader):  # type: ignore[misc, valid-type]
        """vLLM's default loader reading safetensors checkpoints with fastsafetensors."""

        def __init__(self, load_config: Any):
            extra: Dict[str, Any] = dict(getattr(load_config, "model_loader_extra_config", None) or {})
            self.fastsafetensors_options = {k: extra.pop(k) for k in OPTIONS if k in extra}
            # The base class rejects extra-config keys it does not know: give it a copy
            # without ours.
            load_config = copy.copy(load_config)
            load_config.model_loader_extra_config = extra
            super().__init__(load_config)

        def _prepare_weights(self, *args: Any, **kwargs: Any):
            # File discovery as for load format "safetensors" (*.safetensors, index filtering).
            fmt = self.load_config.load_format
            self.load_config.load_format = "safetensors"
            try:
                return super()._prepare_weights(*args, **kwargs)
            finally:
                self.load_config.load_format = fmt

        def _get_weights_iterator(self, source: Any) -> Iterator[Tuple[str, torch.Tensor]]:
            _, files, _ = self._prepare_weights(
                source.model_or_path,
                source.revision,
                source.fall_back_to_pt,
                source.allow_patterns_overrides,
            )
            opts = self.fastsafetensors_options
            weights = weights_iterator(
                sorted(files),
                _show_progress(bool(getattr(self.load_config, "use_tqdm_on_load", False))),
                device=opts.get("device") or _default_device(),
                reader=opts.get("reader"),
                nogds=opts.get("nogds"),
                prefetch=int(opts.get("prefetch", 0)),
            )
            if getattr(self, "counter_before_loading_weights", 0.0) == 0.0:
                self.counter_before_loading_weights = time.perf_counter()
            prefix = source.prefix
            return ((prefix + name, tensor) for name, tensor in weights)

    return FastSafetensorsRsLoader


def register() -> bool:
    """The `vllm.general_plugins` entry point: registers load format `fastsafetensors_rs`.

    Returns True if the format is registered (now or before), False if vLLM is not installed
    or too old to have `register_model_loader`. Safe to call more than once."""
    global _registered
    if _registered is not None:
        return True
    try:
        from vllm.model_executor.model_loader import register_model_loader
        from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    except ImportError as e:
        logger.debug("vLLM plugin not registered: %s", e)
        return False
    loader = make_loader_class(DefaultModelLoader)
    register_model_loader(LOAD_FORMAT)(loader)
    _registered = loader
    logger.debug("vLLM load format %r registered", LOAD_FORMAT)
    return True
