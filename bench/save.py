#!/usr/bin/env python3
"""Durable saves of a sharded checkpoint against the ways users save today.

The tensors of bench.py's checkpoint (2 GB, Llama-shaped bf16; random bits in host memory,
made in the worker before the clock) are saved as 4 shards, each row timed until its files
are durable, into the same directory (emptied before every run):

- ours: `fastsafetensors_rs.save(tensors, dir, max_shard_size=...)`, a cap that gives 4
  shards (the call syncs its files and the directory itself);
- safetensors: `safetensors.torch.save_file` of each of the same 4 groups of tensors, then an
  fsync of each file and of the directory;
- ibm-0.5: IBM's `fastsafetensors.saver.save_sharded(..., num_shards=4, fsync=True)` (it
  syncs its files and the directory), installed with `pip install --no-deps --target` into
  build/bench-peers/ on first use;
- torch.save: `torch.save` of each group to a `.pt` file, then the same fsyncs;
- dd: one `dd bs=16M oflag=direct conv=fsync` per shard, all 4 at once, writing the shards'
  bytes from a file in the page cache: the disk's limit for 4 files;
- ours-2-ranks, ours-4-ranks: the same save from a gloo group of 2 or 4 processes on this
  machine, each holding all the tensors (`save(..., process_group=)`): the slowest rank's time
  from a barrier to its return, and the bytes each rank wrote to storage (/proc/self/io), which
  should be 1/N of the checkpoint each; rank 0 reads the checkpoint back and compares it with
  its tensors (outside the clock);
- before (with `--before DIR`): ours as an earlier build installed in DIR
  (`pip install --no-deps --target DIR old.whl`) saves, in the same run: a change's before
  and after.

Each run is a fresh process; rows are interleaved in a new order each round after SETTLE
seconds of idle disk; the median of `--runs` is reported with the peak RSS of the saving
process (`ru_maxrss`, reset after the tensors are made), and the ratios of ours to each peer.

    .venv/bin/python bench/save.py [--size-gb 2] [--shards 4] [--runs 5] [--max-memory M] [--json out.json]
                                   [--before DIR [--before-name NAME]]
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import bench  # noqa: E402  (the tensor shapes and the page-cache helpers)
from scenarios import reset_peak, rss  # noqa: E402

ROWS = ["ours", "safetensors", "ibm-0.5", "torch.save", "dd", "ours-2-ranks", "ours-4-ranks"]
BEFORE = "before"
REPO = Path(__file__).resolve().parents[1]
IBM_REQUIREMENT = "fastsafetensors==0.5.0"
# Not in .venv: the test suite checks that IBM's package is absent there (tests/python/test_alias.py).
IBM_DIR = REPO / "build" / "bench-peers" / "fastsafetensors-0.5.0"
SETTLE_SECONDS = bench.SETTLE_SECONDS
DEFAULT_BUDGET = 1 << 30  # the stream budget a save takes when max_memory is not given
RSS_SLACK = 256 << 20
# ours / peer, at least (speed: the peer's median seconds over ours).
TARGETS = {"safetensors": 2.0, "ibm-0.5": 1.2, "torch.save": 1.5, "dd": 0.8}
MiB = 2**20


# ------------------------------------------------------------------ the checkpoint
def greedy(sizes: list[int], cap: int) -> list[list[int]]:
    """transformers' packing (and ours): a new shard when the next tensor would pass `cap`."""
    shards: list[list[int]] = [[]]
    total = 0
    for i, n in enumerate(sizes):
        if shards[-1] and total + n > cap:
            shards.append([])
            total = 0
        shards[-1].append(i)
        total += n
    return shards


def plan(size_gb: float, shards: int) -> tuple[list[tuple[str, tuple[int, ...]]], int, list[list[str]]]:
    """The tensors (bench.llama_shapes), the smallest `max_shard_size` giving at most `shards`
    shards, and the groups it gives: what ours writes for that cap (rust/plan/save.rs evens
    the shards the same way), and what the peers are handed."""
    shapes = bench.llama_shapes(int(size_gb * 1e9))
    sizes = [2 * math.prod(shape) for _, shape in shapes]
    low, high = max(sizes), sum(sizes)
    while low < high:
        mid = (low + high) // 2
        low, high = (low, mid) if len(greedy(sizes, mid)) <= shards else (mid + 1, high)
    groups = [[shapes[i][0] for i in g] for g in greedy(sizes, low)]
    if len(groups) != shards:
        raise SystemExit(f"{len(shapes)} tensors of {size_gb:g} GB cannot be split into {shards} shards")
    return shapes, low, groups


def make_tensors(shapes: list[tuple[str, tuple[int, ...]]]) -> dict[str, Any]:
    """Random bf16 tensors, each its own allocation in host memory."""
    import numpy as np
    import torch

    rng, tensors = np.random.default_rng(0), {}
    for name, shape in shapes:
        t = torch.empty(shape, dtype=torch.bfloat16)
        u8 = t.view(-1).view(torch.uint8).numpy()
        u8[:] = np.frombuffer(rng.bytes(u8.size), np.uint8)
        tensors[name] = t
    return tensors


def shard_name(k: int, n: int, ext: str) -> str:
    return f"model-{k + 1:05d}-of-{n:05d}.{ext}"


def budget_bytes(max_memory: str | None) -> int | None:
    """The save's host-memory budget as rust/source/budget.rs reads it (None: unlimited)."""
    max_memory = max_memory or os.environ.get("FASTSAFETENSORS_MAX_MEMORY")
    if max_memory is None:
        with open("/proc/meminfo") as fh:
            available = 1024 * int(next(line for line in fh if line.startswith("MemAvailable:")).split()[1])
        return min(DEFAULT_BUDGET, available // 2)
    text = max_memory.strip().lower()
    if text == "unlimited":
        return None
    digits = len(text) - len(text.lstrip("0123456789"))
    unit = text[digits:].strip()
    shifts = {"": 0, "b": 0, "k": 10, "kb": 10, "kib": 10, "m": 20, "mb": 20, "mib": 20,
              "g": 30, "gb": 30, "gib": 30, "t": 40, "tb": 40, "tib": 40}
    if not digits or unit not in shifts:
        raise SystemExit(f"max_memory {max_memory!r}: expected bytes with an optional K/M/G/T suffix, or 'unlimited'")
    return int(text[:digits]) << shifts[unit]


# ------------------------------------------------------------------ worker process
def fsync_all(paths: list[str], directory: str) -> None:
    """What makes a peer's save durable: its files' data, then their names."""
    for path in paths + [directory]:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def run_dd(out: str, src: str, sizes: list[int]) -> None:
    """One `dd` per shard, all at once, each copying its slice of `src` (in the page cache)."""
    procs, offset = [], 0
    for k, n in enumerate(sizes):
        procs.append(subprocess.Popen(
            ["dd", f"if={src}", f"of={out}/{shard_name(k, len(sizes), 'bin')}", "bs=16M",
             "iflag=skip_bytes,count_bytes", f"skip={offset}", f"count={n}",
             "oflag=direct", "conv=fsync", "status=none"]))
        offset += n
    for proc in procs:
        if proc.wait():
            raise subprocess.CalledProcessError(proc.returncode, proc.args)


def listing(directory: str) -> dict[str, int]:
    """The files a save left, with their sizes."""
    return {p.name: p.stat().st_size for p in sorted(Path(directory).iterdir())}


def worker(row: str, out: str, size_gb: float, shards: int, max_memory: str | None, src: str) -> dict[str, Any]:
    """One timed save in this (fresh) process: imports and tensors before the clock."""
    shapes, cap, groups = plan(size_gb, shards)
    if row == "dd":
        size = {name: 2 * math.prod(shape) for name, shape in shapes}
        sizes = [sum(size[name] for name in g) for g in groups]
        start = time.perf_counter()
        run_dd(out, src, sizes)
        fsync_all([], out)
        seconds = time.perf_counter() - start
        # The largest of the dd processes' own peaks.
        peak = resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
        return {"seconds": seconds, "bytes": sum(sizes), "peak": peak, "files": listing(out)}

    import torch
    result: dict[str, Any] = {}
    if row in ("ours", BEFORE):
        import fastsafetensors_rs
        result["package"] = str(Path(fastsafetensors_rs.__file__).parent)
    elif row == "safetensors":
        from safetensors.torch import save_file
    elif row == "ibm-0.5":
        import fastsafetensors
        from fastsafetensors.saver import plain_entry, save_sharded
        result["ibm"] = f"{fastsafetensors.__version__} from {Path(fastsafetensors.__file__).parent}"
    elif row != "torch.save":
        raise ValueError(row)
    tensors = make_tensors(shapes)
    parts = [{name: tensors[name] for name in g} for g in groups]
    # From here on the peak is the save's own (making the tensors went through temporaries).
    result["peak_reset"] = reset_peak()
    before = rss()
    start = time.perf_counter()
    if row in ("ours", BEFORE):
        written = fastsafetensors_rs.save(tensors, out, max_shard_size=cap, metadata={"format": "pt"},
                                          max_memory=max_memory)
    elif row == "ibm-0.5":
        written = save_sharded([plain_entry(name, t) for name, t in tensors.items()],
                               os.path.join(out, "model"), num_shards=shards, fsync=True)
    else:
        ext = "safetensors" if row == "safetensors" else "pt"
        written = [os.path.join(out, shard_name(k, shards, ext)) for k in range(shards)]
        for part, path in zip(parts, written):
            if row == "safetensors":
                save_file(part, path, metadata={"format": "pt"})
            else:
                torch.save(part, path)
        fsync_all(written, out)
    seconds = time.perf_counter() - start
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    result.update({"seconds": seconds, "bytes": sum(t.nbytes for t in tensors.values()), "peak": peak,
                   "before": before, "files": listing(out)})
    if row == "ours":  # its shards, to check that the peers were handed the same groups
        index = json.loads((Path(out) / "model.safetensors.index.json").read_text())["weight_map"]
        result["groups"] = [[n for n in index if index[n] == shard_name(k, shards, "safetensors")]
                            for k in range(shards)]
    return result


def group_worker(out: str, size_gb: float, shards: int, max_memory: str | None, rank: int, world: int,
                 init: str) -> dict[str, Any]:
    """One rank of a timed group save (gloo, this machine): every rank holds all the tensors."""
    import torch
    import torch.distributed as dist

    import fastsafetensors_rs

    dist.init_process_group("gloo", init_method=f"file://{init}", rank=rank, world_size=world)
    shapes, cap, _ = plan(size_gb, shards)
    tensors = make_tensors(shapes)
    peak_reset = reset_peak()
    before = rss()
    dist.barrier()
    written_before = io_bytes("write_bytes")
    start = time.perf_counter()
    fastsafetensors_rs.save(tensors, out, max_shard_size=cap, metadata={"format": "pt"}, max_memory=max_memory,
                            process_group=dist.group.WORLD)
    seconds = time.perf_counter() - start
    wrote = io_bytes("write_bytes") - written_before
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    exact = None
    if rank == 0:  # outside the clock: the checkpoint read back, bit for bit
        loaded = fastsafetensors_rs.load(out)
        exact = loaded.keys() == tensors.keys() and all(
            torch.equal(loaded[k].view(torch.uint8), tensors[k].view(torch.uint8)) for k in tensors)
    dist.barrier()
    dist.destroy_process_group()
    return {"seconds": seconds, "bytes": sum(t.nbytes for t in tensors.values()), "peak": peak, "before": before,
            "wrote": wrote, "exact": exact, "peak_reset": peak_reset, "files": listing(out)}


def io_bytes(field: str) -> int:
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def spawn_group(world: int, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """A group save on `world` gloo ranks: the slowest rank's time, each rank's bytes written."""
    init = out.parent / f"save-init-{time.monotonic_ns()}"
    cmd = [sys.executable, __file__, "--size-gb", str(args.size_gb), "--shards", str(args.shards)] + (
        ["--max-memory", args.max_memory] if args.max_memory else [])
    env = dict(os.environ, GLOO_SOCKET_IFNAME="lo")
    procs = [subprocess.Popen(cmd + ["--rank-worker", str(out), str(r), str(world), str(init)], env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for r in range(world)]
    results = []
    try:
        for proc in procs:
            stdout, stderr = proc.communicate(timeout=1800)
            lines = stdout.strip().splitlines()
            if proc.returncode != 0 or not lines:
                return {"error": f"exit status {proc.returncode}: {stderr.strip()[-1500:]}"}
            results.append(json.loads(lines[-1]))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        init.unlink(missing_ok=True)
    return {"seconds": max(r["seconds"] for r in results), "bytes": results[0]["bytes"],
            "peak": max(r["peak"] for r in results), "before": min(r["before"] for r in results),
            "wrote": [r["wrote"] for r in results], "exact": results[0]["exact"], "files": results[0]["files"],
            "peak_reset": all(r["peak_reset"] for r in results)}


def group_size_of(row: str) -> int | None:
    return int(row.split("-")[1]) if row.startswith("ours-") and row.endswith("-ranks") else None


# ------------------------------------------------------------------ driver
def ensure_ibm() -> tuple[Path | None, str]:
    """IBM's 0.5 in its own directory (PYTHONPATH for its row, beside .venv's torch), installed
    on first use; `(None, why)` where that fails."""
    if (IBM_DIR / "fastsafetensors" / "saver.py").exists():
        return IBM_DIR, "installed"
    tmp = IBM_DIR.with_name(IBM_DIR.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--quiet", "--no-deps", "--target", str(tmp),
                           IBM_REQUIREMENT], capture_output=True, text=True)
    if proc.returncode != 0:
        shutil.rmtree(tmp, ignore_errors=True)
        lines = (proc.stderr or proc.stdout).strip().splitlines()
        return None, f"`pip install --no-deps --target {IBM_DIR} {IBM_REQUIREMENT}` failed: {lines[-1] if lines else proc.returncode}"
    tmp.rename(IBM_DIR)
    return IBM_DIR, "installed now"


def ensure_source(path: Path, nbytes: int) -> None:
    """dd's input: random bytes as many as the tensors', kept in the page cache."""
    if not path.exists() or path.stat().st_size != nbytes:
        with open(path, "wb") as fh:
            left = nbytes
            while left:
                left -= fh.write(os.urandom(min(left, 64 << 20)))


def empty(directory: Path) -> None:
    shutil.rmtree(directory, ignore_errors=True)
    directory.mkdir(parents=True)
    os.sync()  # the deletions' own writes, before the idle pause


def spawn(row: str, args: argparse.Namespace, out: Path, src: Path, ibm: Path | None) -> dict[str, Any]:
    if group_size_of(row):
        return spawn_group(group_size_of(row), args, out)
    env = None
    if row == "ibm-0.5":
        env = dict(os.environ, PYTHONPATH=str(ibm))
    elif row == BEFORE:
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(filter(None, [str(args.before.resolve()),
                                                                        os.environ.get("PYTHONPATH")])))
    cmd = [sys.executable, __file__, "--worker", row, str(out), str(src), "--size-gb", str(args.size_gb),
           "--shards", str(args.shards)] + (["--max-memory", args.max_memory] if args.max_memory else [])
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"error": f"exit status {proc.returncode}: {proc.stderr.strip()[-1500:]}"}
    return json.loads(lines[-1])


def cell(value: float | None, fmt: str) -> str:
    return "-" if value is None else fmt.format(value)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--size-gb", type=float, default=2.0, help="tensor bytes in all (GB, 1e9 bytes)")
    p.add_argument("--shards", type=int, default=4)
    p.add_argument("--runs", type=int, default=5, help="runs per row (median)")
    p.add_argument("--dir", type=Path, default=REPO / "bench-data",
                   help="where the checkpoint is written (save-out/) and dd reads from (git-ignored)")
    p.add_argument("--max-memory", help="ours' max_memory (default: the stream default, 1 GiB)")
    p.add_argument("--rows", default=",".join(ROWS), help="comma-separated subset of " + ",".join(ROWS))
    p.add_argument("--keep", action="store_true", help="keep the last checkpoint written and dd's input")
    p.add_argument("--json", type=Path, help="also write every sample, the medians and the verdicts here")
    p.add_argument("--before", type=Path,
                   help="a directory where an earlier build of the package is installed (pip install --no-deps "
                        "--target): its save gets a row of its own, for before/after figures from one run")
    p.add_argument("--before-name", default="before", help="what that row is called in the table")
    p.add_argument("--worker", nargs=3, metavar=("ROW", "OUT", "SRC"), help=argparse.SUPPRESS)
    p.add_argument("--rank-worker", nargs=4, metavar=("OUT", "RANK", "WORLD", "INIT"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        row, out, src = args.worker
        print(json.dumps(worker(row, out, args.size_gb, args.shards, args.max_memory, src)))
        return 0
    if args.rank_worker:
        out, rank, world, init = args.rank_worker
        print(json.dumps(group_worker(out, args.size_gb, args.shards, args.max_memory, int(rank), int(world), init)))
        return 0

    rows = [r for r in ROWS if r in args.rows.split(",")]
    if args.before:
        if not (args.before / "fastsafetensors_rs").is_dir():
            print(f"error: --before {args.before}: no fastsafetensors_rs package there "
                  f"(pip install --no-deps --target {args.before} an earlier wheel)")
            return 1
        rows.insert(rows.index("ours") + 1 if "ours" in rows else 0, BEFORE)
    shapes, cap, groups = plan(args.size_gb, args.shards)
    nbytes = sum(2 * math.prod(shape) for _, shape in shapes)
    budget = budget_bytes(args.max_memory)
    out, src = args.dir / "save-out", args.dir / f"save-src-{nbytes}.bin"
    args.dir.mkdir(parents=True, exist_ok=True)
    free = shutil.disk_usage(args.dir).free + (src.stat().st_size if src.exists() else 0)
    if free < 2 * nbytes + (1 << 30):
        print(f"error: {args.dir} has {free / 1e9:.1f} GB free; the bench needs "
              f"{(2 * nbytes + (1 << 30)) / 1e9:.1f} (the checkpoint, dd's input and 1 GB to spare)")
        return 1
    ibm, ibm_status = ensure_ibm() if "ibm-0.5" in rows else (None, "not asked for")
    fs = subprocess.run(["df", "--output=source,fstype", str(args.dir)], capture_output=True,
                        text=True).stdout.split("\n")[1:2]
    print(f"{len(shapes)} bf16 tensors, {nbytes / 1e9:.2f} GB, in {args.shards} shards "
          f"(max_shard_size={cap}), into {out} ({' '.join(fs[0].split()) if fs else '?'})")
    print(f"ibm-0.5: {ibm_status}" + (f" ({ibm})" if ibm else ""))
    samples: dict[str, list[dict[str, Any]]] = {row: [] for row in rows}
    try:
        if "dd" in rows:
            ensure_source(src, nbytes)
        for run in range(args.runs):
            order = rows[:]
            random.Random(run).shuffle(order)
            for row in order:
                if row == "ibm-0.5" and ibm is None:
                    samples[row].append({"error": f"unavailable: {ibm_status}"})
                    continue
                empty(out)
                if row == "dd":
                    bench.prewarm([src])
                    cached = bench.cached_fraction([src])
                    if cached < 0.99:
                        print(f"  warning: {cached:.1%} of dd's input cached")
                time.sleep(SETTLE_SECONDS)
                res = spawn(row, args, out, src, ibm)
                samples[row].append(res)
                shown = res.get("error") or f"{res['seconds']:.2f} s, {res['bytes'] / res['seconds'] / 1e9:.2f} GB/s"
                print(f"  run {run + 1}/{args.runs}  {row:<12} {shown.splitlines()[-1] if shown else ''}", flush=True)
    finally:
        if not args.keep:
            shutil.rmtree(out, ignore_errors=True)
            src.unlink(missing_ok=True)

    return report(args, rows, samples, nbytes, budget, groups, cap)


def report(args: argparse.Namespace, rows: list[str], samples: dict[str, list[dict[str, Any]]], nbytes: int,
           budget: int | None, groups: list[list[str]], cap: int) -> int:
    """Medians, the markdown tables, the checks that the rows wrote what they should."""
    medians: dict[str, dict[str, Any]] = {}
    for row in rows:
        ok = [r for r in samples[row] if "error" not in r]
        m: dict[str, Any] = {"runs": len(ok), "errors": len(samples[row]) - len(ok)}
        if ok:
            m["seconds"] = statistics.median(r["seconds"] for r in ok)
            m["gbps"] = nbytes / m["seconds"] / 1e9
            m["peak_mib"] = max(r["peak"] for r in ok) / MiB
            if row != "dd":
                m["above_tensors_mib"] = max(r["peak"] - r["bytes"] for r in ok) / MiB
                m["during_save_mib"] = max(r["peak"] - r["before"] for r in ok) / MiB
        else:
            m["why"] = samples[row][-1]["error"].splitlines()[-1] if samples[row] else "not run"
        medians[row] = m
    ours = medians.get("ours", {}).get("seconds")

    def speedup(row: str) -> float | None:
        theirs = medians.get(row, {}).get("seconds")
        return theirs / ours if ours and theirs else None

    shown_budget = "unlimited" if budget is None else f"{budget / MiB:.0f} MiB"
    what = {"ours": f"`fastsafetensors_rs.save` (max_memory {shown_budget})",
            "safetensors": "`save_file` per shard + fsync", "ibm-0.5": "`save_sharded(fsync=True)`",
            "torch.save": "`torch.save` per shard + fsync", "dd": f"{args.shards} x `dd oflag=direct conv=fsync`, parallel",
            "ours-2-ranks": "`save(..., process_group=)`, 2 gloo ranks, slowest rank",
            "ours-4-ranks": "`save(..., process_group=)`, 4 gloo ranks, slowest rank",
            BEFORE: f"`fastsafetensors_rs.save`, {args.before_name} ({args.before})"}
    print(f"\nDurable saves: {nbytes / 1e9:.2f} GB of Llama-shaped bf16 in {args.shards} shards, median of "
          f"{args.runs}, rows rotated, fresh process each; GB/s = tensor bytes / s\n")
    print("| row | what is timed | s | GB/s | ours / row | peak RSS MiB | peak - tensors MiB | added by the save MiB |")
    print("|---|---|---|---|---|---|---|---|")
    for row in rows:
        m = medians[row]
        if "seconds" not in m:
            print(f"| {row} | {what[row]} | {m['why']} | | | | | |")
            continue
        print(f"| {row} | {what[row]} | {m['seconds']:.2f} | {m['gbps']:.2f} | {cell(speedup(row), '{:.2f}x')} "
              f"| {m['peak_mib']:.0f}{' (one dd)' if row == 'dd' else ''} "
              f"| {cell(m.get('above_tensors_mib'), '{:.0f}')} | {cell(m.get('during_save_mib'), '{:.0f}')} |")

    verdicts = []
    problems_early: list[str] = []
    for row, bound in TARGETS.items():
        if row in rows:
            value = speedup(row)
            verdicts.append((f"ours >= {bound}x {row}", cell(value, "{:.2f}x"),
                             "SKIP" if value is None else "PASS" if value >= bound else "MISS"))
    if "ours" in rows:
        above = medians["ours"].get("above_tensors_mib")
        limit = None if budget is None else (budget + RSS_SLACK) / MiB
        verdicts.append((f"ours' peak RSS <= tensors + budget + 256 MiB ({cell(limit, '{:.0f} MiB')} above them)",
                         cell(above, "{:.0f} MiB"),
                         "SKIP" if above is None or limit is None else "PASS" if above <= limit else "MISS"))
    for row in rows:
        world = group_size_of(row)
        done = [r for r in samples[row] if "error" not in r]
        if world and done:
            wrote = [max(r["wrote"][k] for r in done) for k in range(world)]
            files = sum(done[0]["files"].values())
            worst = max(abs(w - files / world) for w in wrote) / (files / world)
            exact = all(r["exact"] for r in done)
            print(f"{row}: bytes written per rank (MiB) {[round(w / MiB) for w in wrote]}, the checkpoint's files "
                  f"{files / MiB:.0f} MiB ({files / world / MiB:.0f} each); read back bit-exact: {exact}")
            verdicts.append((f"{row}: each rank writes 1/{world} of the checkpoint (within 1%)", f"{worst:.2%} off",
                             "SKIP" if sum(wrote) == 0 else "PASS" if worst <= 0.01 else "MISS"))
            if not exact:
                problems_early.append(f"{row}: the checkpoint read back differs from the tensors saved")
    print("\n| target | measured | verdict |\n|---|---|---|")
    for label, value, verdict in verdicts:
        print(f"| {label} | {value} | {verdict} |")

    # What the rows wrote: ours the planned shards (the groups the peers saved), the same files as
    # safetensors' save_file, byte count for byte count.
    problems = problems_early + [f"{row}: {m['errors']} of {m['runs'] + m['errors']} runs failed"
                                 for row, m in medians.items() if m["errors"] and not m.get("why", "").startswith("unavailable")]
    first = {row: next((r for r in samples[row] if "error" not in r), None) for row in rows}
    if first.get("ours"):
        if [sorted(g) for g in first["ours"]["groups"]] != [sorted(g) for g in groups]:
            problems.append(f"ours did not write the {args.shards} planned shards (max_shard_size={cap})")
        if first.get("safetensors"):
            theirs = first["safetensors"]["files"]
            if {k: v for k, v in first["ours"]["files"].items() if k in theirs} != theirs:
                problems.append("ours' shards differ in size from safetensors' save_file of the same tensors")
    for row, r in first.items():
        if r and r.get("peak_reset") is False:
            print(f"note: {row}: the peak RSS could not be reset after the tensors were made")
    if first.get("ibm-0.5"):
        print(f"\nibm-0.5: fastsafetensors {first['ibm-0.5']['ibm']}")
    if first.get("ours") and not problems:
        same = " (the same file sizes as safetensors' save_file)" if first.get("safetensors") else ""
        print(f"ours wrote the {args.shards} planned shards{same}")
    for line in problems:
        print(f"error: {line}")
    if args.json:
        args.json.write_text(json.dumps({"bytes": nbytes, "shards": args.shards, "max_shard_size": cap,
                                         "budget": budget, "samples": samples, "medians": medians,
                                         "verdicts": verdicts, "problems": problems}, indent=1))
    return 1 if problems else 0


if __name__ == "__main__":
    sys.exit(main())
