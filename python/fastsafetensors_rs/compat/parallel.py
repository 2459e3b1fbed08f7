"""`ParallelLoader`: the weight iterator of fastsafetensors 0.5 (as vLLM uses it)."""

from __future__ import annotations

import logging
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Deque, Dict, Generator, List, Optional, Sequence, Tuple, Union

import torch

from .. import api as _api
from .loader import LoadPlan, PathLike, SafeTensorsFileLoader, open_buffer, read_header
from .types import Device

logger = logging.getLogger("fastsafetensors_rs.compat")

_Prepared = Tuple[Optional[LoadPlan], Optional[Dict[str, torch.Tensor]], Optional[BaseException]]


class ParallelLoader:
    r"""Iterates over every tensor of a checkpoint, on every rank.

    The files are taken in batches of `pg.size()`: in each batch, rank i reads file i (its
    own data only) and every tensor is broadcast to all ranks (small ones coalesced). While
    a batch is handed out, the next is read on a background thread; no collective ever runs
    off the calling thread.

    Args:
        pg: a process group, or `SingleGroup()`/None for one process.
        hf_weights_files: the .safetensors files, in the order to read them (or one file).
        max_concurrent_producers: must be 1 (as in the original).
        queue_size: how far reading runs ahead: -1 reads each batch only when the previous
            one is done, 0 (default) reads one batch ahead, n > 0 reads n + 1 batches ahead.
            Each batch read ahead holds one file per rank in memory.
        use_tqdm_on_load: a progress bar on rank 0 when tqdm is installed.
        device, bbuf_size_kb, max_threads, nogds, set_numa, debug_log, framework, reader,
            **kwargs: as for `SafeTensorsFileLoader`.

    Tensors are yielded without a defensive copy (the original clones each one in a
    single process, which doubles memory while loading): each owns its memory and stays
    valid after `close()`.

    Example (the shape of vLLM's fastsafetensors weight iterator):
        >>> pl = ParallelLoader(pg, files, device=f"cuda:{torch.cuda.current_device()}")
        >>> try:
        ...     for name, tensor in pl.iterate_weights():
        ...         params[name].copy_(tensor)
        ... finally:
        ...     pl.close()
    """

    def __init__(
        self,
        pg: Any,
        hf_weights_files: Union[PathLike, Sequence[PathLike]],
        max_concurrent_producers: int = 1,
        queue_size: int = 0,
        use_tqdm_on_load: bool = True,
        device: Device = "cpu",
        bbuf_size_kb: int = 16 * 1024,
        max_threads: int = 16,
        nogds: bool = False,
        set_numa: bool = True,
        debug_log: bool = False,
        framework: str = "pytorch",
        *,
        reader: Optional[str] = None,
        **kwargs: Any,
    ):
        if max_concurrent_producers != 1:
            raise ValueError(
                f"max_concurrent_producers must be 1 (got {max_concurrent_producers}): batches "
                "are broadcast in order on every rank"
            )
        self.loader = SafeTensorsFileLoader(
            pg,
            device,
            bbuf_size_kb=bbuf_size_kb,
            max_threads=max_threads,
            nogds=nogds,
            set_numa=set_numa,
            disable_cache=True,
            debug_log=debug_log,
            framework=framework,
            reader=reader,
            **kwargs,
        )
        self.pg = pg
        self.hf_weights_files: List[str] = _api._paths(hf_weights_files)
        self.queue_size = queue_size
        self.use_tqdm_on_load = use_tqdm_on_load
        group = self.loader._group
        self._rank, self._world = group.rank, group.size
        self.batches: List[List[str]] = [
            self.hf_weights_files[i : i + self._world]
            for i in range(0, len(self.hf_weights_files), self._world)
        ]
        self._active: Optional[Generator[Tuple[str, torch.Tensor], None, None]] = None

    def iterate_weights(self) -> Generator[Tuple[str, torch.Tensor], None, None]:
        """Yields (name, tensor) for every tensor of every file, the same sequence on every
        rank. Every rank must iterate to the end (or all must stop at the same point)."""
        self.loader._check_open("iterate_weights")
        if self._active is not None:
            self._active.close()
        self._active = self._iterate()
        return self._active

    def close(self) -> None:
        """Stops an iteration in progress (waiting for a read under way), forgets the files
        and lets go of the process group. Tensors already yielded stay valid."""
        if self._active is not None:
            self._active.close()
            self._active = None
        self.loader.close()
        self.pg = None

    # ------------------------------------------------------------ internals

    def _prepare(self, batch: Sequence[str]) -> _Prepared:
        """Reads the batch's headers and this rank's file: I/O only, run on the producer
        thread. Errors are returned, to be reported to every rank in step."""
        plan: Optional[LoadPlan] = None
        try:
            headers = [read_header(path, rank) for rank, path in enumerate(batch)]
            plan = LoadPlan.make(headers, self._rank, self.loader.device, None, self.loader.reader)
            return plan, plan.read_own(), None
        except Exception as exc:
            return plan, None, exc

    def _iterate(self) -> Generator[Tuple[str, torch.Tensor], None, None]:
        ahead = 0 if self.queue_size < 0 else self.queue_size + 1
        device = self.loader.device
        if device.type == "cuda":
            torch.cuda.set_device(device)
        progress = _progress(len(self.batches), self.use_tqdm_on_load and self._rank == 0)
        pending: Deque[Future] = deque()
        executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="fastsafetensors-read")
        submitted = 0

        def read_ahead(limit: int) -> None:
            nonlocal submitted
            while submitted < len(self.batches) and len(pending) < limit:
                pending.append(executor.submit(self._prepare, self.batches[submitted]))
                submitted += 1

        try:
            for _ in range(len(self.batches)):
                read_ahead(1)  # the batch needed now
                plan, local, error = pending.popleft().result()
                read_ahead(ahead)  # the next ones, read while this one is handed out
                fb = open_buffer(plan, local, error, self.pg, device)
                del local
                try:
                    for name in fb.keys():
                        yield name, fb.get_tensor(name)
                finally:
                    fb.close()
                progress.update(1)
        finally:
            for f in pending:
                f.cancel()
            executor.shutdown(wait=True, cancel_futures=True)
            progress.close()


class _NoProgress:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool) -> Any:
    if enabled:
        try:
            from tqdm.auto import tqdm
        except ImportError:
            return _NoProgress()
        return tqdm(total=total, desc="Loading safetensors checkpoint shards")
    return _NoProgress()
