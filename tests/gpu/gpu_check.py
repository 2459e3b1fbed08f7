"""Validates the CUDA paths on a machine with a GPU: `make gpu-check`.

1. Bit-exactness of every path (GPUDirect Storage where available, staged with O_DIRECT,
   staged through the page cache) against safetensors, for every dtype, plus a file whose
   tensors are misaligned and a dtype cast on the device.
2. Memory accounting: device buffers show in torch.cuda.memory_allocated() and are freed
   when the tensors die.
3. Throughput, cold and warm, of each path against safetensors (safe_open(device="cuda")) and
   the physical limits: the disk (dd iflag=direct) and pinned host-to-device copies.

Exits 0 with a message on machines without CUDA; non-zero if any check fails.
"""

import argparse
import gc
import json
import os
import statistics
import struct
import subprocess
import sys
import tempfile
import time

import torch
from safetensors import safe_open as st_safe_open
from safetensors.torch import load_file as st_load_file
from safetensors.torch import save_file

import fastsafetensors_rs

DTYPES = [
    torch.float64, torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32,
    torch.int16, torch.int8, torch.uint8, torch.uint16, torch.uint32, torch.uint64, torch.bool,
    torch.complex64, torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz,
    torch.float8_e5m2fnuz, torch.float8_e8m0fnu, torch.float4_e2m1fn_x2,
]
FAILURES = []


def check(ok: bool, what: str) -> None:
    print(("  ok    " if ok else "  FAIL  ") + what)
    if not ok:
        FAILURES.append(what)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    t = t.contiguous()
    return t.reshape(-1).view(torch.uint8) if t.numel() else torch.empty(0, dtype=torch.uint8, device=t.device)


def same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(as_bytes(a).cpu(), as_bytes(b).cpu())


def all_dtypes_file(path: str) -> None:
    gen = torch.Generator().manual_seed(0)
    tensors = {}
    for i, dtype in enumerate(DTYPES):
        raw = torch.randint(0, 256, (37, 64), dtype=torch.uint8, generator=gen)
        if dtype == torch.bool:
            raw = raw % 2
        tensors[f"t{i}"] = raw.view(dtype) if dtype != torch.bool else raw.bool()
    tensors["empty"] = torch.empty(0, 5)
    tensors["scalar"] = torch.tensor(3.5, dtype=torch.float64)
    save_file(tensors, path)


def misaligned_file(path: str) -> dict:
    """A header of 7 mod 8 bytes: every multi-byte tensor is misaligned in memory."""
    data = {"a": torch.arange(100, dtype=torch.float32), "b": torch.arange(9, dtype=torch.int64)}
    header, blob, offset = {}, b"", 0
    for name, t in data.items():
        raw = t.numpy().tobytes()
        header[name] = {"dtype": {torch.float32: "F32", torch.int64: "I64"}[t.dtype], "shape": list(t.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        blob += raw
        offset += len(raw)
    text = json.dumps(header).encode()
    while (8 + len(text)) % 8 != 7:
        text += b" "
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + blob)
    return data


def paths_to_check() -> list:
    """(label, load kwargs) for every CUDA path this machine can take."""
    paths = [("staged-direct", dict(reader="direct", nogds=True)),
             ("staged-buffered", dict(reader="mmap", nogds=True)),
             ("auto", dict())]
    if os.path.exists("/proc/driver/nvidia-fs/stats"):
        paths.append(("gds", dict(nogds=False)))
    return paths


def correctness(tmp: str) -> None:
    print("correctness")
    path = os.path.join(tmp, "all.safetensors")
    all_dtypes_file(path)
    ref = st_load_file(path)
    for label, kwargs in paths_to_check():
        got, taken = fastsafetensors_rs.ops.load_with_report([path], "cuda", None, kwargs.get("reader"), kwargs.get("nogds"))
        check(all(t.is_cuda for t in got.values()), f"{label}: every tensor on cuda ({taken})")
        check(got.keys() == ref.keys() and all(same(got[k], ref[k]) for k in ref), f"{label}: all dtypes bit-exact")
    bad = os.path.join(tmp, "misaligned.safetensors")
    expected = misaligned_file(bad)
    got = fastsafetensors_rs.load_file(bad, device="cuda")
    check(all(same(got[k], v) for k, v in expected.items()), "misaligned tensors bit-exact")
    check(all(got[k].data_ptr() % got[k].element_size() == 0 for k in got), "misaligned tensors realigned")
    got = fastsafetensors_rs.load_file(path, device="cuda", dtype=torch.float16)
    check(got["t1"].dtype == torch.float16 and got["t1"].is_cuda and torch.equal(got["t1"].cpu(), ref["t1"].half()),
          "dtype cast on the device")


def memory(tmp: str) -> None:
    print("memory accounting")
    path = os.path.join(tmp, "mem.safetensors")
    save_file({f"w{i}": torch.empty(64 << 20, dtype=torch.uint8) for i in range(4)}, path)
    gc.collect()
    torch.cuda.synchronize()
    before = torch.cuda.memory_allocated()
    tensors = fastsafetensors_rs.load_file(path, device="cuda")
    during = torch.cuda.memory_allocated()
    size = os.path.getsize(path)
    check(during - before >= size, f"memory_allocated grew by {(during - before) >> 20} MiB for a {size >> 20} MiB file")
    del tensors
    gc.collect()
    after = torch.cuda.memory_allocated()
    check(after - before < (1 << 20), f"memory_allocated back to baseline after the tensors died ({(after - before)} bytes left)")


def evict(files) -> None:
    for f in files:
        fd = os.open(f, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)


def warm(files) -> None:
    for f in files:
        with open(f, "rb") as fh:
            while fh.read(64 << 20):
                pass


def timed(fn, files, cold: bool, runs: int) -> float:
    times = []
    for _ in range(runs):
        (evict if cold else warm)(files)
        torch.cuda.synchronize()
        start = time.perf_counter()
        out = fn()
        torch.cuda.synchronize()
        times.append(time.perf_counter() - start)
        del out
        gc.collect()
    return statistics.median(times)


def safetensors_to_cuda(files):
    out = {}
    for f in files:
        with st_safe_open(f, framework="pt", device="cuda") as h:
            for k in h.keys():
                out[k] = h.get_tensor(k)
    return out


def dd_bandwidth(files) -> float:
    evict(files)
    start = time.perf_counter()
    for f in files:
        subprocess.run(["dd", f"if={f}", "of=/dev/null", "bs=16M", "iflag=direct"], check=True, capture_output=True)
    return sum(map(os.path.getsize, files)) / (time.perf_counter() - start)


def h2d_bandwidth(nbytes: int) -> float:
    src = torch.empty(nbytes, dtype=torch.uint8).pin_memory()
    dst = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(3):
        dst.copy_(src, non_blocking=True)
    torch.cuda.synchronize()
    return 3 * nbytes / (time.perf_counter() - start)


def throughput(tmp: str, size_gb: float, runs: int) -> None:
    print(f"throughput ({size_gb} GB in 4 files, median of {runs})")
    per_file = int(size_gb * 1e9 / 4)
    files = []
    for i in range(4):
        f = os.path.join(tmp, f"bench-{i}.safetensors")
        rows = per_file // (4096 * 2)
        save_file({f"layer{i}.w{j}": torch.empty(rows // 8, 4096, dtype=torch.bfloat16) for j in range(8)}, f)
        files.append(f)
    nbytes = sum(map(os.path.getsize, files))
    loaders = {label: (lambda kw=kw: fastsafetensors_rs.load(files, device="cuda", **kw)) for label, kw in paths_to_check()}
    loaders["safetensors"] = lambda: safetensors_to_cuda(files)
    results = {(name, temp): nbytes / timed(fn, files, temp == "cold", runs) / 1e9
               for name, fn in loaders.items() for temp in ("cold", "warm")}
    disk, h2d = dd_bandwidth(files) / 1e9, h2d_bandwidth(1 << 30) / 1e9
    print(f"  limits: disk (dd iflag=direct) {disk:.2f} GB/s, pinned host->device {h2d:.2f} GB/s")
    print(f"  {'loader':<18}{'cold GB/s':>10}{'warm GB/s':>10}{'cold/limit':>11}{'warm/h2d':>9}{'cold/st':>8}{'warm/st':>8}")
    for name in loaders:
        c, w = results[(name, "cold")], results[(name, "warm")]
        print(f"  {name:<18}{c:>10.2f}{w:>10.2f}{c / min(disk, h2d):>11.2f}{w / h2d:>9.2f}"
              f"{c / results[('safetensors', 'cold')]:>8.2f}{w / results[('safetensors', 'warm')]:>8.2f}")
    staged_cold, staged_warm = results[("staged-direct", "cold")], results[("staged-buffered", "warm")]
    print(f"  target staged cold >= 0.9 x min(disk, h2d): {'PASS' if staged_cold >= 0.9 * min(disk, h2d) else 'MISS'}")
    print(f"  target staged warm >= 0.8 x h2d: {'PASS' if staged_warm >= 0.8 * h2d else 'MISS'}")
    best = max(results[(n, 'cold')] for n in loaders if n != "safetensors")
    print(f"  target >= 4.8 x safetensors (cold): {'PASS' if best >= 4.8 * results[('safetensors', 'cold')] else 'MISS'}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size-gb", type=float, default=4.0, help="checkpoint size for the throughput table")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--dir", default=None, help="where to write test files (default: a temp dir on disk)")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpu-check: no CUDA device here; nothing to validate (run this on a GPU machine)")
        return 0
    print(f"device: {torch.cuda.get_device_name()}, GDS (nvidia-fs): {os.path.exists('/proc/driver/nvidia-fs/stats')}")
    with tempfile.TemporaryDirectory(dir=args.dir or os.getcwd()) as tmp:
        correctness(tmp)
        memory(tmp)
        throughput(tmp, args.size_gb, args.runs)
    print("FAILED: " + "; ".join(FAILURES) if FAILURES else "all checks passed")
    return 1 if FAILURES else 0


if __name__ == "__main__":
    sys.exit(main())
