"""Routes HuggingFace transformers' `.safetensors` reading (and writing) through fastsafetensors.

    import fastsafetensors_rs
    from transformers import AutoModelForCausalLM

    with fastsafetensors_rs.patched_transformers():
        model = AutoModelForCausalLM.from_pretrained("path/to/model", dtype=torch.bfloat16)

    fastsafetensors_rs.patch_transformers()      # or for the whole process ...
    fastsafetensors_rs.unpatch_transformers()    # ... until undone

transformers (4.57 and 5.x) reads checkpoints through `safetensors.safe_open`, imported into
its own modules: `transformers.modeling_utils` (both versions), `transformers.modeling_layers`
(5.x, multi-token-prediction heads) and `transformers.integrations.accelerate` (5.x, disk
offload). `load_sharded_checkpoint` (4.x: `transformers.modeling_utils`, 5.x:
`transformers.trainer_utils`, used by `Trainer` to resume) reads with
`safetensors.torch.load_file`. The patch
replaces those names, in those modules only, with fastsafetensors equivalents:

- opening a file reads only its header (names, dtypes, shapes, metadata);
- on the CPU, the first tensor access starts streaming the file: the access returns as soon
  as the group of tensors holding it has been read, while the rest of the file is read in
  the background; transformers fills parameters (5.x: from its thread pool, while other
  files are being read) instead of waiting for whole files. Files whose direct reads would
  not fit in host memory are mapped instead;
- for a CUDA device (4.x: the `device_map` device when the map has a single entry) the first
  access loads the whole file in one bulk read to that device; later accesses are views;
- a handle is safe to use from several threads (5.x materialises tensors from a thread pool):
  the file is still read exactly once.

With `weights=` (a URL such as `s3://bucket/model/`, an index URL, or a local path), the
model's configuration still comes from the `from_pretrained` argument, while its weight files
are those `weights` stands for (`transformers.modeling_utils._get_resolved_checkpoint_files`
is replaced too): a model whose weights sit in an object store loads from a folder holding
only its `config.json`.

`save_pretrained(..., safe_serialization=True)` writes each shard with
`fastsafetensors_rs.save_file` (`transformers.modeling_utils.safe_save_file`): the same files
as stock for CPU models, byte for byte, each one synced and renamed into place when complete
(transformers still splits the shards and writes the index).

Everything transformers does after reading is untouched: `dtype`/`torch_dtype` casts,
`device_map` placement (cpu, cuda, "auto"), sharded checkpoints with
`model.safetensors.index.json`, weight renaming, quantizers. Requests the loader cannot serve
(another framework than PyTorch, a device other than cpu/cuda such as "mps") go to the
original safetensors functions.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import threading
from typing import Any, Callable, Dict, Iterator, List, Optional, Tuple

import torch

from . import _ops, api
from . import keep as keep_mod
from .api import Device, PathLike
from .verify import Verify
from .verify import spec as verify_spec

logger = logging.getLogger("fastsafetensors_rs")

__all__ = ["patch_transformers", "unpatch_transformers", "patched_transformers", "is_transformers_patched"]

# (module, attribute, kind): the names transformers reads safetensors through. Modules or
# attributes a given version lacks are skipped.
PATCH_POINTS: Tuple[Tuple[str, str, str], ...] = (
    ("transformers.modeling_utils", "safe_open", "safe_open"),
    ("transformers.modeling_layers", "safe_open", "safe_open"),
    ("transformers.integrations.accelerate", "safe_open", "safe_open"),
    ("transformers.modeling_utils", "safe_load_file", "load_file"),
    ("transformers.trainer_utils", "safe_load_file", "load_file"),
    # Where from_pretrained finds the weight files: replaced to serve `weights=`.
    ("transformers.modeling_utils", "_get_resolved_checkpoint_files", "checkpoint_files"),
    # What save_pretrained(safe_serialization=True) writes each shard with.
    ("transformers.modeling_utils", "safe_save_file", "save_file"),
)

_lock = threading.RLock()
_originals: Dict[Tuple[str, str], Any] = {}  # what each patched name held before
_options: Dict[str, Any] = {}
_weights: Dict[str, str] = {}  # {"weights": where from_pretrained's weight files are}, if set


class PatchedSafeOpen(api.safe_open):
    """`fastsafetensors_rs.safe_open` as transformers uses it: accepts safetensors' `backend=`
    keyword and ignores it (the loader picks its reader per file) and adds `get_tensors()`.
    Like every `safe_open`, it reads the file once even when several threads ask at once."""

    def __init__(self, filename: PathLike, framework: str = "pt", device: Device = "cpu",
                 backend: Optional[str] = None, reader: Optional[str] = None, nogds: Optional[bool] = None,
                 verify: Verify = None, keep: bool = False):
        super().__init__(filename, framework=framework, device=device, reader=reader, nogds=nogds, verify=verify,
                         keep=keep)
        logger.debug("%s: opened for transformers (header only; loads to %s on first access)",
                     os.fspath(filename), device)

    def get_tensors(self) -> Dict[str, torch.Tensor]:
        """Every tensor of the file, in offset order."""
        return {name: self.get_tensor(name) for name in self.offset_keys()}


def _servable(framework: str, device: Device) -> bool:
    if framework not in ("pt", "torch", "pytorch"):
        return False
    if isinstance(device, int):
        return True
    try:
        return torch.device(device).type in ("cpu", "cuda")
    except (RuntimeError, TypeError):
        return False


def _make_safe_open(original: Callable[..., Any]) -> Callable[..., Any]:
    def safe_open(filename: PathLike, framework: str = "pt", device: Device = "cpu", *args, **kwargs):
        backend = kwargs.pop("backend", None)
        if args or kwargs or not _servable(framework, device):
            logger.debug("%s: framework=%r device=%r: read by safetensors", os.fspath(filename), framework, device)
            if backend is not None:
                kwargs["backend"] = backend
            return original(filename, framework, device, *args, **kwargs)
        return PatchedSafeOpen(filename, framework=framework, device=device, backend=backend, **_options)

    safe_open.__doc__ = "fastsafetensors' stand-in for safetensors.safe_open (see fastsafetensors_rs.transformers_patch)."
    safe_open.__wrapped__ = original  # type: ignore[attr-defined]
    safe_open._fastsafetensors = True  # type: ignore[attr-defined]
    return safe_open


def _make_load_file(original: Callable[..., Any]) -> Callable[..., Any]:
    def load_file(filename: PathLike, device: Device = "cpu") -> Dict[str, torch.Tensor]:
        if not _servable("pt", device):
            return original(filename, device=device)
        return api.load_file(filename, device=device, **_options)

    load_file.__doc__ = "fastsafetensors' stand-in for safetensors.torch.load_file."
    load_file.__wrapped__ = original  # type: ignore[attr-defined]
    load_file._fastsafetensors = True  # type: ignore[attr-defined]
    return load_file


def _make_save_file(original: Callable[..., Any]) -> Callable[..., Any]:
    def save_file(tensors: Dict[str, torch.Tensor], filename: PathLike, metadata: Optional[Dict[str, str]] = None):
        from .saving import save_file as fst_save_file

        return fst_save_file(tensors, filename, metadata=metadata)

    save_file.__doc__ = "fastsafetensors' stand-in for safetensors.torch.save_file (the same bytes, written durably)."
    save_file.__wrapped__ = original  # type: ignore[attr-defined]
    save_file._fastsafetensors = True  # type: ignore[attr-defined]
    return save_file


def _weight_files(weights: str) -> Tuple[List[str], Optional[Dict[str, Any]]]:
    """What transformers' `_get_resolved_checkpoint_files` returns, for the checkpoint
    `weights` stands for: its files, and for several files the index transformers reads
    (every tensor's name, and the file holding it)."""
    files = _ops.checkpoint_files([weights])
    logger.debug("from_pretrained: weights from %s (%d files)", weights, len(files))
    if len(files) == 1:
        return files, None
    weight_map = {}
    for file in files:
        for name in _ops.ops.keys(file):
            weight_map[name] = file.rsplit("/", 1)[-1]
    return files, {"all_checkpoint_keys": list(weight_map), "weight_map": weight_map}


def _check_verified_checkpoint(files: List[str], weights: Optional[str], verify: Verify) -> None:
    """For a sharded checkpoint loaded verified: the checkpoint as a whole, as a verified
    `load` of its directory checks it (an index the manifest lists hashed; every weights file
    it lists loaded), and the files transformers resolved are those."""
    if len(files) < 2:
        return  # one file: checked as it loads
    given = weights if weights is not None else os.path.dirname(files[0])
    handle = _ops.ops.open_handle(list(files), None, verify_spec(verify, [given]))
    _ops.ops.close_handle(handle)


def _make_checkpoint_files(original: Callable[..., Any]) -> Callable[..., Any]:
    def resolve(*args, **kwargs):
        weights = _weights.get("weights")
        resolved = original(*args, **kwargs) if weights is None else _weight_files(weights)
        verify = _options.get("verify")
        if verify is not None and resolved and resolved[0]:
            _check_verified_checkpoint(list(resolved[0]), weights, verify)
        return resolved

    resolve.__wrapped__ = original  # type: ignore[attr-defined]
    resolve._fastsafetensors = True  # type: ignore[attr-defined]
    return resolve


_FACTORIES = {"safe_open": _make_safe_open, "load_file": _make_load_file, "checkpoint_files": _make_checkpoint_files,
              "save_file": _make_save_file}


def _import_transformers() -> None:
    try:
        importlib.import_module("transformers")
    except ImportError as e:
        raise ImportError("fastsafetensors_rs.patch_transformers() needs transformers (pip install transformers)") from e


def _targets() -> List[Tuple[Any, str, str]]:
    found = []
    for module_name, attr, kind in PATCH_POINTS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        if hasattr(module, attr):
            found.append((module, attr, kind))
    return found


def is_transformers_patched() -> bool:
    """Whether `patch_transformers()` is in effect."""
    with _lock:
        return bool(_originals)


def patch_transformers(reader: Optional[str] = None, nogds: Optional[bool] = None,
                       weights: Optional[PathLike] = None, verify: Verify = None, keep: bool = False) -> List[str]:
    """Makes transformers read `.safetensors` files through fastsafetensors, process-wide.

    Args:
        reader: the loader's reader for every file ("auto", "direct", "mmap"); None keeps the
            default (`$FASTSAFETENSORS_READER`, else "auto").
        nogds: for CUDA loads, as in `fastsafetensors_rs.load`.
        weights: where `from_pretrained` takes the weight files from, whatever model path it
            is given (which still gives the configuration): a URL (`s3://bucket/model/`, an
            index URL) or a local file, directory or index. Best given to
            `patched_transformers()`, around one `from_pretrained`. None: the model path's own.
        verify: every weight file transformers opens is verified, as `fastsafetensors_rs.load`'s
            `verify=` (a `Signature` of the model, `Digests`, or True for a Hugging Face cache
            snapshot); a file that fails raises before any of its tensors reaches the model.
        keep: every weight file transformers opens is loaded with `fastsafetensors_rs.load`'s
            `keep=True` (docs/keep.md): the next `from_pretrained` of the same model, in any
            process of this user, attaches to the weights instead of reading them.

    Returns the patched names ("module.attribute"). Calling it again only updates the
    options. Undo with `unpatch_transformers()`. Raises ImportError without transformers,
    ValueError or TypeError for a malformed option.
    """
    reader, nogds = api._reader(reader), api._nogds(nogds)
    verify_spec(verify)  # malformed: raised here
    keep = keep_mod.check_keep(keep)
    if weights is not None and not isinstance(weights, (str, os.PathLike)):
        raise TypeError(f"weights= takes a URL or a path, not {type(weights).__name__}")
    _import_transformers()
    with _lock:
        _options.clear()
        _options.update({k: v for k, v in (("reader", reader), ("nogds", nogds), ("verify", verify),
                                           ("keep", keep or None))
                         if v is not None})
        _weights.clear()
        if weights is not None:
            _weights["weights"] = os.fspath(weights)
        patched = []
        for module, attr, kind in _targets():
            key = (module.__name__, attr)
            current = getattr(module, attr)
            if key not in _originals:
                if getattr(current, "_fastsafetensors", False):
                    continue  # patched by an earlier copy of this module; leave it
                _originals[key] = current
                setattr(module, attr, _FACTORIES[kind](current))
            patched.append(f"{module.__name__}.{attr}")
        if not patched:
            import transformers

            raise RuntimeError(
                f"fastsafetensors: found nothing to patch in transformers {transformers.__version__} "
                f"(looked for {', '.join(m + '.' + a for m, a, _ in PATCH_POINTS)})")
        logger.debug("transformers patched: %s (options %s)", ", ".join(patched), _options or "default")
        return patched


def unpatch_transformers() -> None:
    """Restores transformers' own safetensors functions. A no-op when not patched."""
    with _lock:
        for (module_name, attr), original in _originals.items():
            module = importlib.import_module(module_name)
            setattr(module, attr, original)
        if _originals:
            logger.debug("transformers unpatched")
        _originals.clear()
        _options.clear()
        _weights.clear()


@contextlib.contextmanager
def patched_transformers(reader: Optional[str] = None, nogds: Optional[bool] = None,
                         weights: Optional[PathLike] = None, verify: Verify = None,
                         keep: bool = False) -> Iterator[None]:
    """`patch_transformers()` for the duration of a `with` block:

        with fastsafetensors_rs.patched_transformers(weights="s3://bucket/llama-3-8b/"):
            model = AutoModelForCausalLM.from_pretrained("./llama-3-8b-config")

    On exit the previous state comes back: if transformers was already patched globally, it
    stays patched (with its previous options)."""
    with _lock:
        was_patched = bool(_originals)
        previous, previous_weights = dict(_options), dict(_weights)
        patch_transformers(reader=reader, nogds=nogds, weights=weights, verify=verify, keep=keep)
    try:
        yield
    finally:
        with _lock:
            if was_patched:
                _options.clear()
                _options.update(previous)
                _weights.clear()
                _weights.update(previous_weights)
            else:
                unpatch_transformers()
