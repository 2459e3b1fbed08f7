"""The weight iterator that serving engines (vLLM, SGLang) consume.

Their model classes take `Iterable[tuple[str, torch.Tensor]]` in `load_weights()`; the engines
build it from the checkpoint files (vLLM's `safetensors_weights_iterator(hf_weights_files,
use_tqdm_on_load)`, SGLang's equivalent). `weights_iterator` keeps that contract:

- it yields `(name, tensor)` with the names exactly as stored in the checkpoint;
- every tensor owns its memory: it stays valid after the next `next()`, after the iterator is
  exhausted or closed, and no handle needs closing;
- files are read whole, one bulk read each, in the order given; a file's buffer is freed
  when the last tensor into it is gone (the iterator drops its own references as it yields).

    model.load_weights(fastsafetensors_rs.weights_iterator(files, device="cuda:0"))
"""

from __future__ import annotations

import logging
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Deque, Dict, Iterable, Iterator, List, Optional, Tuple

import torch

from . import api
from .api import Device, PathLike
from .progress import progress, progress_enabled

logger = logging.getLogger("fastsafetensors_rs")

__all__ = ["weights_iterator"]

ENV_READER = "FASTSAFETENSORS_READER"


def _reader_reason(reader: Optional[str]) -> str:
    if reader is not None:
        return f"reader={reader!r} (argument)"
    env = os.environ.get(ENV_READER)
    if env:
        return f"reader={env!r} (${ENV_READER})"
    return "reader='auto' (default): mmap for files (nearly) all in the page cache, direct reads otherwise"


def weights_iterator(
    files: Iterable[PathLike],
    use_tqdm_on_load: Optional[bool] = None,
    *,
    device: Device = "cpu",
    dtype: Optional[torch.dtype] = None,
    reader: Optional[str] = None,
    nogds: Optional[bool] = None,
    prefetch: int = 0,
) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yields `(name, tensor)` for every tensor of `files`, file by file.

    Args:
        files: the `.safetensors` files, read in this order (e.g. the shards of one model).
        use_tqdm_on_load: a per-file progress bar on stderr (shown for loads longer than a
            second). None (default) means off unless `$FASTSAFETENSORS_PROGRESS=1`; the
            position matches vLLM's iterators, which take it second.
        device, dtype, reader, nogds: as in `fastsafetensors_rs.load`; each file is loaded
            straight to `device` (e.g. "cuda:0": GPUDirect Storage or staged copies).
        prefetch: how many files to read ahead in a background thread while the consumer
            works on the current one (0: none). Peak memory grows by that many files.

    A file that cannot be read raises `RuntimeError` naming it when the iteration reaches it.
    """
    paths: List[str] = [os.fspath(f) for f in files]
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0, got {prefetch}")
    show = progress_enabled(use_tqdm_on_load, default=False)
    logger.debug("weights_iterator: %d file(s) to %s, %s, prefetch %d", len(paths), device,
                 _reader_reason(reader), prefetch)

    def load_one(path: str) -> Dict[str, torch.Tensor]:
        return api.load([path], device=device, dtype=dtype, reader=reader, nogds=nogds)

    def drain(tensors: Dict[str, torch.Tensor]) -> Iterator[Tuple[str, torch.Tensor]]:
        # Hand each tensor over and forget it, so a file's memory can go as soon as the
        # consumer is done with its tensors.
        for name in list(tensors):
            yield name, tensors.pop(name)

    files_iter = progress(paths, show, desc="Loading safetensors (fastsafetensors)", unit="file")
    if prefetch == 0:
        for path in files_iter:
            yield from drain(load_one(path))
        return

    # The op releases the GIL while it reads, so a background thread overlaps the next
    # file's I/O with the consumer's work on the current one.
    pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastsafetensors-prefetch")
    pending: Deque[Future] = deque()
    upcoming = iter(paths)
    try:
        for _ in files_iter:
            while len(pending) <= prefetch:
                nxt = next(upcoming, None)
                if nxt is None:
                    break
                pending.append(pool.submit(load_one, nxt))
            yield from drain(pending.popleft().result())
    finally:
        for future in pending:
            future.cancel()
        pool.shutdown(wait=True)
