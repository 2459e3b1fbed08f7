#!/usr/bin/env python3
"""Cold and warm page-cache load benchmark for fastsafetensors.

Each loader runs in a fresh subprocess. The timed region starts just before
the load call and ends after every page of every returned tensor has been
touched. The script compares fastsafetensors with ``safetensors.torch.load_file``
and with two physical limits: ``dd iflag=direct`` (cold) and an in-memory copy
(warm). See ``bench/README.md`` for the methodology.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import resource
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable

PAGE = os.sysconf("SC_PAGE_SIZE")
REPO = Path(__file__).resolve().parent.parent
OURS = ["ours", "ours-file"]
PEERS = ["safetensors"]
COLD_ONLY, WARM_ONLY = "dd", "memcpy"
READERS = ["auto", "direct", "mmap"]


# ----------------------------------------------------------------- checkpoint
def llama_shapes(total_bytes: int, min_layers: int = 4) -> list[tuple[str, tuple[int, ...]]]:
    """Llama-style bf16 tensor names and shapes that add up to about ``total_bytes``.

    The hidden size starts at 4096 and is halved until embedding, LM head and
    ``min_layers`` decoder layers fit; then as many layers as fit are added.
    """
    vocab, hidden = 32000, 4096
    while True:
        inter = hidden * 11008 // 4096
        layer = 2 * (4 * hidden * hidden + 3 * inter * hidden + 2 * hidden)
        fixed = 2 * (2 * vocab * hidden + hidden)
        if fixed + min_layers * layer <= total_bytes or hidden <= 256:
            break
        hidden //= 2
    layers = max(1, (total_bytes - fixed) // layer)
    shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(layers):
        p = f"model.layers.{i}."
        shapes += [(p + f"self_attn.{n}_proj.weight", (hidden, hidden)) for n in "qkvo"]
        shapes += [(p + "mlp.gate_proj.weight", (inter, hidden)),
                   (p + "mlp.up_proj.weight", (inter, hidden)),
                   (p + "mlp.down_proj.weight", (hidden, inter)),
                   (p + "input_layernorm.weight", (hidden,)),
                   (p + "post_attention_layernorm.weight", (hidden,))]
    return shapes + [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]


def ensure_checkpoint(root: Path, size_gb: float, nfiles: int) -> tuple[list[Path], bool]:
    """Return the checkpoint files under ``root``, generating them if missing.

    Returns ``(files, generated)``. A manifest records the expected file sizes,
    so a partial or stale checkpoint is regenerated.
    """
    import numpy as np
    import torch
    from safetensors.torch import save_file

    ckpt = root / f"llama-{size_gb:g}gb-{nfiles}f"
    manifest = ckpt / "manifest.json"
    if manifest.exists():
        sizes: dict[str, int] = json.loads(manifest.read_text())
        files = [ckpt / name for name in sizes]
        if all(f.exists() and f.stat().st_size == n for f, n in zip(files, sizes.values())):
            return files, False
    shutil.rmtree(ckpt, ignore_errors=True)
    ckpt.mkdir(parents=True)
    shapes = llama_shapes(int(size_gb * 1e9))
    numels = [int(np.prod(s)) for _, s in shapes]
    budget, groups, acc = sum(numels) / nfiles, [[] for _ in range(nfiles)], 0
    for item, n in zip(shapes, numels):  # split into shards of about equal bytes
        groups[min(int((acc + n / 2) / budget), nfiles - 1)].append(item)
        acc += n
    groups = [g for g in groups if g]
    rng = np.random.default_rng(0)
    sizes = {}
    for k, group in enumerate(groups):
        tensors = {}
        for name, shape in group:  # random bits: fast, and wrong offsets cannot match
            n = int(np.prod(shape))
            bits = rng.integers(0, 2**64 - 1, (n + 3) // 4, dtype=np.uint64).view(np.int16)[:n]
            tensors[name] = torch.from_numpy(bits).view(torch.bfloat16).reshape(shape)
        path = ckpt / f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
        save_file(tensors, str(path), metadata={"format": "pt"})
        with open(path, "rb+") as fh:
            os.fsync(fh.fileno())  # dirty pages cannot be evicted
        sizes[path.name] = path.stat().st_size
    manifest.write_text(json.dumps(sizes, indent=1))
    return [ckpt / name for name in sizes], True


# ----------------------------------------------------------------- page cache
_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int,
                       ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.POINTER(ctypes.c_ubyte)]


def resident_fraction(files: Iterable[Path]) -> float:
    """Fraction of the files' pages currently in the page cache (via mincore)."""
    resident = total = 0
    for path in files:
        size = path.stat().st_size
        pages = (size + PAGE - 1) // PAGE
        with open(path, "rb") as fh:
            addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fh.fileno(), 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap {path}")
            try:
                vec = (ctypes.c_ubyte * pages)()
                if _libc.mincore(addr, size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore {path}")
                resident += sum(b & 1 for b in bytes(vec))
            finally:
                _libc.munmap(addr, size)
        total += pages
    return resident / max(total, 1)


def evict(files: Iterable[Path]) -> None:
    """Drop the files' clean pages from the page cache (no root needed)."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def prewarm(files: Iterable[Path]) -> None:
    """Read the files once so that every page is in the page cache."""
    buf = bytearray(16 << 20)
    for path in files:
        with open(path, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


# --------------------------------------------------------------------- worker
def touch(tensors: Iterable[Any]) -> int:
    """Read one byte per page of every tensor, faulting in lazily mapped data."""
    import torch

    checksum = 0
    for t in tensors:
        if t.numel() == 0:
            continue
        u8 = t.reshape(-1).view(torch.uint8)
        checksum += int(u8[::PAGE].sum()) + int(u8[-1])
    return checksum


def current_rss_kb() -> int:
    """Current resident set size of this process in KiB (Linux)."""
    with open("/proc/self/statm") as fh:
        return int(fh.read().split()[1]) * PAGE // 1024


def load(loader: str, files: list[str]) -> dict[str, Any]:
    """Load every file with ``ours[:reader]``, ``ours-file`` or ``safetensors[:backend]``."""
    import torch

    if loader.startswith("ours-file"):
        import fastsafetensors
        return {k: v for f in files for k, v in fastsafetensors.load_file(f).items()}
    if loader.startswith("ours"):
        reader = loader.partition(":")[2] or None
        return torch.ops.fastsafetensors.load(files, reader=reader)
    from safetensors.torch import load_file
    backend = loader.partition(":")[2] or "mmap"
    return {k: v for f in files for k, v in load_file(f, backend=backend).items()}


def worker(loader: str, files: list[str]) -> dict[str, Any]:
    """Run one timed measurement; called inside a fresh subprocess."""
    nbytes = sum(os.path.getsize(f) for f in files)
    if loader == COLD_ONLY:
        start = time.perf_counter()
        for f in files:
            subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=16M", "iflag=direct",
                            "status=none"], check=True)
        return {"seconds": time.perf_counter() - start, "bytes": nbytes}
    import torch
    if loader.startswith("ours"):
        import fastsafetensors  # noqa: F401  (registers torch.ops.fastsafetensors)
    if loader == WARM_ONLY:
        src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)  # pre-faulted buffers
        dst = torch.empty(nbytes, dtype=torch.uint8).fill_(0)
    base_kb = current_rss_kb()
    start = time.perf_counter()
    if loader == WARM_ONLY:
        tensors = {"dst": dst.copy_(src)}
    else:
        tensors = load(loader, files)
    checksum = touch(tensors.values())
    seconds = time.perf_counter() - start
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"seconds": seconds, "bytes": nbytes, "base_kb": base_kb, "peak_kb": peak_kb,
            "tensors": len(tensors), "checksum": checksum}


def verify(files: list[str]) -> dict[str, Any]:
    """Compare every tensor from each of our loaders bitwise against safetensors."""
    import torch
    from safetensors import safe_open
    try:
        import fastsafetensors  # noqa: F401
        torch.ops.fastsafetensors.load  # noqa: B018
    except (ImportError, AttributeError, RuntimeError) as exc:
        return {"available": False, "reason": f"{type(exc).__name__}: {exc}"}
    errors = []
    for loader in ["ours-file"] + [f"ours:{r}" for r in READERS]:
        ours = load(loader, files)
        seen = 0
        for f in files:
            with safe_open(f, framework="pt") as ref:
                for name in ref.keys():
                    want, got = ref.get_tensor(name), ours.get(name)
                    seen += 1
                    if got is None or got.dtype != want.dtype or got.shape != want.shape \
                            or not torch.equal(got.reshape(-1).view(torch.uint8),
                                               want.reshape(-1).view(torch.uint8)):
                        errors.append(f"{loader}: tensor {name!r} differs")
        if seen != len(ours):
            errors.append(f"{loader}: {len(ours)} tensors returned, expected {seen}")
        del ours
    return {"available": True, "errors": errors[:10]}


def spawn(mode: str, name: str, files: list[Path]) -> dict[str, Any]:
    """Run ``--worker``/``--verify`` in a fresh interpreter; parse its JSON reply."""
    cmd = [sys.executable, __file__, f"--{mode}", name, *map(str, files)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        return {"error": f"exit {proc.returncode}: {proc.stderr.strip()[-2000:]}"}
    return json.loads(lines[-1])


# --------------------------------------------------------------------- driver
Results = dict[str, dict[str, dict[str, Any]]]  # loader -> mode -> summary


def measure(loaders: list[str], files: list[Path], runs: int) -> tuple[Results, bool]:
    """Median cold and warm results per loader, and whether all runs were sound.

    Runs are interleaved across loaders so that slow drift affects all alike.
    """
    samples: dict[str, dict[str, list[dict[str, Any]]]] = {l: {"cold": [], "warm": []} for l in loaders}
    for mode in ("cold", "warm"):
        for run in range(runs):
            for loader in loaders:
                if loader == (WARM_ONLY if mode == "cold" else COLD_ONLY):
                    continue
                if mode == "cold":
                    evict(files)
                else:
                    prewarm(files)
                cached = resident_fraction(files)
                if (mode == "cold" and cached > 0.01) or (mode == "warm" and cached < 0.99):
                    print(f"  warning: {cached:.1%} of pages cached before {mode} run")
                res = spawn("worker", loader, files)
                samples[loader][mode].append(res)
                shown = res.get("error") or f"{res['bytes'] / res['seconds'] / 1e9:.2f} GB/s"
                print(f"  {mode} run {run + 1}/{runs} {loader:<18} {shown}", flush=True)
    results: Results = {}
    for loader, by_mode in samples.items():
        for mode, runs_ in by_mode.items():
            if not runs_:
                continue
            ok = [r for r in runs_ if "error" not in r]
            entry: dict[str, Any] = {"runs": runs_, "errors": len(runs_) - len(ok)}
            if ok:
                entry["gbps"] = ok[0]["bytes"] / statistics.median(r["seconds"] for r in ok) / 1e9
                if "peak_kb" in ok[0]:
                    entry["peak_mb"] = max(r["peak_kb"] for r in ok) / 1024
                    entry["delta_mb"] = max(r["peak_kb"] - r["base_kb"] for r in ok) / 1024
            results.setdefault(loader, {})[mode] = entry
    # Every file loader touches the same bytes, so all of them must agree on the checksum.
    sums = {r["checksum"] for l in loaders if l not in (COLD_ONLY, WARM_ONLY)
            for m in samples[l].values() for r in m if "checksum" in r}
    if len(sums) > 1:
        print(f"  error: page-touch checksums differ between runs or loaders: {sorted(sums)}")
    sound = len(sums) <= 1 and not any(m["errors"] for r in results.values() for m in r.values())
    return results, sound


def cell(value: float | None, fmt: str = "{:.2f}") -> str:
    """Format a table cell, ``-`` for a missing value."""
    return fmt.format(value) if value is not None else "-"


def ratio(a: float | None, b: float | None) -> float | None:
    """``a / b``, or None when either side is missing."""
    return a / b if a is not None and b else None


def report(results: Results, size_mb: float) -> list[str]:
    """Print the results table, ratios and target verdicts; return verdict lines."""
    def gbps(loader: str, mode: str) -> float | None:
        return results.get(loader, {}).get(mode, {}).get("gbps")

    print(f"\n{'loader':<18}{'cold GB/s':>10}{'warm GB/s':>10}{'peak RSS MB':>13}{'Δ MB':>8}")
    for loader, by_mode in results.items():
        rss = [m for m in by_mode.values() if "peak_mb" in m]
        peak = max((m["peak_mb"] for m in rss), default=None)
        delta = max((m["delta_mb"] for m in rss), default=None)
        print(f"{loader:<18}{cell(gbps(loader, 'cold')):>10}{cell(gbps(loader, 'warm')):>10}"
              f"{cell(peak, '{:.0f}'):>13}{cell(delta, '{:.0f}'):>8}")
    cold, warm = gbps("ours", "cold"), gbps("ours", "warm")
    vs_dd, vs_memcpy = ratio(cold, gbps(COLD_ONLY, "cold")), ratio(warm, gbps(WARM_ONLY, "warm"))
    vs_st_cold = ratio(cold, gbps("safetensors", "cold"))
    vs_st_warm = ratio(warm, gbps("safetensors", "warm"))
    print()
    for label, value in [("ours / dd (cold)", vs_dd), ("ours / memcpy (warm)", vs_memcpy),
                         ("ours / safetensors (cold)", vs_st_cold),
                         ("ours / safetensors (warm)", vs_st_warm)]:
        print(f"{label:<27}{cell(value, '{:.2f}x')}")
    deltas = [m["delta_mb"] for m in results.get("ours", {}).values() if "delta_mb" in m]
    delta = max(deltas) if deltas else None
    rss_limit = 1.1 * size_mb + 200
    checks = [("cold: ours >= 0.9x dd", vs_dd, 0.9 <= (vs_dd or 0), "{:.2f}x"),
              ("cold: ours >= 2.5x safetensors", vs_st_cold, 2.5 <= (vs_st_cold or 0), "{:.2f}x"),
              ("warm: ours >= 0.8x safetensors", vs_st_warm, 0.8 <= (vs_st_warm or 0), "{:.2f}x"),
              (f"RSS: ours peak - baseline <= 1.1 x size + 200 MB = {rss_limit:.0f} MB",
               delta, (delta or 0) <= rss_limit, "{:.0f} MB")]
    lines = []
    for label, value, ok, fmt in checks:
        verdict = "SKIP" if value is None else "PASS" if ok else "MISS"
        lines.append(f"[{verdict}] {label}  (measured: {cell(value, fmt)})")
    print("\ntargets:\n  " + "\n  ".join(lines))
    return lines


def parse_args() -> argparse.Namespace:
    """Command-line options; ``--worker``/``--verify`` are internal."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=2.0, help="checkpoint size (GB, 1e9 bytes)")
    ap.add_argument("--files", type=int, default=4, help="number of .safetensors shards")
    ap.add_argument("--runs", type=int, default=3, help="runs per loader and mode (median)")
    ap.add_argument("--dir", type=Path, default=REPO / "bench-data", help="checkpoint cache dir")
    ap.add_argument("--keep", action="store_true", help="keep a newly generated checkpoint")
    ap.add_argument("--extra", default="", help="extra loader rows, comma-separated, e.g. "
                    "ours:direct,ours:mmap,safetensors:pread")
    ap.add_argument("--json", type=Path, help="also write the results as JSON here")
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--verify", help=argparse.SUPPRESS)
    ap.add_argument("paths", nargs="*", help=argparse.SUPPRESS)
    return ap.parse_args()


def main() -> int:
    """Prepare the checkpoint, verify correctness, measure and report."""
    args = parse_args()
    if args.worker or args.verify:
        print(json.dumps(worker(args.worker, args.paths) if args.worker else verify(args.paths)))
        return 0

    start = time.perf_counter()
    files, generated = ensure_checkpoint(args.dir, args.size_gb, args.files)
    size_mb = sum(f.stat().st_size for f in files) / 2**20
    origin = f"generated in {time.perf_counter() - start:.1f} s" if generated else "cached"
    print(f"checkpoint: {len(files)} files, {size_mb:.0f} MB in {files[0].parent} ({origin})")
    try:
        check = spawn("verify", "all", files)
        available = bool(check.get("available"))
        failed = "error" in check or bool(check.get("errors"))
        if "error" in check:
            print(f"correctness: FAILED, the check crashed: {check['error']}")
        elif not available:
            print(f"fastsafetensors unavailable, skipping our rows: {check['reason']}")
        elif failed:
            print("correctness: FAILED: " + "; ".join(check["errors"]))
        else:
            print(f"correctness: OK, every tensor bitwise equal to safetensors "
                  f"(ours-file; ours with readers {', '.join(READERS)})")
        extra = [name for name in args.extra.split(",") if name]
        ours = (OURS if available else []) + [n for n in extra if available and n.startswith("ours")]
        peers = PEERS + [n for n in extra if not n.startswith("ours")]
        results, sound = measure(ours + peers + [COLD_ONLY, WARM_ONLY], files, args.runs)
        verdicts = report(results, size_mb)
        failed |= not sound
        if args.json:
            args.json.write_text(json.dumps({"checkpoint_mb": size_mb, "files": list(map(str, files)),
                                             "verify": check, "results": results,
                                             "verdicts": verdicts}, indent=1))
    finally:
        if generated and not args.keep:
            shutil.rmtree(files[0].parent, ignore_errors=True)
    if failed:
        print("\nFAILED: a loader crashed or returned wrong data (see above)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
