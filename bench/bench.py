#!/usr/bin/env python3
"""Cold and warm page-cache load benchmark for fastsafetensors.

Every measurement runs in a fresh subprocess. The timed region starts just before
the load call and ends once one byte of every page of every returned tensor has
been read. fastsafetensors is compared with ``safetensors.torch.load_file`` and
with two physical limits: ``dd iflag=direct`` (cold) and an in-memory copy
(warm). See ``bench/README.md`` for the methodology.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import random
import resource
import shutil
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Iterable

import fanout
import scenarios

PAGE = os.sysconf("SC_PAGE_SIZE")
REPO = Path(__file__).resolve().parent.parent
READERS = ["auto", "direct", "mmap"]
# Where `--baseline` passes its directory to the workers.
BASELINE_ENV = "FASTSAFETENSORS_BENCH_BASELINE"
# Idle time before each cold run, so that no run inherits the tail of the previous one's I/O.
SETTLE_SECONDS = 2.0
Results = dict[str, dict[str, dict[str, Any]]]  # loader -> "cold"/"warm" -> summary


def modes(loader: str) -> list[str]:
    """The modes a row is measured in: dd is the cold limit, memcpy the warm one."""
    return ["cold"] if loader.startswith("dd") else ["warm"] if loader == "memcpy" else ["cold", "warm"]


# ----------------------------------------------------------------- checkpoint
def llama_shapes(total_bytes: int, min_layers: int = 4) -> list[tuple[str, tuple[int, ...]]]:
    """Llama-style bf16 tensor names and shapes adding up to about ``total_bytes``.

    The hidden size starts at 4096 (Llama-7B) and is halved until the embedding,
    the LM head and ``min_layers`` decoder layers fit; then as many layers as fit.
    """
    vocab, hidden = 32000, 4096
    while True:
        inter = hidden * 11008 // 4096
        layer = 2 * (4 * hidden * hidden + 3 * inter * hidden + 2 * hidden)
        fixed = 2 * (2 * vocab * hidden + hidden)
        if fixed + min_layers * layer <= total_bytes or hidden <= 256:
            break
        hidden //= 2
    shapes = [("model.embed_tokens.weight", (vocab, hidden))]
    for i in range(max(1, (total_bytes - fixed) // layer)):
        p = f"model.layers.{i}."
        shapes += [(f"{p}self_attn.{n}_proj.weight", (hidden, hidden)) for n in "qkvo"]
        shapes += [(p + "mlp.gate_proj.weight", (inter, hidden)),
                   (p + "mlp.up_proj.weight", (inter, hidden)),
                   (p + "mlp.down_proj.weight", (hidden, inter)),
                   (p + "input_layernorm.weight", (hidden,)),
                   (p + "post_attention_layernorm.weight", (hidden,))]
    return shapes + [("model.norm.weight", (hidden,)), ("lm_head.weight", (vocab, hidden))]


def ensure_checkpoint(root: Path, size_gb: float, nfiles: int) -> tuple[list[Path], bool]:
    """Return ``(files, generated)``, generating the checkpoint unless cached.

    A manifest records every file's size, so a partial or stale cache is rebuilt.
    Tensors hold random bits, so a loader reading at a wrong offset cannot match.
    """
    import numpy as np
    import torch
    from safetensors.torch import save_file

    ckpt = root / f"llama-{size_gb:g}gb-{nfiles}f"
    manifest = ckpt / "manifest.json"
    if manifest.exists():
        sizes: dict[str, int] = json.loads(manifest.read_text())
        if all((ckpt / f).exists() and (ckpt / f).stat().st_size == n for f, n in sizes.items()):
            return [ckpt / name for name in sizes], False
    shutil.rmtree(ckpt, ignore_errors=True)
    ckpt.mkdir(parents=True)
    shapes = llama_shapes(int(size_gb * 1e9))
    numels = [int(np.prod(shape)) for _, shape in shapes]
    share, groups, done = sum(numels) / nfiles, [[] for _ in range(nfiles)], 0
    for item, n in zip(shapes, numels):  # shards of about equal size, in order
        groups[min(int((done + n / 2) / share), nfiles - 1)].append(item)
        done += n
    groups = [g for g in groups if g]
    rng, sizes = np.random.default_rng(0), {}
    for k, group in enumerate(groups):
        tensors = {}
        for name, shape in group:
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


def cached_fraction(files: Iterable[Path]) -> float:
    """Fraction of the files' pages in the page cache, from ``mincore(2)``."""
    cached = total = 0
    for path in files:
        size, pages = path.stat().st_size, -(-path.stat().st_size // PAGE)
        with open(path, "rb") as fh:
            addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fh.fileno(), 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), f"mmap {path}")
            try:
                vec = (ctypes.c_ubyte * pages)()
                if _libc.mincore(addr, size, vec) != 0:
                    raise OSError(ctypes.get_errno(), f"mincore {path}")
                cached += sum(b & 1 for b in bytes(vec))
            finally:
                _libc.munmap(addr, size)
        total += pages
    return cached / max(total, 1)


def evict(files: Iterable[Path]) -> None:
    """Drop the files' (clean) pages from the page cache; needs no root."""
    for path in files:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def prewarm(files: Iterable[Path]) -> None:
    """Read the files once so that all their pages are in the page cache."""
    buf = bytearray(16 << 20)
    for path in files:
        with open(path, "rb", buffering=0) as fh:
            while fh.readinto(buf):
                pass


# ------------------------------------------------------------ worker process
def touch(tensors: Iterable[Any]) -> int:
    """Read one byte per page of every tensor (faulting in lazily mapped data)."""
    import torch

    checksum = 0
    for t in tensors:
        if t.numel():
            u8 = t.reshape(-1).view(torch.uint8)
            checksum += int(u8[::PAGE].sum()) + int(u8[-1])
    return checksum


def load(loader: str, files: list[str]) -> dict[str, Any]:
    """Load all files with ``ours[:reader]``, ``ours-file`` or ``safetensors[:backend]``."""
    import torch

    kind, _, option = loader.partition(":")
    if kind == "ours":  # one call for all files
        names, tensors = torch.ops.fastsafetensors.load(files, reader=option or None)
        return dict(zip(names, tensors))
    if kind == "ours-file":
        import fastsafetensors_rs
        return {k: v for f in files for k, v in fastsafetensors_rs.load_file(f).items()}
    from safetensors.torch import load_file
    return {k: v for f in files for k, v in load_file(f, backend=option or "mmap").items()}


def run_dd(files: list[str], parallel: bool) -> None:
    """Read the files with ``dd iflag=direct``, one after another or all at once."""
    cmds = [["dd", f"if={f}", "of=/dev/null", "bs=16M", "iflag=direct", "status=none"]
            for f in files]
    if not parallel:
        for cmd in cmds:
            subprocess.run(cmd, check=True)
        return
    for proc in [subprocess.Popen(cmd) for cmd in cmds]:
        if proc.wait():
            raise subprocess.CalledProcessError(proc.returncode, proc.args)


def worker(loader: str, files: list[str]) -> dict[str, Any]:
    """Take one timed measurement; runs in a fresh interpreter."""
    if loader.startswith("scenario:"):
        import scenarios

        return scenarios.worker(loader, files)
    loader = loader.removeprefix("base:")  # the other build is on the path already
    nbytes = sum(os.path.getsize(f) for f in files)
    if loader.startswith("dd"):
        start = time.perf_counter()
        run_dd(files, parallel=loader == "dd:parallel")
        return {"seconds": time.perf_counter() - start, "bytes": nbytes}
    import torch  # imports happen before the clock starts
    if loader.startswith("ours"):
        import fastsafetensors_rs  # noqa: F401  (registers torch.ops.fastsafetensors)
    elif loader.startswith("safetensors"):
        import safetensors.torch  # noqa: F401
    if loader == "memcpy":  # pre-faulted source and destination
        src = torch.empty(nbytes, dtype=torch.uint8).fill_(1)
        dst = torch.empty(nbytes, dtype=torch.uint8).fill_(0)
    with open("/proc/self/statm") as fh:
        base_kb = int(fh.read().split()[1]) * PAGE // 1024
    start = time.perf_counter()
    if loader == "ours-stream":  # each tensor touched and dropped as it arrives
        import fastsafetensors_rs
        checksum = sum(touch([t]) for _, t in fastsafetensors_rs.stream(files))
    else:
        tensors = {"dst": dst.copy_(src)} if loader == "memcpy" else load(loader, files)
        checksum = touch(tensors.values())
    seconds = time.perf_counter() - start
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return {"seconds": seconds, "bytes": nbytes, "base_kb": base_kb, "peak_kb": peak_kb,
            "checksum": checksum}


def verify(files: list[str]) -> dict[str, Any]:
    """Compare every tensor of each of our loaders bitwise with safetensors."""
    import torch
    from safetensors import safe_open
    try:
        import fastsafetensors_rs  # noqa: F401
        torch.ops.fastsafetensors.load  # noqa: B018
    except (ImportError, AttributeError, RuntimeError) as exc:
        return {"available": False, "reason": f"{type(exc).__name__}: {exc}"}
    errors = []
    for loader in ["ours-file"] + [f"ours:{reader}" for reader in READERS]:
        ours, expected = load(loader, files), 0
        for f in files:
            with safe_open(f, framework="pt") as ref:
                for name in ref.keys():
                    want, got, expected = ref.get_tensor(name), ours.get(name), expected + 1
                    same = (got is not None and got.dtype == want.dtype and got.shape == want.shape
                            and torch.equal(got.reshape(-1).view(torch.uint8),
                                            want.reshape(-1).view(torch.uint8)))
                    if not same:
                        errors.append(f"{loader}: tensor {name!r} differs")
        if len(ours) != expected:
            errors.append(f"{loader}: {len(ours)} tensors returned, expected {expected}")
        del ours
    return {"available": True, "errors": errors[:10]}


# ------------------------------------------------------------------- driver
def spawn(role: str, name: str, files: list[Path]) -> dict[str, Any]:
    """Run ``--worker``/``--verify`` in a fresh interpreter; parse its JSON reply. A ``base:``
    row runs with the ``--baseline`` build of the package first on the import path."""
    env = None
    if name.startswith("base:"):
        env = dict(os.environ, PYTHONPATH=os.environ[BASELINE_ENV])
    proc = subprocess.run([sys.executable, __file__, f"--{role}", name, *map(str, files)],
                          capture_output=True, text=True, env=env)
    lines = proc.stdout.strip().splitlines()
    if proc.returncode != 0 or not lines:
        code = proc.returncode
        why = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit status {code}"
        return {"error": f"{why} {proc.stderr.strip()[-2000:]}".strip()}
    return json.loads(lines[-1])


def measure(loaders: list[str], files: list[Path], runs: int) -> tuple[Results, bool]:
    """Median results per loader and mode, and whether every run was sound.

    Runs are interleaved across loaders so that slow drift affects all alike, in a new
    (seeded) order each round, and every cold run starts after the disk has been idle for
    ``SETTLE_SECONDS``: on virtual disks the read right after a burst of parallel I/O (the
    ``dd:parallel`` row) is measurably slower, a penalty a fixed order would always hand to
    the same loader.
    """
    samples: dict[tuple[str, str], list[dict[str, Any]]] = {}
    for mode in ("cold", "warm"):
        in_mode = [name for name in loaders if mode in modes(name)]
        for run in range(runs):
            order = in_mode[:]
            random.Random(run).shuffle(order)
            for loader in order:
                if mode == "cold":
                    evict(files)
                    time.sleep(SETTLE_SECONDS)
                else:
                    prewarm(files)
                cached = cached_fraction(files)
                if (cached > 0.01) if mode == "cold" else (cached < 0.99):
                    print(f"  warning: {cached:.1%} of the pages cached before a {mode} run")
                res = spawn("worker", loader, files)
                samples.setdefault((loader, mode), []).append(res)
                shown = res.get("error") or f"{res['bytes'] / res['seconds'] / 1e9:.2f} GB/s"
                print(f"  {mode} run {run + 1}/{runs}  {loader:<18}{shown}", flush=True)
    results: Results = {}
    # In the order the loaders were given, whatever order the last round ran them in.
    for (loader, mode), all_runs in sorted(samples.items(), key=lambda kv: loaders.index(kv[0][0])):
        ok = [r for r in all_runs if "error" not in r]
        entry: dict[str, Any] = {"runs": all_runs, "errors": len(all_runs) - len(ok)}
        if ok:
            entry["gbps"] = ok[0]["bytes"] / statistics.median(r["seconds"] for r in ok) / 1e9
        if ok and "peak_kb" in ok[0]:
            entry["peak_mb"] = max(r["peak_kb"] for r in ok) / 1024
            entry["delta_mb"] = max(r["peak_kb"] - r["base_kb"] for r in ok) / 1024
        results.setdefault(loader, {})[mode] = entry
    # Every file loader reads the same bytes, so all must agree on the touch checksum.
    sums = {r["checksum"] for (loader, _), rs in samples.items() if loader != "memcpy"
            for r in rs if "checksum" in r}
    if len(sums) > 1:
        print(f"  error: page-touch checksums differ between runs or loaders: {sorted(sums)}")
    return results, len(sums) <= 1 and not any(e["errors"] for r in results.values()
                                               for e in r.values())


def cell(value: float | None, fmt: str = "{:.2f}") -> str:
    """Format a table cell; ``-`` for a missing value."""
    return "-" if value is None else fmt.format(value)


def report(results: Results, size_mb: float) -> list[str]:
    """Print the table, the ratios and the target verdicts; return the verdicts."""
    def gbps(loader: str, mode: str) -> float | None:
        return results.get(loader, {}).get(mode, {}).get("gbps")

    def ratio(a: float | None, b: float | None) -> float | None:
        return a / b if a is not None and b else None

    print(f"\n{'loader':<18}{'cold GB/s':>10}{'warm GB/s':>10}{'peak RSS MB':>13}{'Δ MB':>8}")
    for loader, by_mode in results.items():
        speeds = ["crash" if e["errors"] and "gbps" not in e else cell(e.get("gbps"))
                  for e in (by_mode.get(m, {"errors": 0}) for m in ("cold", "warm"))]
        peak = max((e["peak_mb"] for e in by_mode.values() if "peak_mb" in e), default=None)
        delta = max((e["delta_mb"] for e in by_mode.values() if "delta_mb" in e), default=None)
        print(f"{loader:<18}{speeds[0]:>10}{speeds[1]:>10}{cell(peak, '{:.0f}'):>13}"
              f"{cell(delta, '{:.0f}'):>8}")
    cold, warm = gbps("ours", "cold"), gbps("ours", "warm")
    vs = {"dd (cold)": ratio(cold, gbps("dd", "cold")),
          "dd:parallel (cold)": ratio(cold, gbps("dd:parallel", "cold")),
          "memcpy (warm)": ratio(warm, gbps("memcpy", "warm")),
          "safetensors (cold)": ratio(cold, gbps("safetensors", "cold")),
          "safetensors (warm)": ratio(warm, gbps("safetensors", "warm"))}
    print()
    for label, value in vs.items():
        print(f"ours / {label:<20}{cell(value, '{:.2f}x')}")
    deltas = [e["delta_mb"] for e in results.get("ours", {}).values() if "delta_mb" in e]
    delta, rss_limit = max(deltas, default=None), 1.1 * size_mb + 200
    checks = [("cold: ours >= 0.9x dd", vs["dd (cold)"], 0.9, "{:.2f}x"),
              ("cold: ours >= 2.5x safetensors", vs["safetensors (cold)"], 2.5, "{:.2f}x"),
              ("warm: ours >= 0.8x safetensors", vs["safetensors (warm)"], 0.8, "{:.2f}x"),
              (f"RSS: ours peak - baseline <= 1.1 x size + 200 MB = {rss_limit:.0f} MB",
               delta, -rss_limit, "{:.0f} MB")]  # a negative bound is an upper bound
    verdicts = []
    for label, value, bound, fmt in checks:
        ok = value is not None and (value >= bound if bound > 0 else value <= -bound)
        verdict = "SKIP" if value is None else "PASS" if ok else "MISS"
        verdicts.append(f"[{verdict}] {label}  (measured: {cell(value, fmt)})")
    print("\ntargets:\n  " + "\n  ".join(verdicts))
    return verdicts


def parse_args() -> argparse.Namespace:
    """Command-line options; ``--worker`` and ``--verify`` are internal."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--size-gb", type=float, default=2.0, help="checkpoint size (GB, 1e9 bytes)")
    ap.add_argument("--files", type=int, default=4, help="number of .safetensors shards")
    ap.add_argument("--runs", type=int, default=3, help="runs per loader and mode (median)")
    ap.add_argument("--dir", type=Path, default=REPO / "bench-data", help="checkpoint cache")
    ap.add_argument("--keep", action="store_true", help="keep a newly generated checkpoint")
    ap.add_argument("--extra", default="", help="extra comma-separated rows, e.g. "
                    "ours:direct,ours:mmap,ours-stream,safetensors:pread")
    ap.add_argument("--json", type=Path, help="also write the results to this JSON file")
    ap.add_argument("--baseline", type=Path, help="another build of the package, installed with "
                    "`pip install --no-deps --target DIR WHEEL`, measured beside this one: its rows "
                    "are `base:ours` and `base:ours-file` (a change's before and after, in one run)")
    ap.add_argument("--no-throughput", action="store_true", help="skip the throughput table (scenarios only)")
    scenarios.add_arguments(ap)
    ap.add_argument("--worker", help=argparse.SUPPRESS)
    ap.add_argument("--verify", help=argparse.SUPPRESS)
    ap.add_argument("paths", nargs="*", help=argparse.SUPPRESS)
    return ap.parse_args()


def main() -> int:
    """Prepare the checkpoint, check correctness, measure and report."""
    args = parse_args()
    if args.worker or args.verify:
        print(json.dumps(worker(args.worker, args.paths) if args.worker else verify(args.paths)))
        return 0
    start = time.perf_counter()
    files, generated = ensure_checkpoint(args.dir, args.size_gb, args.files)
    generated_dirs = [files[0].parent] if generated else []
    size_mb = sum(f.stat().st_size for f in files) / 2**20
    origin = f"generated in {time.perf_counter() - start:.1f} s" if generated else "cached"
    print(f"checkpoint: {len(files)} files, {size_mb:.0f} MB, {files[0].parent} ({origin})")
    try:
        check = spawn("verify", "all", files)
        available = bool(check.get("available"))
        failed = "error" in check or bool(check.get("errors"))
        if "error" in check:
            print(f"correctness: FAILED, the check crashed: {check['error']}")
        elif not available:
            print(f"fastsafetensors_rs is not importable, skipping its rows: {check['reason']}")
        else:
            print("correctness: " + ("FAILED: " + "; ".join(check["errors"]) if failed else
                  f"OK, every tensor bitwise equal (ours-file; ours, readers {', '.join(READERS)})"))
        extra = [name for name in args.extra.split(",") if name]
        if args.baseline:
            os.environ[BASELINE_ENV] = str(args.baseline.resolve())
            extra += ["base:ours", "base:ours-file"]
        ours = (["ours", "ours-file"] if available else []) + [
            name for name in extra if available and name.startswith("ours")]
        peers = ["safetensors"] + [name for name in extra if not name.startswith("ours")]
        results, verdicts, sound = {}, [], True
        if not args.no_throughput:
            results, sound = measure(ours + peers + ["dd", "dd:parallel", "memcpy"], files, args.runs)
            verdicts = report(results, size_mb)
        scenario_results: dict[str, Any] = {}
        if available and args.scenarios:
            scenario_verdicts, scenarios_sound, scenario_results = scenarios.run(args, files)
            generated_dirs += [Path(g) for g in scenario_results.pop("generated")]
            sound = sound and scenarios_sound
            if "fanout" in args.scenarios.split(","):
                fanout_verdicts, scenario_results["fanout"] = fanout.run(files, args.runs)
                scenario_verdicts += fanout_verdicts
            print("\nscenario targets:\n  " + "\n  ".join(scenario_verdicts))
            verdicts += scenario_verdicts
        if args.json:
            args.json.write_text(json.dumps({"checkpoint_mb": size_mb, "files": list(map(str, files)),
                                             "verify": check, "results": results, "scenarios": scenario_results,
                                             "verdicts": verdicts}, indent=1))
    finally:
        if not args.keep:
            for d in generated_dirs:
                shutil.rmtree(d, ignore_errors=True)
    if failed or not sound:
        print("\nFAILED: a loader crashed or returned wrong data (see above)")
    return 1 if failed or not sound else 0


if __name__ == "__main__":
    sys.exit(main())
