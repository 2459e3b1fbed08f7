"""Warm loads to CUDA through the staged path, by I/O thread count: the steady state of a
process that loads more than once (the pinned staging pool already allocated).

    python tests/gpu/warm_threads.py [--dir DIR] [--threads 4,8,16,32]

Writes a 2.1 GB checkpoint of 4 files (random bf16 bits) unless DIR already holds it, reads it
once so that it is in the page cache, then for each thread count and reader starts a fresh
process that loads it 4 times and prints the best of the last 3 in GB/s (file bytes / 1e9 / s),
against pinned host-to-device copy speed measured the same way.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile

CHILD = r"""
import os, sys, time, torch, fastsafetensors_rs
reader, files = sys.argv[1], sys.argv[2:]
torch.empty(1, device="cuda")
times = []
for _ in range(4):
    torch.cuda.synchronize()
    start = time.perf_counter()
    out = fastsafetensors_rs.load(files, device="cuda", reader=reader, nogds=True)
    torch.cuda.synchronize()
    times.append(time.perf_counter() - start)
    del out
print(f"{sum(os.path.getsize(f) for f in files) / 1e9 / min(times[1:]):.2f}")
"""

H2D = r"""
import time, torch
src = torch.empty(1 << 30, dtype=torch.uint8).pin_memory()
dst = torch.empty_like(src, device="cuda")
times = []
for _ in range(4):
    torch.cuda.synchronize()
    start = time.perf_counter()
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    times.append(time.perf_counter() - start)
print(f"{src.numel() / 1e9 / min(times[1:]):.2f}")
"""


def checkpoint(directory: str) -> list[str]:
    import torch
    from safetensors.torch import save_file

    files = [os.path.join(directory, f"warm-{i}.safetensors") for i in range(4)]
    if not all(os.path.exists(f) for f in files):
        gen = torch.Generator().manual_seed(0)
        for i, path in enumerate(files):
            save_file({f"file{i}.t{j}": torch.randint(0, 256, (1 << 27,), dtype=torch.uint8, generator=gen)
                       .view(torch.bfloat16).reshape(8192, -1) for j in range(4)}, path)
    for path in files:  # into the page cache
        with open(path, "rb") as f:
            while f.read(64 << 20):
                pass
    return files


def run(code: str, *args: str, env: dict | None = None) -> str:
    proc = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True,
                          env={**os.environ, **(env or {})}, timeout=300)
    if proc.returncode != 0:
        raise SystemExit(f"failed:\n{proc.stderr}")
    return proc.stdout.strip()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dir", default=None, help="where the checkpoint is (kept there)")
    parser.add_argument("--threads", default="4,8,16,32")
    args = parser.parse_args()
    import torch

    if not torch.cuda.is_available():
        print("no CUDA device: nothing to measure")
        return 0
    directory = args.dir or tempfile.mkdtemp(prefix="warm-threads-")
    files = checkpoint(directory)
    h2d = float(run(H2D))
    print(f"pinned host->device: {h2d:.2f} GB/s; {os.cpu_count()} CPUs")
    print("threads  reader  GB/s  / h2d")
    for threads in args.threads.split(","):
        for reader in ("mmap", "auto"):
            rate = float(run(CHILD, reader, *files, env={"FASTSAFETENSORS_THREADS": threads}))
            print(f"{threads:>7}  {reader:>6}  {rate:5.2f}  {rate / h2d:.2f}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
