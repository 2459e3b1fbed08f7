"""The weight iterator that serving engines (vLLM, SGLang) consume.

Their model classes take `Iterable[tuple[str, torch.Tensor]]` in `load_weights()`; the engines
build it from the checkpoint files (vLLM's `safetensors_weights_iterator(hf_weights_files,
use_tqdm_on_load)`, SGLang's equivalent). `weights_iterator` keeps that contract:

- it yields `(name, tensor)` with the names exactly as stored in the checkpoint, file by file
  in the order given, within a file in the order of the data;
- every tensor owns its memory: it stays valid after the next `next()`, after the iterator is
  exhausted or closed, and no handle needs closing;
- the files are streamed: each tensor is handed out as soon as the group of tensors it is
  read with has arrived (on CUDA: has been copied to the device), while later reads go on,
  within `max_memory`; the iterator drops its own references as it yields, so a consumer
  that copies each tensor into its parameter and drops it holds at most `max_memory` of
  buffers (and one group);
- every header is checked before anything is read: a bad file fails the first `next()`.

    model.load_weights(fastsafetensors_rs.weights_iterator(files, device="cuda:0"))
"""

from __future__ import annotations

import logging
import os
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Deque, Dict, Iterable, Iterator, List, Optional, Tuple, Union

import torch

from . import api
from . import keep as keep_mod
from .api import Device, PathLike
from .progress import ByteProgress, progress, progress_enabled
from .verify import Verify
from .verify import spec as verify_spec

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
    files: Union[PathLike, Iterable[PathLike]],
    use_tqdm_on_load: Optional[bool] = None,
    *,
    device: Device = "cpu",
    dtype: Optional[torch.dtype] = None,
    reader: Optional[str] = None,
    nogds: Optional[bool] = None,
    prefetch: int = 0,
    tensor_filter: api.TensorFilter = None,
    tensor_name_match_mode: str = "glob",
    max_memory: Union[None, int, str] = None,
    process_group: Optional[api.ProcessGroup] = None,
    verify: Verify = None,
    keep: bool = False,
) -> Iterator[Tuple[str, torch.Tensor]]:
    """Yields `(name, tensor)` for every tensor (or the selected ones) of `files`, file by file.

    Args:
        files: the `.safetensors` files, read in this order (e.g. the shards of one model),
            or one file.
        use_tqdm_on_load: a progress bar (bytes) on stderr (shown for loads longer than a
            second). None (default) means off unless `$FASTSAFETENSORS_PROGRESS=1`; the
            position matches vLLM's iterators, which take it second.
        device, dtype, reader: as in `fastsafetensors_rs.load`.
        tensor_filter, tensor_name_match_mode: which tensors to yield (see
            `fastsafetensors_rs.api`); only their bytes are read.
        max_memory: the stream's memory budget (see `fastsafetensors_rs.stream`): host
            memory for the CPU; for CUDA, the device memory of the groups copied ahead.
        nogds, prefetch: CUDA only. By default the files are streamed to the device in groups
            through the pinned staging ring, within `max_memory`. With `nogds=False`
            (GPUDirect Storage required) or `prefetch` > 0 they are instead loaded file by
            file, each in one bulk load (GPUDirect Storage where available, else staged),
            `prefetch` files ahead in a background thread, at the cost of that many files of
            device memory.
        process_group: the ranks that read the files together, each byte once, exchanging the
            rest (see `fastsafetensors_rs.distributed`); every rank of it must iterate alike.
        verify: as in `fastsafetensors_rs.stream`: a file that does not match its manifest ends
            the iteration with an error before any tensor of a later file.
        keep: as in `fastsafetensors_rs.load` (see docs/keep.md): the tensors of a kept load
            of `files`, attached to when a process of this user kept them before.

    Malformed arguments raise here, at the call; a file that cannot be read raises
    `RuntimeError` naming it at the first `next()`.
    """
    paths: List[str] = api._paths(files)
    if isinstance(prefetch, bool) or not isinstance(prefetch, int):
        raise TypeError(f"prefetch must be a whole number of files (int), not {type(prefetch).__name__}")
    if prefetch < 0:
        raise ValueError(f"prefetch must be >= 0, got {prefetch}")
    reader, nogds, budget = api._reader(reader), api._nogds(nogds), api._max_memory(max_memory)
    target = api._device_name(device)
    verify_spec(verify)  # malformed: raised here
    if keep_mod.check_keep(keep):
        keep_mod.refuse_with_group(keep, process_group)
        return _streamed(paths, progress_enabled(use_tqdm_on_load, default=False), device=target, dtype=dtype,
                         reader=reader, tensor_filter=tensor_filter, tensor_name_match_mode=tensor_name_match_mode,
                         verify=verify, keep=True)
    return _weights(paths, use_tqdm_on_load, target, dtype, reader, nogds, prefetch, tensor_filter,
                    tensor_name_match_mode, budget, process_group, verify)


def _weights(paths: List[str], use_tqdm_on_load: Optional[bool], target: str, dtype: Optional[torch.dtype],
             reader: Optional[str], nogds: Optional[bool], prefetch: int, tensor_filter: api.TensorFilter,
             tensor_name_match_mode: str, max_memory: Optional[str],
             process_group: Optional[api.ProcessGroup] = None, verify: Verify = None
             ) -> Iterator[Tuple[str, torch.Tensor]]:
    show = progress_enabled(use_tqdm_on_load, default=False)
    logger.debug("weights_iterator: %d file(s) to %s, %s", len(paths), target, _reader_reason(reader))
    if target == "cpu" or (nogds is not False and prefetch == 0):
        yield from _streamed(paths, show, device=target, dtype=dtype, reader=reader, tensor_filter=tensor_filter,
                             tensor_name_match_mode=tensor_name_match_mode, max_memory=max_memory,
                             process_group=process_group, verify=verify)
        return
    yield from _file_by_file(paths, show, prefetch, device=target, dtype=dtype, reader=reader, nogds=nogds,
                             tensor_filter=tensor_filter, tensor_name_match_mode=tensor_name_match_mode,
                             process_group=process_group, verify=verify)


def _streamed(paths: List[str], show: bool, **options) -> Iterator[Tuple[str, torch.Tensor]]:
    tensors = api.stream(paths, **options)
    bar = ByteProgress(show, desc="Loading safetensors (fastsafetensors)", total=tensors.byte_count)
    try:
        # `yield from` an iterator object, not a loop here: a generator frame would keep the
        # last tensor alive while it waits.
        yield from _Counted(tensors, bar)
    finally:
        bar.close()
        tensors.close()


class _Counted:
    """Passes on `(name, tensor)` pairs, advancing a byte bar, holding none of them."""

    def __init__(self, tensors: Iterator[Tuple[str, torch.Tensor]], bar: ByteProgress):
        self._tensors = tensors
        self._bar = bar

    def __iter__(self) -> "_Counted":
        return self

    def __next__(self) -> Tuple[str, torch.Tensor]:
        item = next(self._tensors)
        self._bar.update(item[1].nbytes)
        return item


def _file_by_file(paths: List[str], show: bool, prefetch: int, **options) -> Iterator[Tuple[str, torch.Tensor]]:
    def load_one(path: str) -> Dict[str, torch.Tensor]:
        return api.load([path], **options)

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
