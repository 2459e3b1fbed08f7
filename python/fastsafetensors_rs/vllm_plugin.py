"""vLLM plugin: the load format `fastsafetensors_rs`, and the opt-in for vLLM's own
`--load-format fastsafetensors`.

vLLM calls the functions listed under the `vllm.general_plugins` entry-point group in every
process it starts; `register()` is ours (declared by this package's metadata). It registers
a model loader for `--load-format fastsafetensors_rs` with
`vllm.model_executor.model_loader.register_model_loader`:

    vllm serve path/to/model --load-format fastsafetensors_rs
    vllm serve path/to/model --load-format fastsafetensors_rs \\
        --model-loader-extra-config '{"reader": "direct", "prefetch": 1}'
    vllm serve path/to/model-config --load-format fastsafetensors_rs \\
        --model-loader-extra-config '{"weights": "s3://bucket/model/"}'
    vllm serve path/to/model --load-format fastsafetensors_rs \\
        --model-loader-extra-config '{"keep": true}'      # a restart attaches (docs/keep.md)

The loader is vLLM's `DefaultModelLoader` (file discovery and downloads, index filtering,
subfolders, allow-pattern overrides, the shard filters of `--mm-encoder-only`, of
`is_unused_checkpoint_weight` and of expert parallelism, the strict weight check) with the
weight iterator replaced by `fastsafetensors_rs.weights_iterator`, which streams the shards
to the target device: tensors are handed to the model as their bytes arrive while the next
ones are read, within `max_memory`. With tensor parallelism, the ranks of the TP group read
the checkpoint together: each byte is read by one of them and the rest exchanged over the
group (`share`; see `fastsafetensors_rs.distributed`), so a node reads it once, not once per
GPU. With expert parallelism, only this rank's experts are read (the others are left out
before any I/O; such ranks do not share reads). Options, all optional, in
`model_loader_extra_config` (see `OPTIONS`).

With `FASTSAFETENSORS_INSTALL_AS_FASTSAFETENSORS=1` in the environment, `register()` also
calls `fastsafetensors_rs.install_as_fastsafetensors()` in each vLLM process, so that vLLM's
built-in `--load-format fastsafetensors` runs on this package instead of IBM's.

Without vLLM installed, `register()` does nothing; importing this module never imports vLLM.
Supported: vLLM 0.22 to 0.33 (the loader API of May to November 2026).
"""

from __future__ import annotations

import copy
import functools
import logging
import os
import time
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterable, Iterator, List, Optional, Set, Tuple

import torch

from ._ops import ops
from .api import READERS
from .weights import weights_iterator
from .verify import from_config as verify_from_config
from .verify import spec as verify_spec

logger = logging.getLogger("fastsafetensors_rs")

__all__ = ["LOAD_FORMAT", "OPTIONS", "ENV_INSTALL_AS", "register", "make_loader_class", "parse_options"]

LOAD_FORMAT = "fastsafetensors_rs"
ENV_INSTALL_AS = "FASTSAFETENSORS_INSTALL_AS_FASTSAFETENSORS"

# The keys of `model_loader_extra_config` this loader takes (vLLM's own keys pass through).
OPTIONS: Dict[str, str] = {
    "reader": "the reader, one of 'auto' (default), 'direct', 'mmap'",
    "nogds": "CUDA: true never uses GPUDirect Storage, false requires it; default: where available",
    "device": "where tensors are loaded (default: vLLM's load device, else the worker's GPU, else cpu)",
    "prefetch": "CUDA: load file by file in bulk, this many files ahead in a background thread (default 0: stream)",
    "keep": "true keeps the weights in memory that outlives the engine (docs/keep.md): a restarted engine, or "
            "another on the node, attaches to them instead of reading; each rank loads on its own (share 'none')",
    "max_memory": "the memory the stream's buffers may hold, e.g. '1G' (default: $FASTSAFETENSORS_MAX_MEMORY, else 1 GiB)",
    "share": "the ranks that read the checkpoint together, each byte once: 'tp' (default: the tensor-parallel "
             "group), 'world' (every rank of the engine), 'none' (each rank reads everything)",
    "weights": "where the weights are read from instead of the model's own files: a bucket prefix or index URL "
               "(s3://bucket/model/, https://host/model.safetensors.index.json) or a local directory",
    "verify": "check every byte loaded: {'signature': 'model.sig', 'public_key': 'key.pub'} (or "
              "'certificate_chain': [...], or a keyless one: 'identity': ..., 'issuer': ...), "
              "{'digests': {file: 'sha256:...'}}, or true (a Hugging Face cache's blob names); the ranks still "
              "share the reads, each file hashed once in the group",
}
SHARE = ("tp", "world", "none")

_registered: Optional[type] = None


def parse_options(extra: Dict[str, Any]) -> Dict[str, Any]:
    """Our keys of `model_loader_extra_config`, checked; errors name the key."""
    opts = {k: extra[k] for k in OPTIONS if k in extra}

    def bad(key: str, want: str) -> ValueError:
        return ValueError(
            f"model_loader_extra_config[{key!r}] for load format {LOAD_FORMAT!r} must be "
            f"{want}, got {opts[key]!r}"
        )

    if opts.get("reader") is not None and opts["reader"] not in READERS:
        raise bad("reader", " or ".join(repr(r) for r in READERS))
    if opts.get("nogds") is not None and not isinstance(opts["nogds"], bool):
        raise bad("nogds", "true, false or null")
    if opts.get("device") is not None and not isinstance(opts["device"], (str, torch.device)):
        raise bad("device", "a device string such as 'cuda:0' or 'cpu'")
    prefetch = opts.get("prefetch", 0)
    if isinstance(prefetch, bool) or not isinstance(prefetch, int) or prefetch < 0:
        raise bad("prefetch", "an integer >= 0")
    if opts.get("keep") is not None and not isinstance(opts["keep"], bool):
        raise bad("keep", "true or false")
    if opts.get("share") is not None and opts["share"] not in SHARE:
        raise bad("share", " or ".join(repr(s) for s in SHARE))
    max_memory = opts.get("max_memory")
    if max_memory is not None and (isinstance(max_memory, bool) or not isinstance(max_memory, (int, str))):
        raise bad("max_memory", "a size such as '1G' or a number of bytes")
    weights = opts.get("weights")
    if weights is not None and (not isinstance(weights, str) or not weights):
        raise bad("weights", "a URL or a path")
    if opts.get("verify") is not None:
        try:
            opts["verify"] = verify_from_config(opts["verify"])
            verify_spec(opts["verify"])
        except (TypeError, ValueError) as e:
            raise ValueError(f"model_loader_extra_config['verify'] for load format {LOAD_FORMAT!r}: {e}") from None
    return opts


def weights_files(weights: str) -> List[str]:
    """The files `weights` (the `weights` option: a URL prefix, an index URL, a directory)
    stands for, resolved as `fastsafetensors_rs.load` resolves it; problems of its index
    (shards missing) raise, naming it."""
    files, _index, problems = ops.checkpoint(weights)
    if problems:
        raise RuntimeError(problems[0])
    return list(files)


def _default_device(load_config: Any) -> torch.device:
    # vLLM creates the model on `load_config.device` when set (else the worker's device).
    configured = getattr(load_config, "device", None)
    if configured:
        return torch.device(configured)
    if torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def _sharing_group(share: str, device: torch.device) -> Any:
    """The process group whose ranks read the checkpoint together (None: this rank reads it
    all): vLLM's tensor-parallel group, or its world group, where it has more than one rank;
    its gloo group to load to the CPU, its device group (NCCL) to a GPU."""
    if share == "none":
        return None
    from vllm.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        return None
    coordinator = parallel_state.get_tp_group() if share == "tp" else parallel_state.get_world_group()
    if coordinator.world_size == 1:
        return None
    return coordinator.device_group if device.type == "cuda" else coordinator.cpu_group


def _show_progress(requested: bool) -> bool:
    # Like vLLM: one bar, on the first rank only.
    if not requested:
        return False
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank() == 0
    return True


def _is_other_ranks_expert(should_skip_weight: Callable[[str, Set[int]], bool], local: Set[int], name: str) -> bool:
    return should_skip_weight(name, local)


def _is_kept(skip: Callable[[str], bool], name: str) -> bool:
    return not skip(name)


def _without_other_experts(
    files: List[str], skip: Callable[[str], bool]
) -> Tuple[List[str], int]:
    """The files holding at least one tensor this rank keeps (headers only), and how many
    were dropped: a shard of other ranks' experts is never read."""
    kept = [f for f in files if not all(skip(name) for name in ops.keys(f))]
    return kept, len(files) - len(kept)


def make_loader_class(default_loader: type, weight_utils: Any) -> type:
    """Builds the loader class on top of vLLM's `DefaultModelLoader` and the shard filters of
    its `weight_utils` (both passed in, so that this module imports without vLLM).

    It follows `DefaultModelLoader._get_weights_iterator` of the installed vLLM, feature by
    feature: each filter runs where that vLLM has it (0.31+: `--mm-encoder-only`, 0.32+:
    `Source.is_unused_weight`; expert-parallel filtering throughout)."""

    filter_mm_encoder_only = getattr(weight_utils, "filter_mm_encoder_only_safetensors_files", None)
    filter_by_weight_name = getattr(weight_utils, "filter_safetensors_files_by_weight_name", None)
    should_skip_weight = getattr(weight_utils, "should_skip_weight", None)

    class FastSafetensorsRsLoader(default_loader):  # type: ignore[misc, valid-type]
        """vLLM's default loader reading safetensors checkpoints with fastsafetensors_rs."""

        def __init__(self, load_config: Any):
            extra = getattr(load_config, "model_loader_extra_config", None)
            if isinstance(extra, dict):
                self.fastsafetensors_options = parse_options(extra)
                # The base class rejects extra-config keys it does not know: give it a copy
                # of the config without ours (the caller's stays as it was).
                load_config = copy.copy(load_config)
                load_config.model_loader_extra_config = {k: v for k, v in extra.items() if k not in OPTIONS}
            else:
                self.fastsafetensors_options = {}  # the base class says what is wrong with it
            super().__init__(load_config)

        @contextmanager
        def _load_format(self, fmt: str) -> Iterator[None]:
            # self.load_config is our own copy (see __init__): nothing else sees the change.
            saved = self.load_config.load_format
            self.load_config.load_format = fmt
            try:
                yield
            finally:
                self.load_config.load_format = saved

        def download_model(self, model_config: Any) -> None:
            if self.fastsafetensors_options.get("weights"):
                return  # read from where the option says, at load: nothing to download
            super().download_model(model_config)

        def _prepare_weights(self, *args: Any, **kwargs: Any):
            # File discovery, downloads and index filtering as for load format "safetensors".
            with self._load_format("safetensors"):
                return super()._prepare_weights(*args, **kwargs)

        def _get_weights_iterator(self, source: Any) -> Iterator[Tuple[str, torch.Tensor]]:
            if getattr(self.load_config, "safetensors_load_strategy", None) == "torchao":
                # torchao checkpoints store tensor subclasses flattened; vLLM's own
                # safetensors iterator rebuilds them.
                logger.info("torchao checkpoint: loading through vLLM's safetensors iterator")
                with self._load_format("safetensors"):
                    return super()._get_weights_iterator(source)

            opts = self.fastsafetensors_options
            if opts.get("weights"):
                # Weights elsewhere (a bucket): the model's folder gives only its config.
                files = weights_files(opts["weights"])
            else:
                kwargs: Dict[str, Any] = {}
                if hasattr(source, "subfolder"):
                    kwargs["subfolder"] = source.subfolder
                prepared = self._prepare_weights(
                    model_name_or_path=source.model_or_path,
                    revision=source.revision,
                    fall_back_to_pt=source.fall_back_to_pt,
                    allow_patterns_overrides=source.allow_patterns_overrides,
                    **kwargs,
                )
                # vLLM 0.31+ returns (folder, files, use_safetensors, index_file); before, 3 values.
                hf_folder, files = prepared[0], list(prepared[1])
                index_file = prepared[3] if len(prepared) > 3 else "model.safetensors.index.json"
                files = self._filtered(source, files, hf_folder, index_file)

            local_experts: Optional[Set[int]] = getattr(self, "local_expert_ids", None)
            skip: Optional[Callable[[str], bool]] = None
            if local_experts is not None and should_skip_weight is not None:
                skip = functools.partial(_is_other_ranks_expert, should_skip_weight, local_experts)
                files, dropped = _without_other_experts(files, skip)
                logger.debug("expert parallelism: %d file(s) of other ranks' experts not read", dropped)

            # Other ranks' experts are not read at all: the selection is made from the headers.
            keep = None if skip is None else functools.partial(_is_kept, skip)
            device = torch.device(opts.get("device") or _default_device(self.load_config))
            # Ranks that select different tensors (their own experts) cannot share reads. A
            # verified load shares them too: each file is hashed once in the group.
            verify = opts.get("verify")
            kept = bool(opts.get("keep"))
            group = _sharing_group(opts.get("share") or "tp", device) if skip is None and not kept else None
            weights: Iterable[Tuple[str, torch.Tensor]] = weights_iterator(
                sorted(files),
                _show_progress(bool(getattr(self.load_config, "use_tqdm_on_load", False))),
                device=device,
                process_group=group,
                reader=opts.get("reader"),
                nogds=opts.get("nogds"),
                prefetch=opts.get("prefetch", 0),
                tensor_filter=keep,
                max_memory=opts.get("max_memory"),
                verify=verify,
                keep=kept,
            )
            if self.counter_before_loading_weights == 0.0:
                self.counter_before_loading_weights = time.perf_counter()
            prefix = source.prefix
            return ((prefix + name, tensor) for name, tensor in weights)

        def _filtered(self, source: Any, files: List[str], hf_folder: str, index_file: str) -> List[str]:
            """The shard filters of vLLM's `_get_weights_iterator`, where this vLLM has them."""
            lm_prefixes = getattr(self, "_encoder_only_lm_prefixes", None)
            if lm_prefixes is not None and files and filter_mm_encoder_only is not None:
                files = filter_mm_encoder_only(
                    files, hf_folder, index_file, lm_prefixes,
                    weights_mapper=getattr(self, "_encoder_only_weights_mapper", None),
                )
                if not files:
                    raise RuntimeError(
                        "mm-encoder-only shard filter removed all weight files for "
                        f"`{source.model_or_path}`; check language_model prefixes {lm_prefixes}"
                    )
            is_unused = getattr(source, "is_unused_weight", None)
            if is_unused is not None and filter_by_weight_name is not None:
                files = filter_by_weight_name(files, is_unused)
            return files

    return FastSafetensorsRsLoader


def _env_flag(name: str) -> bool:
    value = os.environ.get(name, "").strip().lower()
    if value in ("", "0", "false", "no", "off"):
        return False
    if value in ("1", "true", "yes", "on"):
        return True
    raise ValueError(f"${name}={os.environ[name]!r}: expected 1 or 0 (true/false, yes/no, on/off)")


def register() -> bool:
    """The `vllm.general_plugins` entry point: registers load format `fastsafetensors_rs`
    (and, with `$FASTSAFETENSORS_INSTALL_AS_FASTSAFETENSORS=1`, installs this package as
    `fastsafetensors` for the process first).

    Returns True if the format is registered (now or before), False if vLLM is not installed
    or too old to have `register_model_loader`. Safe to call more than once."""
    global _registered
    if _env_flag(ENV_INSTALL_AS):
        from ._alias import install_as_fastsafetensors

        # Before vLLM's loader modules are imported, so that they bind ours.
        install_as_fastsafetensors()
    if _registered is not None:
        return True
    try:
        from vllm.model_executor.model_loader import register_model_loader, weight_utils
        from vllm.model_executor.model_loader.default_loader import DefaultModelLoader
    except ImportError as e:
        logger.debug("vLLM plugin not registered: %s", e)
        return False
    loader = make_loader_class(DefaultModelLoader, weight_utils)
    register_model_loader(LOAD_FORMAT)(loader)
    _registered = loader
    logger.debug("vLLM load format %r registered", LOAD_FORMAT)
    return True
