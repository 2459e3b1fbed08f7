"""The process group as the compatible API uses it.

Every collective moves raw bytes: tensors are viewed as flat uint8 before they reach
torch.distributed, so any dtype (bool, float8, float4, uint16, complex, ...) travels
through any backend (gloo on CPU, NCCL on GPU) bit for bit, and no value is ever converted
on the way. Ranks are those of the group; they are mapped to global ranks here. Each
collective names what it exchanges (`of`: a file, or words naming files), so that the group's
own error (a rank that died, or stopped past the group's timeout) is raised naming it.
"""

from __future__ import annotations

from typing import Any, List, Optional, Sequence

import torch
import torch.distributed as dist

from ..distributed import _exchange_of
from .types import SingleGroup


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's memory (writes go to the tensor)."""
    if not t.is_contiguous():
        raise ValueError("collectives need contiguous tensors")
    return t.reshape(-1).view(torch.uint8)


class Group:
    """Wraps the `pg` argument: a `torch.distributed.ProcessGroup`, `SingleGroup` (the class
    or an instance), None, or any object with `size()` and `rank()` whose size is 1."""

    def __init__(self, pg: Any):
        self.pg: Optional[dist.ProcessGroup] = None
        self.released = False
        if pg is None or pg is SingleGroup or isinstance(pg, SingleGroup):
            self.rank, self.size = 0, 1
            return
        if isinstance(pg, dist.ProcessGroup):
            self.pg = pg
            self.rank, self.size = pg.rank(), pg.size()
            return
        if callable(getattr(pg, "size", None)) and callable(getattr(pg, "rank", None)):
            if pg.size() == 1:
                self.rank, self.size = 0, 1
                return
            raise TypeError(
                f"pg of type {type(pg).__name__} has {pg.size()} ranks but is not a "
                "torch.distributed.ProcessGroup; pass the group itself (e.g. "
                "torch.distributed.group.WORLD)"
            )
        raise TypeError(
            f"pg must be a torch.distributed.ProcessGroup, SingleGroup or None, "
            f"not {type(pg).__name__}"
        )

    @property
    def is_single(self) -> bool:
        return self.size == 1

    def release(self) -> None:
        """Drops the reference to the process group (rank and size are kept), so that
        `destroy_process_group()` can tear the group down: a group still referenced at
        interpreter exit has its gloo threads stopped during finalization, which torch 2.15
        can abort on. Collectives fail afterwards."""
        self.pg = None
        self.released = True

    def _process_group(self) -> dist.ProcessGroup:
        if self.pg is None:
            raise RuntimeError(
                "the process group was released by close(); no collective can run"
                if self.released else "a collective needs a process group of several ranks"
            )
        return self.pg

    def global_rank(self, group_rank: int) -> int:
        return dist.get_global_rank(self._process_group(), group_rank)

    def broadcast(self, t: torch.Tensor, src: int, of: str) -> None:
        """Fills `t` on every rank with `src`'s `t`."""
        if self.is_single or t.numel() == 0:
            return
        with _exchange_of(of):
            dist.broadcast(as_bytes(t), src=self.global_rank(src), group=self._process_group())

    def scatter(
        self, out: torch.Tensor, chunks: Optional[Sequence[torch.Tensor]], src: int, of: str
    ) -> None:
        """Rank r's `out` receives `chunks[r]` of `src` (chunks: one per rank, each with
        `out`'s size, given on `src` only)."""
        if out.numel() == 0:
            return
        data = [as_bytes(c) for c in chunks] if self.rank == src and chunks is not None else None
        with _exchange_of(of):
            dist.scatter(as_bytes(out), scatter_list=data, src=self.global_rank(src),
                         group=self._process_group())

    def send(self, t: torch.Tensor, dst: int, of: str) -> None:
        if t.numel():
            with _exchange_of(of):
                dist.send(as_bytes(t), dst=self.global_rank(dst), group=self._process_group())

    def recv(self, t: torch.Tensor, src: int, of: str) -> None:
        if t.numel():
            with _exchange_of(of):
                dist.recv(as_bytes(t), src=self.global_rank(src), group=self._process_group())

    def failed_ranks(self, ok: bool, device: torch.device, of: str) -> List[int]:
        """Tells every rank which ranks report `ok=False` (one small all-reduce), so that
        a failure on one rank is raised on all of them instead of leaving the others
        waiting in a collective."""
        if self.is_single:
            return [] if ok else [0]
        flags = torch.zeros(self.size, dtype=torch.int32, device=device)
        if not ok:
            flags[self.rank] = 1
        with _exchange_of(of):
            dist.all_reduce(flags, group=self._process_group())
        return [r for r, bad in enumerate(flags.tolist()) if bad]
