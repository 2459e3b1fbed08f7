"""Kept weights: `keep=True` on a load keeps what it read in memory that outlives the process,
held by a keeper process (one per user and node), so that a later load of the same checkpoint
(a restarted server, another replica) maps it instead of reading. See docs/keep.md.

The functions here are what `fastsafetensors-rs keep` runs: `entries()` (`--list`),
`drop(path)` (`--drop PATH`), `stop()` (`--stop`) and `serve()` (`--serve`, the keeper in
the foreground, for a sidecar container or a host daemon).
"""

from __future__ import annotations

import json
import os
import threading
from typing import Any, Dict, Iterator, List, Optional, Tuple

import torch

from ._ops import ops

__all__ = ["KeptTensors", "drop", "entries", "program", "serve", "status", "stop"]

PROGRAM = "fastsafetensors-keeper"


def check_keep(keep: Any) -> bool:
    """The `keep=` argument: True or False (None: False)."""
    if keep is None:
        return False
    if not isinstance(keep, bool):
        raise TypeError(f"keep must be True or False, not {type(keep).__name__}")
    return keep


def refuse_with_group(keep: bool, process_group: Any, shard: Any = None) -> None:
    """keep= loads alone: each process of a node attaches to the node's keeper by itself."""
    if keep and (process_group is not None or shard is not None):
        raise ValueError("keep=True loads without process_group= or shard=: every process of the node attaches to "
                         "the entry the first one kept, so there is nothing to share; load with keep=True alone")


def program() -> str:
    """The keeper program installed with the package (loads start it when none runs)."""
    return os.path.join(os.path.dirname(os.path.abspath(__file__)), PROGRAM)


def _command(command: str, path: str = "") -> Optional[Dict[str, Any]]:
    answer = ops.keep_command(command, path)
    return json.loads(answer) if answer else None


def status() -> Optional[Dict[str, Any]]:
    """The running keeper (`pid`, `budget` of host entries in bytes or None, `used` by them,
    `device_budget` of each GPU's entries, `dir`) and its `entries`,
    or None when none runs. Each entry: `files`, `device`, `len` (bytes), `verified` (what its
    bytes were checked against, or None), `holders` (pids of the processes attached now),
    `filling`, `attaches`, `created` and `last_attached` (Unix times)."""
    reply = _command("list")
    if reply is None:
        return None
    return dict(reply["keeper"], entries=reply["entries"])


def entries() -> List[Dict[str, Any]]:
    """The entries the running keeper holds (empty when none runs); see `status`."""
    found = status()
    return [] if found is None else found["entries"]


def drop(path: str) -> int:
    """Ends the entries of the files at or under `path` (a file or a checkpoint directory, or
    an object URL or a URL prefix, as loaded): how many. Processes attached to them keep their
    tensors; the next load reads again."""
    from .api import is_url  # (api imports this module)

    reply = _command("drop", path if is_url(path) else os.path.realpath(path))
    return 0 if reply is None else reply["count"]


def stop() -> bool:
    """Stops the running keeper (its entries end; attached processes keep their tensors):
    False when none runs."""
    return _command("stop") is not None


def serve(directory: Optional[str] = None) -> None:
    """Runs the keeper in this process's place (exec), in the foreground: what a sidecar
    container or a host service runs. It exits when stopped (`keep --stop`, SIGTERM), or
    after FASTSAFETENSORS_KEEP_IDLE seconds holding nothing if that is set."""
    args = [program(), "--serve"] + (["--dir", directory] if directory else [])
    os.execv(args[0], args)


class KeptTensors:
    """What `stream(..., keep=True)` returns: the tensors of a kept load as `(name, tensor)`,
    in read order, with `tensor_count` and `byte_count` as a stream has them. The load is
    whole before the first tensor (an attach maps it at once; a first, filling load reads the
    files into the entry first); each tensor is let go of here once handed out."""

    def __init__(self, loaded: Dict[str, torch.Tensor]):
        self._lock = threading.Lock()
        self._items: List[Tuple[str, Optional[torch.Tensor]]] = list(loaded.items())
        self._next = 0
        self.tensor_count: int = len(self._items)
        self.byte_count: int = sum(t.numel() * t.element_size() for _, t in self._items)

    def __iter__(self) -> Iterator[Tuple[str, torch.Tensor]]:
        return self

    def __next__(self) -> Tuple[str, torch.Tensor]:
        with self._lock:
            if self._next >= len(self._items):
                raise StopIteration
            name, tensor = self._items[self._next]
            self._items[self._next] = (name, None)
            self._next += 1
            assert tensor is not None
            return name, tensor

    def close(self) -> None:
        with self._lock:
            self._items = self._items[:self._next]

    def __enter__(self) -> "KeptTensors":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


# ------------------------------------------------------------------ fastsafetensors-rs keep


def add_parser(sub) -> None:
    """`fastsafetensors-rs keep`, added to the command line's subcommands."""
    p = sub.add_parser("keep", help="the weights kept between processes by keep=True: list, drop or stop them, "
                                    "or run the keeper in the foreground")
    p.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    p.add_argument("-v", "--verbose", action="store_true", help="log the loader's decisions to stderr")
    what = p.add_mutually_exclusive_group(required=True)
    what.add_argument("--list", action="store_true",
                      help="the entries: checkpoint, device, bytes, verified against what, attached by which processes")
    what.add_argument("--drop", metavar="PATH", help="end the entries of the files at or under PATH")
    what.add_argument("--stop", action="store_true", help="stop the keeper (attached processes keep their tensors)")
    what.add_argument("--serve", action="store_true",
                      help="run the keeper here, in the foreground (a sidecar container, a host service)")
    p.set_defaults(run=cmd_keep)


def _size(n: Optional[int]) -> str:
    if n is None:
        return "unlimited"
    for unit, shift in (("GiB", 30), ("MiB", 20), ("KiB", 10)):
        if n >= 1 << shift:
            return f"{n / (1 << shift):.2f} {unit}"
    return f"{n} bytes"


def _checkpoint(files: List[str]) -> str:
    if len(files) == 1:
        return files[0]
    return f"{os.path.commonpath(files)} ({len(files)} files)"


def cmd_keep(args) -> Tuple[Dict[str, Any], bool]:
    if args.serve:
        serve()
    if args.stop:
        stopped = stop()
        if not args.json:
            print("keeper stopped" if stopped else "no keeper is running")
        return {"command": "keep", "stopped": stopped}, True
    if args.drop is not None:
        count = drop(args.drop)
        if not args.json:
            print(f"dropped {count} entr{'y' if count == 1 else 'ies'} of {args.drop}")
        return {"command": "keep", "dropped": count}, True
    found = status()
    if not args.json:
        if found is None:
            print("no keeper is running")
        else:
            print(f"keeper pid {found['pid']} in {found['dir']}: {_size(found['used'])} of host memory held of "
                  f"{_size(found['budget'])} (FASTSAFETENSORS_KEEP_MEMORY); on each GPU at most "
                  f"{_size(found['device_budget'])} (FASTSAFETENSORS_KEEP_DEVICE_MEMORY)")
            for e in found["entries"]:
                holders = ", ".join(map(str, e["holders"])) or "nobody"
                state = "filling" if e["filling"] else f"attached {e['attaches']} time(s)"
                print(f"  {_checkpoint(e['files'])}  {e['device']}  {_size(e['len'])}  "
                      f"verified: {e['verified'] or 'no'}  held by: {holders}  {state}")
    return {"command": "keep", "keeper": found}, True
