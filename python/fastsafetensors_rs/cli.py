"""`python -m fastsafetensors_rs`: inspect, verify and benchmark .safetensors checkpoints.

    python -m fastsafetensors_rs inspect model/                 # dtypes, shapes, sizes, metadata
    python -m fastsafetensors_rs verify model/*.safetensors     # full check; exit 1 on a bad file
    python -m fastsafetensors_rs bench model/ --repeat 3        # this loader vs safetensors
    python -m fastsafetensors_rs bench model/ --save /tmp/out    # ... and saving it again
    python -m fastsafetensors_rs inspect --json model/ | jq .totals
    python -m fastsafetensors_rs keep --list                    # weights kept by keep=True loads

A PATH is a file, a directory (the shards its `*.safetensors.index.json` lists if there is one,
else all of its `*.safetensors`) or an index file, by the same rule as `fastsafetensors_rs.load`. `--json` prints one JSON document on stdout. Progress
bars (stderr, only for work longer than a second) are on unless `--no-progress` or
`FASTSAFETENSORS_PROGRESS=0`; `-v` shows the loader's decisions (how each file was read).
Exit status: 0 when every file is valid, 1 when one is not (or a load fails), 2 on a usage
error or a malformed FASTSAFETENSORS_* setting, 141 when stdout is a pipe closed early
(`| head`).
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import shutil
import statistics
import sys
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from . import _ops, api, keep
from ._dtypes import DTYPES, nbytes, numel
from ._logging import enable_logging, redact
from ._ops import ops
from .progress import ByteProgress, progress, progress_enabled
from .verify import Digests, Signature, default_trusted_root
from .verify import spec as verify_spec

logger = logging.getLogger("fastsafetensors_rs")


class UsageError(Exception):
    """A problem with the command line itself (exit status 2)."""


# ---------------------------------------------------------------------------- paths


@dataclass
class Checkpoint:
    """The files one PATH argument stands for, the index that listed them, if any, and the
    problems between them (a name in two files; an index that disagrees with its files).
    Tensor names must be unique within a checkpoint, not across them."""

    arg: str
    files: List[str] = field(default_factory=list)
    index: Optional[str] = None
    problems: List[str] = field(default_factory=list)


def expand_paths(paths: Sequence[str]) -> List[Checkpoint]:
    """Turns files, directories and index files into checkpoints by the loader's own rule
    (`fastsafetensors_rs.load` resolves a directory or an index the same way). A path the
    loader refuses to take (not UTF-8) is a problem of its own checkpoint, with the loader's
    message; the others are still looked at."""
    out = []
    for path in paths:
        try:
            path = api._path(path)
        except ValueError as e:
            out.append(Checkpoint(os.fsencode(path).decode("utf-8", "backslashreplace"), problems=[str(e)]))
            continue
        try:
            files, index, problems = ops.checkpoint(path)
        except RuntimeError as e:
            raise UsageError(str(e)) from None
        out.append(Checkpoint(path, list(files), index, list(problems)))
    return out


def _describe_all(ckpts: List[Checkpoint]) -> List[Dict[str, Any]]:
    """describe_file() of every file, once per file even if named twice."""
    seen: Dict[str, Dict[str, Any]] = {}
    for c in ckpts:
        for p in c.files:
            if p not in seen:
                seen[p] = describe_file(p)
    return list(seen.values())


# ---------------------------------------------------------------------------- inspect


def describe_file(path: str) -> Dict[str, Any]:
    """Header facts of one file (no tensor data is read) and whether the header is valid."""
    info: Dict[str, Any] = {"path": path, "valid": False, "error": None}
    try:
        names, dtypes, shapes, metadata = _ops.describe(path)
        # An object's size is not asked for separately: its data bytes stand in below.
        info["file_bytes"] = None if api.is_url(path) else os.path.getsize(path)
    except RuntimeError as e:  # the loader's message, which names the file
        info["error"] = str(e)
        return info
    except OSError as e:
        info["error"] = f"{path}: {e.strerror or e}"
        return info
    for name, dtype in zip(names, dtypes):
        if dtype not in DTYPES:  # a dtype of the format that torch has no dtype for
            info["error"] = f"{path}: tensor '{name}': dtype {dtype} has no torch equivalent"
            return info
    tensors = []
    by_dtype: Dict[str, Dict[str, int]] = {}
    for name, dtype, shape in zip(names, dtypes, shapes):
        size = nbytes(dtype, shape)
        tensors.append({"name": name, "dtype": dtype, "shape": list(shape), "bytes": size})
        agg = by_dtype.setdefault(dtype, {"tensors": 0, "elements": 0, "bytes": 0})
        agg["tensors"] += 1
        agg["elements"] += numel(shape)
        agg["bytes"] += size
    data_bytes = sum(t["bytes"] for t in tensors)
    if info["file_bytes"] is None:
        info["file_bytes"] = data_bytes
    info.update({
        "valid": True,
        "header_bytes": None if api.is_url(path) else info["file_bytes"] - data_bytes - 8,
        "metadata": metadata,
        "tensors": tensors,
        "totals": {"tensors": len(tensors), "elements": sum(a["elements"] for a in by_dtype.values()),
                   "bytes": data_bytes, "by_dtype": by_dtype},
    })
    return info


def _merge_totals(files: List[Dict[str, Any]]) -> Dict[str, Any]:
    by_dtype: Dict[str, Dict[str, int]] = {}
    for f in files:
        for dtype, agg in f.get("totals", {}).get("by_dtype", {}).items():
            into = by_dtype.setdefault(dtype, {"tensors": 0, "elements": 0, "bytes": 0})
            for k in into:
                into[k] += agg[k]
    return {
        "files": len(files),
        "tensors": sum(a["tensors"] for a in by_dtype.values()),
        "elements": sum(a["elements"] for a in by_dtype.values()),
        "bytes": sum(a["bytes"] for a in by_dtype.values()),
        "file_bytes": sum(f.get("file_bytes", 0) for f in files),
        "by_dtype": by_dtype,
    }


def _problems(ckpts: List[Checkpoint]) -> List[str]:
    return [p for c in ckpts for p in c.problems]


def _human(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1024
    return f"{n} B"  # unreachable


def cmd_inspect(args: argparse.Namespace) -> Tuple[Dict[str, Any], bool]:
    ckpts = expand_paths(args.paths)
    files = _describe_all(ckpts)
    problems = _problems(ckpts)
    ok = all(f["valid"] for f in files) and not problems
    # --summary: totals only, in the JSON document as on the terminal.
    listed = [{k: v for k, v in f.items() if k != "tensors"} for f in files] if args.summary else files
    result = {"command": "inspect", "valid": ok, "files": listed, "indexes": [c.index for c in ckpts if c.index],
              "problems": problems, "totals": _merge_totals(files)}
    if not args.json:
        for f in files:
            _print_file(f, show_tensors=not args.summary)
        _print_totals(result["totals"])
        for p in problems:
            print(f"problem: {p}")
        print("valid" if ok else "INVALID")
    return result, ok


def _print_file(f: Dict[str, Any], show_tensors: bool) -> None:
    print(f"{f['path']}")
    if not f["valid"]:
        print(f"  INVALID: {f['error']}")
        return
    totals = f["totals"]
    print(f"  {totals['tensors']} tensors, {_human(totals['bytes'])} of data"
          + ("" if f["header_bytes"] is None else f", header {_human(f['header_bytes'])}, file {_human(f['file_bytes'])}"))
    if f["metadata"]:
        print("  metadata: " + ", ".join(f"{k}={v}" for k, v in sorted(f["metadata"].items())))
    if show_tensors and f["tensors"]:
        width = max(len(t["name"]) for t in f["tensors"])
        for t in f["tensors"]:
            print(f"    {t['name']:<{width}}  {t['dtype']:<11} {str(t['shape']):<20} {_human(t['bytes'])}")


def _print_totals(totals: Dict[str, Any]) -> None:
    print(f"total: {totals['files']} file(s), {totals['tensors']} tensors, "
          f"{totals['elements']:,} elements, {_human(totals['bytes'])}")
    for dtype, agg in sorted(totals["by_dtype"].items()):
        print(f"  {dtype:<11} {agg['tensors']:>6} tensors {agg['elements']:>16,} elements {_human(agg['bytes']):>12}")


# ---------------------------------------------------------------------------- verify


def _signed(args: argparse.Namespace) -> Optional[Any]:
    """The `verify=` value the --signature/--digests options describe, or None."""
    if args.digests is not None:
        if args.signature is not None:
            raise UsageError("give --signature or --digests, not both")
        try:
            with open(args.digests, encoding="utf-8") as f:
                return Digests(json.load(f))
        except (OSError, ValueError, TypeError) as e:
            raise UsageError(f"--digests {args.digests}: {e}") from None
    keyless = (args.identity, args.issuer, args.trusted_root, args.use_staging or None)
    if args.signature is None:
        if args.public_key or args.certificate_chain or any(k is not None for k in keyless):
            raise UsageError("--public-key, --certificate-chain, --identity, --identity-provider, --trusted-root and "
                             "--use-staging go with --signature")
        if args.ignore_paths or args.allow_symlinks:
            raise UsageError("--ignore-paths and --allow-symlinks go with --signature or --digests")
        return None
    try:
        trusted_root = args.trusted_root
        if args.use_staging:
            if trusted_root is not None:
                raise UsageError("give --trusted-root or --use-staging, not both")
            trusted_root = default_trusted_root(staging=True)
        return Signature(args.signature, public_key=args.public_key, certificate_chain=args.certificate_chain or None,
                         identity=args.identity, issuer=args.issuer, trusted_root=trusted_root,
                         allow_symlinks=args.allow_symlinks)
    except ValueError as e:
        raise UsageError(str(e)) from None


def cmd_verify(args: argparse.Namespace) -> Tuple[Dict[str, Any], bool]:
    """With a signature or digests: every file of the directory against them (weights or
    not). Without: header rules, then every byte of every tensor read, then the cross-file
    checks."""
    signed = _signed(args)
    if signed is not None:
        return _verify_signed(args, signed)
    ckpts = expand_paths(args.paths)
    files = _describe_all(ckpts)
    show = progress_enabled(args.progress, default=True)
    total = sum(f.get("file_bytes", 0) for f in files)
    with ByteProgress(show, desc="verifying", total=total) as bar:
        for f in files:
            if f["valid"]:
                _verify_data(f, args)
            bar.update(f.get("file_bytes", 0))
    problems = _problems(ckpts)
    ok = all(f["valid"] for f in files) and not problems
    result = {"command": "verify", "valid": ok, "indexes": [c.index for c in ckpts if c.index], "problems": problems,
              "files": [{k: f.get(k) for k in ("path", "valid", "error", "read_path", "file_bytes")}
                        for f in files]}
    if not args.json:
        for f in files:
            how = f" (read: {f['read_path']})" if f.get("read_path") else ""
            print(f"{'ok' if f['valid'] else 'FAILED'}  {f['path']}{how}")
            if f["error"]:
                print(f"    {f['error']}")
        for p in problems:
            print(f"problem: {p}")
        n_bad = sum(not f["valid"] for f in files)
        print(f"{len(files) - n_bad} of {len(files)} file(s) valid" + (f", {len(problems)} problem(s)" if problems else ""))
    return result, ok


def _ignored(model: str, paths: Sequence[str]) -> List[str]:
    """The `--ignore-paths` inside the model, relative to it, as model_signing resolves them (from
    the working directory, links resolved); those outside it are dropped."""
    root = os.path.realpath(model)
    out = []
    for p in paths:
        rel = os.path.relpath(os.path.realpath(p), root)
        if rel != ".." and not rel.startswith("../"):
            out.append(rel)
    return out


def _verify_signed(args: argparse.Namespace, signed: Any) -> Tuple[Dict[str, Any], bool]:
    """`verify --signature/--digests MODEL`: each file of MODEL (a directory, or the file of a
    signature of a single file) hashed once and compared; each missing, extra or changed one
    named."""
    if len(args.paths) != 1 or not os.path.exists(args.paths[0]):
        raise UsageError("verify --signature/--digests checks one model, a directory or a file: pass it alone")
    model = args.paths[0]
    spec = json.loads(verify_spec(signed, [model]))
    spec.update(ignore_paths=_ignored(model, args.ignore_paths), ignore_git_paths=args.ignore_git_paths)
    if args.allow_symlinks is not None:
        spec["allow_symlinks"] = args.allow_symlinks
    try:
        lines = ops.verify_tree(model, json.dumps(spec))
    except RuntimeError as e:
        result = {"command": "verify", "valid": False, "error": str(e), "files": []}
        if not args.json:
            print(f"FAILED  {e}")
        return result, False
    files = [dict(zip(("status", "name", "detail"), line.split("\t", 2))) for line in lines]
    ok = bool(files) and all(f["status"] == "ok" for f in files)
    if not args.json:
        for f in files:
            print(f"{f['status'] if f['status'] != 'ok' else 'ok':<10} {f['name']}"
                  + (f"\n    {f['detail']}" if f["detail"] else ""))
        bad = sum(f["status"] != "ok" for f in files)
        print(f"{len(files) - bad} of {len(files)} file(s) verified" + (f", {bad} failed" if bad else ""))
    return {"command": "verify", "valid": ok, "files": files}, ok


def _verify_data(f: Dict[str, Any], args: argparse.Namespace) -> None:
    """Reads the whole file through the loader and checks what came back against the header."""
    try:
        names, loaded, read_paths = ops.load_with_report([f["path"]], _device(args.device), None,
                                                         args.reader, None)
        tensors = dict(zip(names, loaded))
    except RuntimeError as e:
        f.update(valid=False, error=str(e))
        return
    f["read_path"] = read_paths[0] if read_paths else None
    logger.debug("%s: read with %s", f["path"], f["read_path"])
    for t in f["tensors"]:
        got = tensors.get(t["name"])
        want_dtype = DTYPES[t["dtype"]][0]
        if got is None or got.dtype != want_dtype or got.numel() * got.element_size() != t["bytes"]:
            f.update(valid=False, error=f"{f['path']}: tensor '{t['name']}' did not load as its header says")
            return
    if len(tensors) != len(f["tensors"]):
        f.update(valid=False, error=f"{f['path']}: loaded {len(tensors)} tensors, header has {len(f['tensors'])}")


# ---------------------------------------------------------------------------- bench

def resident_fraction(path: str) -> Optional[float]:
    """Fraction of the file's pages in the page cache, as the loader's `auto` reader sees
    it, or None if the kernel will not say."""
    try:
        return ops.resident_fraction(path)
    except RuntimeError:
        return None


def evict(path: str) -> None:
    """Drops a file's pages from the page cache (no root needed for clean pages)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def warm(path: str) -> None:
    with open(path, "rb") as f:
        while f.read(1 << 24):
            pass


def touch(tensors: Dict[str, torch.Tensor]) -> None:
    """Reads one byte of every page of every tensor, so lazily mapped data is really loaded
    (safetensors maps files; the time of a load that reads nothing means little)."""
    cuda = False
    for t in tensors.values():
        if t.numel() == 0:
            continue
        if t.is_cuda:
            cuda = True
            continue
        t.reshape(-1).view(torch.uint8)[::4096].sum()
    if cuda:
        torch.cuda.synchronize()


def _device(name: str) -> str:
    """--device, checked before any file is touched: a device the loader refuses, or a CUDA
    device where torch sees none, is a usage error."""
    try:
        device = api._device_name(name)
    except ValueError as e:
        raise UsageError(f"--device {name}: {e}") from None
    if device.startswith("cuda"):
        count, index = torch.cuda.device_count(), torch.device(device).index
        if count == 0:
            raise UsageError(f"--device {name}: no CUDA device is visible (torch.cuda.device_count() is 0)")
        if index is not None and index >= count:
            raise UsageError(f"--device {name}: there is no CUDA device {index} (torch sees {count})")
    return device


def _loaders(args: argparse.Namespace, paths: List[str]) -> Dict[str, Callable[[List[str]], Dict[str, torch.Tensor]]]:
    device = _device(args.device)
    loaders: Dict[str, Callable[[List[str]], Dict[str, torch.Tensor]]] = {
        "fastsafetensors_rs": lambda files: api.load(files, device=device, reader=args.reader),
    }
    if any(api.is_url(p) for p in paths):
        print("safetensors reads local files only: benchmarking fastsafetensors_rs alone", file=sys.stderr)
    elif not args.no_safetensors:
        try:
            from safetensors.torch import load_file as st_load_file
        except ImportError:
            print("safetensors is not installed: benchmarking fastsafetensors_rs alone", file=sys.stderr)
        else:
            def st_load(files: List[str]) -> Dict[str, torch.Tensor]:
                out: Dict[str, torch.Tensor] = {}
                for f in files:
                    out.update(st_load_file(f, device=device))
                return out
            loaders["safetensors"] = st_load
    return loaders


def cmd_bench(args: argparse.Namespace) -> Tuple[Dict[str, Any], bool]:
    ckpts = expand_paths(args.paths)
    files = _describe_all(ckpts)
    errors = [f["error"] for f in files if not f["valid"]] + _problems(ckpts)
    if errors:
        for e in errors:
            print(f"{PROG} bench: {e}", file=sys.stderr)
        return {"command": "bench", "valid": False, "files": [f["path"] for f in files], "errors": errors}, False
    paths = [f["path"] for f in files]
    total = sum(f["file_bytes"] for f in files)
    modes = args.modes
    loaders = _loaders(args, paths)
    runs = [(mode, name) for mode in modes for _ in range(args.repeat) for name in loaders]
    seconds: Dict[Tuple[str, str], List[float]] = {}
    notes: List[str] = []
    show = progress_enabled(args.progress, default=True)
    for mode, name in progress(runs, show, desc="benchmarking", unit="run"):
        for p in paths:
            if api.is_url(p):
                continue  # an object is fetched at every load: there is no cache to empty or fill
            if mode == "cold":
                evict(p)
            else:
                warm(p)
        if mode == "cold":
            resident = [resident_fraction(p) for p in paths if not api.is_url(p)]
            if any(r is not None and r > 0.05 for r in resident):
                notes.append(f"cold run of {name}: files still partly cached after eviction")
        gc.collect()
        start = time.perf_counter()
        tensors = loaders[name](paths)
        touch(tensors)
        seconds.setdefault((mode, name), []).append(time.perf_counter() - start)
        del tensors
    results = []
    for (mode, name), times in seconds.items():
        med = statistics.median(times)
        results.append({"mode": mode, "loader": name, "seconds": times, "median_s": med,
                        "gb_per_s": total / med / 1e9 if med > 0 else None})
    for mode in modes:
        ours = seconds.get((mode, "fastsafetensors_rs"))
        theirs = seconds.get((mode, "safetensors"))
        if ours and theirs:
            for r in results:
                if r["mode"] == mode and r["loader"] == "fastsafetensors_rs":
                    r["speedup_vs_safetensors"] = statistics.median(theirs) / statistics.median(ours)
    if args.save:
        results += _bench_saves(args, paths, show)
    result = {"command": "bench", "valid": True, "files": paths, "bytes": total, "device": str(args.device),
              "reader": args.reader or os.environ.get("FASTSAFETENSORS_READER") or "auto",
              "repeat": args.repeat, "results": results, "notes": sorted(set(notes))}
    if not args.json:
        print(f"{len(paths)} file(s), {_human(total)}, device {args.device}, reader {result['reader']}, "
              f"median of {args.repeat}")
        width = max((len(r["loader"]) for r in results), default=0)
        for r in results:
            extra = f"  ({r['speedup_vs_safetensors']:.2f}x safetensors)" if "speedup_vs_safetensors" in r else ""
            print(f"  {r['mode']:<5} {r['loader']:<{width}} {r['median_s'] * 1e3:10.1f} ms  "
                  f"{r['gb_per_s']:8.2f} GB/s{extra}")
        for n in result["notes"]:
            print(f"note: {n}")
    return result, True


def _fsync(paths: List[str]) -> None:
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _bench_saves(args: argparse.Namespace, paths: List[str], show: bool) -> List[Dict[str, Any]]:
    """--save DIR: the checkpoint loaded once (to --device), then saved into DIR as many times
    as --repeat, in as many shards as it has files: `fastsafetensors_rs.save` (first in every
    round), and safetensors' `save_file` of the same shards (as ours' index lists them)
    followed by an fsync of each file and of DIR (a save counts once it is durable, as ours is
    when it returns). Each save replaces the previous one."""
    tensors = api.load(paths, device=_device(args.device), reader=args.reader)
    total = sum(t.numel() * t.element_size() for t in tensors.values())
    shard_bytes = total // len(paths) + 1
    out = os.path.abspath(args.save)
    shards: List[List[str]] = []  # ours' shards, as its index (or single file) has them

    def ours() -> List[str]:
        from .saving import save
        return save(tensors, out, max_shard_size=shard_bytes)

    def groups(written: List[str]) -> List[List[str]]:
        if not written[-1].endswith(".index.json"):
            return [list(tensors)]
        with open(written[-1], encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        return [[n for n in tensors if weight_map[n] == os.path.basename(p)] for p in written[:-1]]

    def stock() -> None:
        from safetensors.torch import save_file
        written = []
        for i, names in enumerate(shards):
            written.append(os.path.join(out, f"st-{i:05d}.safetensors"))
            save_file({k: tensors[k].contiguous() for k in names}, written[-1])
        _fsync(written + [out])

    savers = {"fastsafetensors_rs": ours}
    if not args.no_safetensors:
        savers["safetensors"] = stock
    seconds: Dict[str, List[float]] = {}
    for name in progress([n for _ in range(args.repeat) for n in savers], show, desc="saving", unit="run"):
        shutil.rmtree(out, ignore_errors=True)
        os.makedirs(out)
        start = time.perf_counter()
        written = savers[name]()
        seconds.setdefault(name, []).append(time.perf_counter() - start)
        if written and not shards:
            shards.extend(groups(written))
    shutil.rmtree(out, ignore_errors=True)
    results = [{"mode": "save", "loader": name, "seconds": times, "median_s": statistics.median(times),
                "gb_per_s": total / statistics.median(times) / 1e9} for name, times in seconds.items()]
    if "safetensors" in seconds:
        results[0]["speedup_vs_safetensors"] = statistics.median(seconds["safetensors"]) / results[0]["median_s"]
    return results


# ---------------------------------------------------------------------------- main


PROG = "python -m fastsafetensors_rs"
MODES = ("cold", "warm")


def _repeat(text: str) -> int:
    """--repeat: a whole number, 1 or more."""
    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a whole number of runs, got {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {n}")
    return n


def _modes(text: str) -> List[str]:
    """--modes: comma-separated cold and warm, at least one."""
    modes = [m.strip() for m in text.split(",") if m.strip()]
    for m in modes:
        if m not in MODES:
            raise argparse.ArgumentTypeError(f"unknown mode {m!r} (cold, warm)")
    if not modes:
        raise argparse.ArgumentTypeError("no mode given (cold, warm, or cold,warm)")
    return modes


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog=PROG,
        description="Inspect, verify and benchmark .safetensors checkpoints.",
    )
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument("paths", nargs="+", metavar="PATH",
                        help="a .safetensors file, a directory or a model.safetensors.index.json")
    common.add_argument("--json", action="store_true", help="print one JSON document on stdout")
    common.add_argument("-v", "--verbose", action="store_true", help="log the loader's decisions to stderr")
    bars = common.add_mutually_exclusive_group()
    bars.add_argument("--progress", dest="progress", action="store_true", default=None,
                      help="show progress bars (default, unless FASTSAFETENSORS_PROGRESS=0)")
    bars.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bars")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    p = sub.add_parser("inspect", parents=[common], help="dtypes, shapes, sizes, metadata, totals (header only)")
    p.add_argument("--summary", action="store_true", help="totals only, no per-tensor listing")
    p.set_defaults(run=cmd_inspect)

    loading = argparse.ArgumentParser(add_help=False)
    loading.add_argument("--device", default="cpu", help="where to load (cpu, cuda, cuda:N); default cpu")
    loading.add_argument("--reader", choices=["auto", "direct", "mmap"], default=None,
                         help="the loader's reader (default: $FASTSAFETENSORS_READER, else auto)")

    p = sub.add_parser("verify", parents=[common, loading],
                       help="check every format rule and read every byte, or (with --signature or --digests) "
                            "every file against a signed manifest; exit 1 on a bad file")
    # model_signing's spellings (`--public_key`, ...) beside ours: `model_signing verify key ARGS`
    # works as `verify ARGS`.
    p.add_argument("--signature", help="an OpenSSF model-signing signature (model.sig) of the directory (or file)")
    p.add_argument("--public-key", "--public_key", dest="public_key",
                   help="the signer's PEM public key (model_signing sign key)")
    p.add_argument("--certificate-chain", "--certificate_chain", dest="certificate_chain", action="append",
                   metavar="PEM", help="a PEM file of the signer's chain, up to its root (model_signing sign "
                                       "certificate); repeat for each")
    p.add_argument("--identity", help="a keyless (Sigstore) signature's signer: the email or URI of its certificate "
                                      "(model_signing verify sigstore)")
    p.add_argument("--identity-provider", "--identity_provider", "--issuer", dest="issuer", metavar="URL",
                   help="the OIDC issuer that vouched for --identity (e.g. https://accounts.google.com)")
    p.add_argument("--trusted-root", "--trusted_root", "--trust-config", "--trust_config", dest="trusted_root",
                   metavar="FILE", help="the Sigstore trusted root (trusted_root.json, or a client trust "
                                        "configuration) for --identity; default: the production one the installed "
                                        "sigstore package ships. Nothing is fetched")
    p.add_argument("--use-staging", "--use_staging", dest="use_staging", action="store_true",
                   help="with --identity: Sigstore's staging trusted root, as the sigstore package ships it")
    p.add_argument("--digests", help="a JSON file of {file name: 'sha256:<hex>'}")
    p.add_argument("--ignore-paths", "--ignore_paths", dest="ignore_paths", action="append", metavar="PATH",
                   default=[], help="a file or folder of the model not to report when unsigned (beside those the "
                                    "signature records); repeat for each")
    p.add_argument("--ignore-git-paths", "--ignore_git_paths", dest="ignore_git_paths", action="store_true",
                   default=True, help="leave git's files at the model's top out (default)")
    p.add_argument("--no-ignore-git-paths", "--no-ignore_git_paths", dest="ignore_git_paths", action="store_false",
                   help="report git's files at the model's top when unsigned")
    p.add_argument("--allow-symlinks", "--allow_symlinks", dest="allow_symlinks", action="store_true",
                   default=None, help="follow symbolic links where the signature records allow_symlinks=false")
    p.set_defaults(run=cmd_verify)

    p = sub.add_parser("bench", parents=[common, loading],
                       help="load throughput of fastsafetensors_rs vs safetensors, cold and warm")
    p.add_argument("--repeat", type=_repeat, default=3, help="runs per loader and mode (median reported)")
    p.add_argument("--modes", type=_modes, default="cold,warm",
                   help="comma-separated: cold (page cache evicted), warm")
    p.add_argument("--no-safetensors", action="store_true", help="time fastsafetensors_rs only")
    p.add_argument("--save", metavar="DIR",
                   help="also time saving the checkpoint into DIR (replaced), in as many shards as it has files, "
                        "until durable: fastsafetensors_rs.save vs safetensors' save_file + fsync")
    p.set_defaults(run=cmd_bench)

    keep.add_parser(sub)
    return parser


def _check_settings() -> None:
    """Every FASTSAFETENSORS_* setting, before any work: a malformed one is a usage error."""
    try:
        api.check_settings()
        ops.load([], "cpu")  # a load of no files checks the core's settings
    except (ValueError, RuntimeError) as e:
        raise UsageError(str(e)) from None


def main(argv: Optional[Sequence[str]] = None) -> int:
    """Runs the command line; returns the exit status. Output cut short by a closed pipe
    (`... | head`) ends the program quietly with status 141, as SIGPIPE ends other tools.
    What it writes shows URLs without their credentials or query strings (`redact`)."""
    out, err = sys.stdout, sys.stderr
    sys.stdout, sys.stderr = _Redacting(out), _Redacting(err)
    try:
        return _main(argv)
    except BrokenPipeError:
        _discard_stdout()
        return 141
    except KeyboardInterrupt:
        return 130
    finally:
        sys.stdout, sys.stderr = out, err


class _Redacting:
    """A text stream that writes what it is given to `stream`, URLs redacted. Every write
    holds whole URLs: print writes its text at once, and json.dump each string at once."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        return self._stream.write(redact(text))

    def __getattr__(self, name: str):  # flush, fileno, isatty, encoding, ...
        return getattr(self._stream, name)


def _discard_stdout() -> None:
    """Points stdout at /dev/null, so that the interpreter's last flush of what the closed
    pipe did not take raises nothing at exit."""
    try:
        fd = sys.stdout.fileno()
    except (AttributeError, OSError, ValueError):  # replaced by a non-file (e.g. in tests)
        return
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, fd)
    os.close(devnull)


def _failed(args: argparse.Namespace, error: str, status: int) -> int:
    """Reports a command that could not run: one line on stderr and, with --json, a JSON
    document saying so on stdout."""
    print(f"{PROG} {args.command}: {error}", file=sys.stderr)
    if args.json:
        json.dump({"command": args.command, "valid": False, "error": error}, sys.stdout, indent=2)
        sys.stdout.write("\n")
        sys.stdout.flush()
    return status


def _main(argv: Optional[Sequence[str]]) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help(sys.stderr)
        return 2
    if args.verbose:
        enable_logging("debug")
    try:
        _check_settings()
        result, ok = args.run(args)
    except BrokenPipeError:
        raise  # handled by main
    except (UsageError, ValueError) as e:  # the command line, or a malformed setting
        return _failed(args, str(e), 2)
    except (RuntimeError, OSError) as e:  # what the loaders raise; -v shows where
        if args.verbose:
            logger.exception("%s failed", args.command)
        return _failed(args, str(e), 1)
    if args.json:
        json.dump(result, sys.stdout, indent=2)
        sys.stdout.write("\n")
    sys.stdout.flush()  # a closed pipe shows here, inside main, not at exit
    return 0 if ok else 1
